"""``compress``: ProcrustesGPT structured compression with orthogonal transforms (seed 001, DESIGN.md §3),
and SliceGPT as a built-in baseline, saved as loadable Hugging Face models.

Pipeline (Llama-family checkpoints: llama, mistral without sliding window, qwen2):

1. **Plan** (no work yet): which matrices are compressed (q, k, o, gate, up, down, the embedding and an
   untied head; V stays dense as in the paper), the structure sizes that meet ``ratio`` — the fraction
   of those matrices' parameters removed, *after* paying for skip-connection matrices and the head's
   change of basis, so that every method compared at one ratio has the same total parameter count.
2. **Calibration** (one pass of the original model, batch by batch): per residual segment the
   covariance of the normalised stream (readers' inputs; rotating the model moves it to ``Qᵀ Σ Q``
   exactly, so the "rotated, uncompressed model" statistics of the paper come from this one pass),
   the inputs of ``o_proj`` and ``down_proj`` (writers), token counts (``√(D+1)`` weights of the
   embedding/head) and, for SliceGPT, the raw stream covariance. With ``sequential`` (stage W, one Q
   per segment) segment k's statistics come instead from the model whose segments before k are already
   compressed (as SliceGPT and GPTQ calibrate): a float32 forward of the norm-folded model over the
   calibration text, :class:`FoldedLlama`, in which each solved matrix is replaced by ``Ŵ Qᵀ``; with
   ``match_original`` (default) the matrices then target the original model's outputs and stream.
3. **Rotations and factors**: stage ``none`` (plain projection, Q = I), stage ``f`` (alternating
   Frobenius projection / Procrustes per segment), stage ``w`` (from stage F's Q: weighted projections
   and weighted Procrustes with the calibration covariances), see :mod:`..symmetry.segments`. Either one
   Q per residual segment (skip connections carry ``Q_prevᵀ Q_next``) or one global Q. SliceGPT: PCA of
   the stream per segment (or globally), then slicing.
4. **Assembly**: norms folded (:func:`actions.fold_layer_norms` / :func:`actions.fold_final_norm`), the
   rotations applied with :func:`actions.rotate_residual_layer` / :func:`actions.rotate_residual_globals`,
   structured factors in place of the compressed matrices, a :class:`CompressedLlamaForCausalLM`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ..architectures import Adapter
from ..checkpoint import CheckpointReader, atomic_output_dir, check_output_dir, copy_side_files
from ..hub.cards import public_report
from ..symmetry import actions
from ..symmetry import structured as st
from ..symmetry.segments import Term, balance, cayley_encode, solve_segment
from .stream import DictSource, TensorSource, partition_keys

Tensors = dict[str, torch.Tensor]

STRUCTURES = ("kron", "gs", "lowrank", "slice")
STAGES = ("none", "f", "w")
Q_MODES = ("segment", "global")
SUPPORTED_FAMILIES = ("llama", "qwen2")          # adapter families (llama covers mistral)
REPORT_FILE = "compression_report.json"

# canonical name -> (module path inside a decoder layer, role)
_LAYER_MODULES = {
    "q": ("self_attn.q_proj", "reader"), "k": ("self_attn.k_proj", "reader"), "v": ("self_attn.v_proj", "reader"),
    "o": ("self_attn.o_proj", "writer"), "gate": ("mlp.gate_proj", "reader"), "up": ("mlp.up_proj", "reader"),
    "down": ("mlp.down_proj", "writer"),
}
_SEGMENT_OFFSET = {"q": 0, "k": 0, "v": 0, "o": 1, "gate": 1, "up": 1, "down": 2}
_KRON_Q_CANDIDATES = (2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 18, 20, 24, 32, 48, 64)


# ---------------------------------------------------------------------------------------------
# Options and plan
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressOptions:
    """``ratio``: fraction of the compressed matrices' parameters removed, overheads (skip matrices,
    the tied head's change of basis) included — equal ratios mean equal total parameter counts."""
    structure: str = "kron"
    ratio: float = 0.25
    stage: str = "w"
    q_mode: str = "segment"
    kron_factor: int | None = None               # q: A_s is 1 x q (readers) / q x 1 (writers); must divide d
    gs_blocks: tuple[int, int] | None = None     # (kl, kr) tiles of layer matrices; embeddings use (1, kr)
    compress_embeddings: bool = True
    dense_modules: tuple[str, ...] = ("v",)      # the paper leaves V dense
    f_iters: int = 20
    w_iters: int = 1
    als_iters: int = 5
    wopp_iters: int = 50
    solver_dtype: str = "float32"                # iterations in float32 (fast), final projections in float64
    damping: float = 0.01                        # covariance damping, relative to the mean eigenvalue
    tolerance: float = 0.02                      # largest |achieved ratio − ratio| accepted
    calib_tokens: int = 16384
    calib_seq_len: int = 512
    sequential: bool = False                     # stage W statistics of the partly compressed model (FoldedLlama)
    match_original: bool = True                  # sequential: target the original model's outputs and stream

    def validate(self) -> None:
        if self.structure not in STRUCTURES:
            raise ValueError(f"unknown structure {self.structure!r}; choose one of {', '.join(STRUCTURES)}")
        if not 0.0 < float(self.ratio) < 1.0:
            raise ValueError(f"ratio must be in (0, 1) (the fraction of parameters removed), got {self.ratio}")
        if self.stage not in STAGES:
            raise ValueError(f"unknown stage {self.stage!r}; choose one of {', '.join(STAGES)}")
        if self.q_mode not in Q_MODES:
            raise ValueError(f"unknown q mode {self.q_mode!r}; choose one of {', '.join(Q_MODES)}")
        if self.kron_factor is not None and (not isinstance(self.kron_factor, int) or self.kron_factor < 2):
            raise ValueError(f"kron factor must be an integer >= 2, got {self.kron_factor!r}")
        if self.gs_blocks is not None and (len(self.gs_blocks) != 2 or min(self.gs_blocks) < 1):
            raise ValueError(f"gs blocks must be two positive integers (kl, kr), got {self.gs_blocks!r}")
        unknown = set(self.dense_modules) - set(_LAYER_MODULES)
        if unknown:
            raise ValueError(f"unknown dense modules {sorted(unknown)}; choose from {sorted(_LAYER_MODULES)}")
        if self.solver_dtype not in ("float32", "float64"):
            raise ValueError(f"solver dtype must be float32 or float64, got {self.solver_dtype!r}")
        if self.sequential and (self.stage != "w" or self.structure == "slice" or
                                (self.q_mode != "segment" and self.structure != "lowrank")):
            raise ValueError("sequential calibration applies to stage w with one rotation per segment "
                             "(--q-mode segment; low rank has no rotation), not to "
                             f"{self.structure} stage {self.stage} with q mode {self.q_mode}")
        for name in ("f_iters", "w_iters", "als_iters", "wopp_iters", "calib_tokens", "calib_seq_len"):
            if getattr(self, name) < 0 or (name.startswith("calib") and getattr(self, name) < 2):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")

    @property
    def needs_calibration(self) -> bool:
        return self.structure == "slice" or self.stage in ("f", "w")


@dataclass
class MatrixPlan:
    """One matrix as the solver sees it: ``M [k, d]`` with the residual dimension on its columns
    (readers ``W``, writers ``Wᵀ``, embedding ``E``, head ``W_head``)."""
    name: str                  # "layers.3.q_proj", "embed", "lm_head"
    canon: str                 # canonical key ("q", ..., "embed", "lm_head")
    layer: int | None
    role: str                  # reader | writer
    segment: int
    structure: st.Structure    # on M [k, d]
    bias: bool = False

    @property
    def module_structure(self) -> st.Structure:
        """The structure in the module's ``[out, in]`` orientation."""
        return self.structure if self.role == "reader" or self.canon == "embed" else self.structure.transpose()

    @property
    def compressed(self) -> bool:
        return not isinstance(self.structure, st.Dense)


@dataclass
class Plan:
    family: str
    hidden: int
    residual: int              # width of the compressed residual stream (< hidden for SliceGPT)
    n_layers: int
    tied: bool
    skip: str                  # none | orthogonal | dense
    lm_head: str               # tied | tied_mixed | separate
    matrices: list[MatrixPlan]
    accounting: dict = field(default_factory=dict)

    def layer_matrices(self, i: int) -> dict[str, MatrixPlan]:
        return {m.canon: m for m in self.matrices if m.layer == i}

    def by_name(self) -> dict[str, MatrixPlan]:
        return {m.name: m for m in self.matrices}


def _layer_bias(keys: set[str], adapter: Adapter, canon: str) -> bool:
    return f"{adapter.layer_prefix(0)}{_LAYER_MODULES[canon][0]}.bias" in keys


def check_family(config: dict, keys: list[str]) -> Adapter:
    """The adapter of a Llama-family checkpoint, or a clear error for anything else."""
    adapter = Adapter.from_config(config, keys)
    if adapter.family not in SUPPORTED_FAMILIES:
        raise ValueError(f"compress supports Llama-family models (llama, mistral, qwen2); "
                         f"{config.get('model_type')!r} is not supported")
    if adapter.layout.qk_norm:
        raise ValueError(f"compress does not support QK-norm models ({config.get('model_type')!r})")
    adapter.check_supports("residual_rotation")
    sliding = config.get("sliding_window")
    if sliding and (config.get("model_type") == "mistral" or config.get("use_sliding_window")):
        raise ValueError("compress does not support sliding-window attention (the compressed family uses full "
                         "causal attention)")
    if adapter.layout.rope_layout not in ("rotate_half", "none"):
        raise ValueError(f"compress supports rotate_half RoPE only, got {adapter.layout.rope_layout}")
    return adapter


def _divisors(n: int, candidates) -> list[int]:
    return [q for q in candidates if q <= n and n % q == 0]


def _kron_for(k: int, d: int, kappa: float, q: int) -> st.Kron:
    r = min(q, max(1, round(kappa * k * d / (q + k * d / q))))
    return st.Kron((k, d), r, (1, q))


def _choose_kron_factor(d: int, kappa: float, user: int | None) -> int:
    if user is not None:
        if d % user:
            raise ValueError(f"Kronecker factor {user} does not divide the hidden size {d}: factor shapes must "
                             f"divide the matrix (try one of {_divisors(d, range(2, 65))})")
        return user
    options = _divisors(d, [q for q in _KRON_Q_CANDIDATES if q <= max(2, d // 4)])  # A stays the small factor
    if not options:
        raise ValueError(f"no Kronecker factor in {_KRON_Q_CANDIDATES} divides the hidden size {d}")
    scored = [(abs(max(1, round(kappa * q)) / q - kappa), q) for q in options]
    good = [q for err, q in scored if err <= 0.01]
    return good[0] if good else min(scored)[1]


def _gs_for(k: int, d: int, kappa: float, blocks: tuple[int, int], name: str) -> st.GS:
    kl, kr = blocks
    if k % kl or d % kr:
        raise ValueError(f"GS blocks ({kl}, {kr}) do not divide {name} ({k}x{d} with the residual dimension on the "
                         "columns): factor shapes must divide the matrix")
    b = round(kappa * k * d / (kr * k + kl * d))
    return st.GS((k, d), kl, kr, min(max(1, b), k // kl, d // kr))


def _default_gs_blocks(k: int, d: int) -> tuple[int, int]:
    kl = next(x for x in (4, 2, 1) if k % x == 0)
    kr = next(x for x in (4, 2, 1) if d % x == 0)
    return kl, kr


def _structure_for(kind: str, name: str, k: int, d: int, kappa: float, options: CompressOptions,
                   kron_q: int | None, embedding: bool) -> st.Structure:
    if kind == "kron":
        return _kron_for(k, d, kappa, kron_q)
    if kind == "lowrank":
        return st.LowRank((k, d), min(max(1, round(kappa * k * d / (k + d))), min(k, d)))
    if kind == "gs":
        if options.gs_blocks is not None:
            blocks = (1, options.gs_blocks[1]) if embedding else tuple(options.gs_blocks)
        else:
            blocks = (1, _default_gs_blocks(k, d)[1]) if embedding else _default_gs_blocks(k, d)
        return _gs_for(k, d, kappa, blocks, name)
    raise AssertionError(kind)


def _matrix_shapes(adapter: Adapter, config: dict) -> dict[str, tuple[int, int]]:
    """``M [k, d]`` shapes of the canonical layer matrices."""
    L, d = adapter.layout, adapter.hidden
    inter = int(config.get("intermediate_size"))
    q_out, kv_out = L.n_heads * L.head_dim, L.n_kv_heads * L.head_dim
    return {"q": (q_out, d), "k": (kv_out, d), "v": (kv_out, d), "o": (q_out, d), "gate": (inter, d),
            "up": (inter, d), "down": (inter, d)}


def plan_compression(config: dict, keys: list[str], dense_total: int, final_gamma: torch.Tensor | None,
                     options: CompressOptions) -> Plan:
    """Decide every structure before any work; raises ValueError for what cannot be done."""
    options.validate()
    adapter = check_family(config, keys)
    keyset = set(keys)
    d, n_layers = adapter.hidden, adapter.n_layers
    vocab = int(config["vocab_size"])
    tied = adapter.tied_embeddings
    shapes = _matrix_shapes(adapter, config)
    # rotations cannot help low rank (the rank of M Q is that of M, also in the weighted norms), and
    # stage "none" has none: no segment bases, so no skip matrices to pay for
    segment = options.q_mode == "segment" and options.structure != "lowrank" and (
        options.stage != "none" or options.structure == "slice")
    slicing = options.structure == "slice"

    def policy(canon: str) -> bool:  # compressed under the ProcrustesGPT policy (also SliceGPT's budget)
        if canon in ("embed", "lm_head"):
            return options.compress_embeddings
        return canon not in options.dense_modules

    entries = [(f"layers.{i}.{_LAYER_MODULES[c][0].split('.')[1]}", c, i, _LAYER_MODULES[c][1],
                2 * i + _SEGMENT_OFFSET[c], shapes[c], _layer_bias(keyset, adapter, c))
               for i in range(n_layers) for c in _LAYER_MODULES]
    entries.append(("embed", "embed", None, "writer", 0, (vocab, d), False))
    if not tied:
        entries.append(("lm_head", "lm_head", None, "reader", 2 * n_layers, (vocab, d), False))
    p_compressed = sum(k * dd for _, c, _, _, _, (k, dd), _ in entries if policy(c))
    target_total = dense_total - options.ratio * p_compressed
    gamma_is_one = final_gamma is None or bool(torch.all(final_gamma == 1))

    if slicing:
        residual, structures = _plan_slice(entries, d, n_layers, tied, segment, target_total)
        skip = "dense" if segment else "none"
        lm_head = "tied_mixed" if tied else "separate"
    else:
        residual = d
        skip = "orthogonal" if segment else "none"
        lm_head = ("tied" if gamma_is_one and not segment else "tied_mixed") if tied else "separate"
        overhead = (2 * n_layers * d * (d + 1) // 2 if segment else 0) + (d * d if lm_head == "tied_mixed" else 0)
        kappa = ((1 - options.ratio) * p_compressed - overhead) / p_compressed
        if kappa <= 0:
            raise ValueError(f"ratio {options.ratio} cannot be met: the skip/head matrices alone need {overhead:,} "
                             f"parameters of the {(1 - options.ratio) * p_compressed:,.0f} left; "
                             "use a smaller ratio or --q-mode global")
        kron_q = _choose_kron_factor(d, kappa, options.kron_factor) if options.structure == "kron" else None
        structures = {}
        for name, canon, _, _, _, (k, dd), _ in entries:
            structures[name] = (_structure_for(options.structure, name, k, dd, kappa, options, kron_q,
                                               canon in ("embed", "lm_head"))
                                if policy(canon) else st.Dense((k, dd)))
    matrices = [MatrixPlan(name, canon, layer, role, seg, structures[name], bias)
                for name, canon, layer, role, seg, _, bias in entries]
    plan = Plan(adapter.family, d, residual, n_layers, tied, skip, lm_head, matrices)
    plan.accounting = _accounting(plan, dense_total, p_compressed, policy, options)
    achieved = plan.accounting["ratio_over_compressed"]
    if abs(achieved - options.ratio) > options.tolerance:
        raise ValueError(f"no {options.structure} configuration meets ratio {options.ratio:g} within "
                         f"{options.tolerance:g} (nearest: {achieved:.4f})" +
                         ("; try another --kron-factor" if options.structure == "kron" else ""))
    return plan


def _slice_total(dp: int, entries, n_layers: int, tied: bool, segment: bool, d: int) -> int:
    total = 0
    for _, _, _, role, _, (k, _), bias in entries:
        total += k * dp + (k if bias and role == "reader" else dp if bias else 0)
    total += (2 * n_layers * dp * dp if segment else 0) + (dp * dp if tied else 0)
    return total


def _plan_slice(entries, d, n_layers, tied, segment, target_total) -> tuple[int, dict]:
    """SliceGPT: the residual width d' whose total parameter count is closest to the target."""
    best = min(range(1, d + 1), key=lambda dp: abs(_slice_total(dp, entries, n_layers, tied, segment, d) - target_total))
    return best, {name: st.Dense((k, best)) for name, _, _, _, _, (k, _), _ in entries}


def _module_params(m: MatrixPlan, residual: int) -> int:
    bias = 0
    if m.bias:
        bias = m.structure.shape[0] if m.role == "reader" else residual
    return m.structure.params() + bias


def _accounting(plan: Plan, dense_total: int, p_compressed: int, policy, options: CompressOptions) -> dict:
    d, dr = plan.hidden, plan.residual
    skip_each = {"orthogonal": d * (d + 1) // 2, "dense": dr * dr, "none": 0}[plan.skip]
    skips = 2 * plan.n_layers * skip_each
    mix = dr * dr if plan.lm_head == "tied_mixed" else 0
    compressed_set = [m for m in plan.matrices if policy(m.canon)]
    structured = sum(m.structure.params() for m in compressed_set)
    total = sum(_module_params(m, dr) for m in plan.matrices) + skips + mix
    per_matrix = {m.name: {"structure": m.module_structure.spec(), "dense_params": m.structure.shape[0] * d,
                           "params": m.structure.params(),
                           "ratio": 1 - m.structure.params() / (m.structure.shape[0] * d)}
                  for m in plan.matrices}
    return {
        "target_ratio": options.ratio,
        "dense_params_of_compressed_matrices": p_compressed,
        "structured_params_of_compressed_matrices": structured,
        "skip_params": skips,
        "head_mix_params": mix,
        # removed parameters (norm weights, which fold away, included) per dense parameter of the
        # compressed matrices: equal for equal totals, whatever the method
        "ratio_over_compressed": (dense_total - total) / p_compressed,
        "ratio_per_matrix_mean": 1 - structured / p_compressed,
        "dense_model_params": dense_total,
        "compressed_model_params": total,
        "ratio_over_model": 1 - total / dense_total,
        "per_matrix": per_matrix,
    }


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------
@dataclass
class CalibrationStats:
    """Per-token second moments in the original basis (float64). Segment ``2i`` is read by layer i's
    attention, ``2i+1`` by its FFN, ``2L`` by the head."""
    tokens: int
    token_counts: torch.Tensor
    normed: list[torch.Tensor] | None = None      # RMSNorm(h) without γ: the folded readers' inputs
    stream: list[torch.Tensor] | None = None      # h itself (SliceGPT's PCA)
    attn_out: list[torch.Tensor] | None = None    # o_proj inputs
    mlp_hidden: list[torch.Tensor] | None = None  # down_proj inputs
    # sequential calibration matching the original model: X̂ᵀX / n, the partly compressed model's inputs
    # (those above) against the original model's at the same place
    normed_cross: list[torch.Tensor] | None = None
    attn_out_cross: list[torch.Tensor] | None = None
    mlp_hidden_cross: list[torch.Tensor] | None = None
    # ... and the writers' inputs X̂ against the residual stream's drift before them, X̂ᵀ(H − Ĥ) / n
    attn_out_drift: list[torch.Tensor] | None = None
    mlp_hidden_drift: list[torch.Tensor] | None = None


def calibration_batches(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``seq_len`` tokens (the last one may be shorter, never below 2)."""
    chunks = [ids[i:i + seq_len] for i in range(0, ids.numel(), seq_len)]
    return [c for c in chunks if c.numel() >= 2] or [ids]


@torch.no_grad()
def collect_statistics(model, adapter: Adapter, ids: torch.Tensor, seq_len: int, want_normed: bool,
                       want_stream: bool, progress: bool = True) -> CalibrationStats:
    """One pass of the (original) HF model over ``ids`` in chunks of ``seq_len``, accumulating the
    second moments with hooks; memory is one chunk's activations plus the d×d accumulators."""
    L, d, eps = adapter.n_layers, adapter.hidden, adapter.eps
    vocab = int(adapter.config["vocab_size"])
    stats = CalibrationStats(0, torch.bincount(ids.reshape(-1), minlength=vocab).to(torch.float64)[:vocab])
    if not (want_normed or want_stream):
        stats.tokens = ids.numel()
        return stats
    zeros = lambda n: torch.zeros(n, n, dtype=torch.float64)  # noqa: E731
    if want_normed:
        stats.normed = [zeros(d) for _ in range(2 * L + 1)]
        inter = model.get_submodule(f"{adapter.layer_prefix(0)}{adapter.spec.ffn.down}").in_features
        q_out = adapter.layout.n_heads * adapter.layout.head_dim
        stats.attn_out, stats.mlp_hidden = [zeros(q_out) for _ in range(L)], [zeros(inter) for _ in range(L)]
    if want_stream:
        stats.stream = [zeros(d) for _ in range(2 * L + 1)]

    def accumulate(acc: torch.Tensor, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        acc += (x.T @ x).double()

    def stream_hook(seg: int):
        def hook(_module, args):
            h = args[0]
            if stats.stream is not None:
                accumulate(stats.stream[seg], h)
            if stats.normed is not None:
                accumulate(stats.normed[seg], _rms_normalised(h.float(), eps))
        return hook

    def input_hook(acc: torch.Tensor):
        return lambda _module, args: accumulate(acc, args[0])

    s = adapter.spec
    handles = []
    try:
        for i in range(L):
            p = adapter.layer_prefix(i)
            handles.append(model.get_submodule(p + s.attn_norm.name).register_forward_pre_hook(stream_hook(2 * i)))
            handles.append(model.get_submodule(p + s.ffn_norm.name).register_forward_pre_hook(stream_hook(2 * i + 1)))
            if want_normed:
                handles.append(model.get_submodule(p + s.attention.o).register_forward_pre_hook(
                    input_hook(stats.attn_out[i])))
                handles.append(model.get_submodule(p + s.ffn.down).register_forward_pre_hook(
                    input_hook(stats.mlp_hidden[i])))
        handles.append(model.get_submodule(adapter.prefix + s.final_norm).register_forward_pre_hook(stream_hook(2 * L)))
        device = next(model.parameters()).device
        for chunk in tqdm(calibration_batches(ids, seq_len), desc="calibration", unit="batch", disable=not progress):
            model(input_ids=chunk.unsqueeze(0).to(device), use_cache=False)
            stats.tokens += chunk.numel()
    finally:
        for h in handles:
            h.remove()
    for group in (stats.normed, stats.stream, stats.attn_out, stats.mlp_hidden):
        for acc in group or []:
            acc /= max(stats.tokens, 1)
    return stats


def _rms_normalised(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without γ (γ is folded into the readers)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _moment(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token (cross) second moment ``xᵀy / n``, ``y = x`` by default (float32 product, float64 result,
    as :func:`collect_statistics`)."""
    return (x.T @ (x if y is None else y)).double() / x.shape[0]


class FoldedLlama:
    """The norm-folded model (RMSNorm without γ, γ in the readers) in float32 on all calibration batches
    at once, for sequential calibration. With one rotation per residual segment the compressed model
    *is* this model with every compressed matrix replaced by its approximation in the original basis,
    ``Ŵ Qᵀ`` (:meth:`replace`): RMSNorm commutes with the rotations and the skips are exact. :meth:`walk`
    visits the segments in order and measures each one on the model whose earlier segments are
    replaced (and, to match the original model, also runs the original alongside). Memory: the
    calibration activations (tokens × intermediate size), float32."""

    def __init__(self, layers: list[Tensors], globals_: Tensors, adapter: Adapter, model_config: dict,
                 ids: torch.Tensor, seq_len: int):
        from transformers.activations import ACT2FN

        self.weights = {f"{i}.{k}": v.float() for i, lw in enumerate(layers) for k, v in lw.items()
                        if "norm" not in k}
        self.weights["embed.weight"] = globals_["embed.weight"].float()
        self.original = dict(self.weights)      # replace() rebinds entries of self.weights only
        self.batches = [b.numel() for b in calibration_batches(ids, seq_len)]
        self.ids = ids[: sum(self.batches)]
        self.layout, self.eps, self.n_layers = adapter.layout, adapter.eps, len(layers)
        self.act = ACT2FN[model_config["hidden_act"]]
        self.cos, self.sin = _rope_tables(model_config, max(self.batches))

    def replace(self, m: MatrixPlan, M: torch.Tensor) -> None:
        """Use ``M`` (the solver's ``[k, d]`` orientation, original basis) for the matrix of ``m``."""
        key = f"{m.canon}.weight" if m.layer is None else f"{m.layer}.{m.canon}.weight"
        self.weights[key] = (M if m.role == "reader" or m.canon == "embed" else M.T).float()

    def walk(self, stats: CalibrationStats):
        """Yield the segments ``0, 1, …, 2L`` in order, each once its statistics (``normed``, its writer's
        ``attn_out``/``mlp_hidden``, and with ``stats.normed_cross`` set the ``*_cross`` and ``*_drift``
        moments against the original model) are in ``stats``; the matrices the caller replaces before resuming are used
        from then on (a segment's own writers still count as dense in the stream its readers see)."""
        original = self._segments(self.original) if stats.normed_cross is not None else None
        for k, (z, x, h) in enumerate(self._segments(self.weights)):
            writer, i = ("attn_out" if k % 2 else "mlp_hidden"), (k - 1) // 2
            if z is not None:
                getattr(stats, writer)[i] = _moment(z)
            stats.normed[k] = _moment(x)
            if original is not None:
                z0, x0, h0 = next(original)
                stats.normed_cross[k] = _moment(x, x0)
                if z is not None:
                    getattr(stats, writer + "_cross")[i] = _moment(z, z0)
                    getattr(stats, writer + "_drift")[i] = _moment(z, h0 - h)
                del z0, x0, h0
            del z, x, h
            yield k

    def _segments(self, weights: Tensors):
        """Per segment, in order: (its writer's input, the normalised stream its readers see, the stream
        before the writer — none for the embedding), reading ``weights`` anew after each yield."""
        embed = lambda: weights["embed.weight"][self.ids]  # noqa: E731
        yield None, self._norm(embed()), None
        h = embed()
        for i in range(self.n_layers):
            z = self._attention(self._norm(h), i, weights)
            yield z, self._norm(h + self._linear(z, i, "o", weights)), h
            h = h + self._linear(z, i, "o", weights)
            x = self._norm(h)
            u = self.act(self._linear(x, i, "gate", weights)) * self._linear(x, i, "up", weights)
            yield u, self._norm(h + self._linear(u, i, "down", weights)), h
            h = h + self._linear(u, i, "down", weights)

    def _linear(self, x: torch.Tensor, i: int, canon: str, weights: Tensors) -> torch.Tensor:
        y = x @ weights[f"{i}.{canon}.weight"].T
        bias = weights.get(f"{i}.{canon}.bias")
        return y if bias is None else y + bias

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_normalised(h, self.eps)

    def _attention(self, x: torch.Tensor, i: int, weights: Tensors) -> torch.Tensor:
        """Causal GQA attention per batch: the inputs of ``o_proj``."""
        L = self.layout
        q, k, v = (self._linear(x, i, c, weights) for c in ("q", "k", "v"))
        out, start = [], 0
        for n in self.batches:
            def heads(t, count):
                return t[start:start + n].view(1, n, count, L.head_dim).transpose(1, 2)
            qh, kh, vh = heads(q, L.n_heads), heads(k, L.n_kv_heads), heads(v, L.n_kv_heads)
            qh, kh = apply_rotary_pos_emb(qh, kh, self.cos[None, :n], self.sin[None, :n])
            groups = L.n_heads // L.n_kv_heads
            kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            out.append(o.transpose(1, 2).reshape(n, -1))
            start += n
        return torch.cat(out)


def _rope_tables(model_config: dict, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin [length, head_dim]`` of the compressed model's rotary embedding."""
    rotary = LlamaRotaryEmbedding(config=_config_object(model_config))
    cos, sin = rotary(torch.zeros(1, 1, 1), torch.arange(length)[None])
    return cos[0].float(), sin[0].float()


def _damped(G: torch.Tensor, damping: float) -> torch.Tensor:
    """``G + δ mean(diag G) I``: keeps every weighted problem well posed (GPTQ-style dampening)."""
    return G + damping * G.diagonal().mean().clamp_min(1e-12) * torch.eye(G.shape[0], dtype=G.dtype)


# ---------------------------------------------------------------------------------------------
# Rotations and factors
# ---------------------------------------------------------------------------------------------
def _matrix_of(m: MatrixPlan, layers: list[Tensors], globals_: Tensors) -> torch.Tensor:
    if m.canon == "embed":
        return globals_["embed.weight"]
    if m.canon == "lm_head":
        return globals_["lm_head.weight"]
    W = layers[m.layer][f"{m.canon}.weight"]
    return W if m.role == "reader" else W.T


def _matched(m: MatrixPlan, M: torch.Tensor, stats: CalibrationStats, damping: float) -> torch.Tensor:
    """GPTQ-style target of sequential calibration matching the original model: on the partly compressed
    model's inputs X̂ the matrix that best reproduces the original outputs X M (readers act on the other
    side) and, for writers, also undoes the residual stream's drift D = H − Ĥ before them; least squares
    ridge-regularised towards M itself, so that X̂ = X gives M back exactly:
    ``(X̂ᵀX̂ + δI)⁻¹ ((X̂ᵀX + δI) M + X̂ᵀD)`` — then approximated in the metric X̂ᵀX̂ like any stage W term."""
    if m.role == "reader":
        G, Cx, drift = stats.normed[m.segment], stats.normed_cross[m.segment], 0
    else:
        key = "attn_out" if m.canon == "o" else "mlp_hidden"
        G, Cx = getattr(stats, key)[m.layer], getattr(stats, key + "_cross")[m.layer]
        drift = getattr(stats, key + "_drift")[m.layer]
    ridge = _damped(G, damping) - G
    target = M.T if m.role == "reader" else M
    out = torch.linalg.solve(G + ridge, (Cx + ridge) @ target + drift)
    return out.T if m.role == "reader" else out


def _terms(plan: Plan, layers, globals_, stats: CalibrationStats | None, stage: str,
           options: CompressOptions, only: int | None = None) -> list[tuple[list[Term], list[Term]]]:
    """Per segment: (terms, readers) of the compressed matrices, weighted for ``stage`` (only segment
    ``only`` filled when given: sequential calibration has the statistics of one segment at a time)."""
    n_seg = 2 * plan.n_layers + 1
    segments: list[tuple[list[Term], list[Term]]] = [([], []) for _ in range(n_seg)]
    token_gram = None if stats is None else st.Gram(diag=stats.token_counts + 1.0)   # (√(D+1))²
    weighted = stage == "w" and stats is not None and stats.normed is not None
    reader_cov: dict[int, torch.Tensor] = {}      # one tensor per segment, shared by its readers
    for m in plan.matrices:
        if not m.compressed or (only is not None and m.segment != only):
            continue
        M = _matrix_of(m, layers, globals_)
        if weighted and stats.normed_cross is not None and m.canon != "embed":
            M = _matched(m, M, stats, options.damping)
        term = Term(m.name, M, m.structure)
        if m.canon in ("embed", "lm_head") and stage in ("f", "w") and token_gram is not None:
            if m.canon == "embed" or stage == "f":
                term.row_gram = token_gram
        if weighted:
            if m.role == "reader" and term.row_gram is None:
                if m.segment not in reader_cov:
                    reader_cov[m.segment] = _damped(stats.normed[m.segment], options.damping)
                term.col_gram = reader_cov[m.segment]
            elif m.canon == "o":
                term.row_gram = st.Gram(matrix=_damped(stats.attn_out[m.layer], options.damping))
            elif m.canon == "down":
                term.row_gram = st.Gram(matrix=_damped(stats.mlp_hidden[m.layer], options.damping))
        terms, readers = segments[m.segment]
        terms.append(term)
        if m.role == "reader":
            readers.append(term)
    for terms, readers in segments:
        if stage != "none":
            balance(terms, readers)
    return segments


@dataclass
class SolveResult:
    Qs: list[torch.Tensor]                       # one per segment (the same tensor in global mode)
    factors: dict[str, st.Factors]               # per compressed matrix, M orientation
    traces: dict[str, list[float]]               # objective traces per solved problem
    relative_errors: dict[str, float]
    stats: CalibrationStats | None = None        # sequential calibration: the statistics it measured


def _solve_stage(plan, layers, globals_, stats, stage, options, Q_init, iters, desc, progress):
    segments = _terms(plan, layers, globals_, stats, stage, options)
    traces = {}
    dtype = getattr(torch, options.solver_dtype)
    if options.q_mode == "global":
        terms = [t for seg, _ in segments for t in seg]
        res = solve_segment(terms, Q_init[0], iters, options.als_iters, options.wopp_iters, dtype=dtype)
        Qs = [res.Q] * len(segments)
        traces["global"] = res.trace
        all_terms = terms
    else:
        Qs, all_terms = [], []
        for k, (terms, _) in enumerate(tqdm(segments, desc=desc, unit="segment", disable=not progress)):
            res = solve_segment(terms, Q_init[k], iters, options.als_iters, options.wopp_iters, dtype=dtype)
            Qs.append(res.Q)
            traces[f"segment{k}"] = res.trace
            all_terms += terms
    return Qs, all_terms, traces


def _solve_sequential(plan, layers, globals_, stats, options, Q_init, net: FoldedLlama, progress):
    """Stage W with sequential calibration (SliceGPT/GPTQ-style): segment k is weighted by the
    statistics of the model whose segments before k are already compressed, measured by ``net``, and
    its matrices are replaced in ``net`` by their approximations once solved. ``match_original``: each
    matrix then targets the original model's outputs and writers the original residual stream
    (:func:`_matched`), instead of the matrix's own outputs on X̂."""
    n_seg = 2 * plan.n_layers + 1
    L = plan.n_layers
    seq = CalibrationStats(stats.tokens, stats.token_counts, [None] * n_seg, None, [None] * L, [None] * L)
    if options.match_original:
        seq.normed_cross = [None] * n_seg
        for name in ("attn_out_cross", "mlp_hidden_cross", "attn_out_drift", "mlp_hidden_drift"):
            setattr(seq, name, [None] * L)
    iters = 0 if options.structure == "lowrank" else options.w_iters
    dtype = getattr(torch, options.solver_dtype)
    ms = plan.by_name()
    Qs, all_terms, traces = [], [], {}
    for k in tqdm(net.walk(seq), total=n_seg, desc="stage W (sequential)", unit="segment", disable=not progress):
        terms, _ = _terms(plan, layers, globals_, seq, "w", options, only=k)[k]
        res = solve_segment(terms, Q_init[k], iters, options.als_iters, options.wopp_iters, dtype=dtype)
        for t in terms:
            net.replace(ms[t.name], t.structure.dense(t.factors) @ res.Q.T)
        Qs.append(res.Q)
        traces[f"segment{k}"] = res.trace
        all_terms += terms
    return Qs, all_terms, traces, seq


def solve(plan: Plan, layers: list[Tensors], globals_: Tensors, stats: CalibrationStats | None,
          options: CompressOptions, progress: bool = True, rotations: list[torch.Tensor] | None = None,
          net: FoldedLlama | None = None) -> SolveResult:
    """The rotations and structured factors of ``options.stage`` (or SliceGPT's PCA rotations).
    ``rotations`` (one per segment) replaces the identity as the starting point — with stage ``none``
    the factors are simply projected at these rotations. ``net``: the calibration forward of
    ``options.sequential``."""
    n_seg = 2 * plan.n_layers + 1
    if options.sequential and net is None:
        raise ValueError("sequential calibration needs the calibration forward (a FoldedLlama)")
    eye = torch.eye(plan.hidden, dtype=torch.float64)
    if options.structure == "slice":
        return SolveResult(_pca_rotations(stats, n_seg, options.q_mode), {}, {}, {})
    Q0 = list(rotations) if rotations is not None else [eye] * n_seg
    seq = None
    if options.stage == "none" or (options.structure == "lowrank" and not options.sequential):
        # low rank: no rotation can lower the error, the stage only picks the weighting
        Qs, terms, traces = _solve_stage(plan, layers, globals_, stats, options.stage, options, Q0, 0,
                                         "projection", progress)
    elif options.structure == "lowrank":     # sequential: one segment after the other, Q = I
        Qs, terms, traces, seq = _solve_sequential(plan, layers, globals_, stats, options, Q0, net, progress)
    else:
        Qs, terms, traces = _solve_stage(plan, layers, globals_, stats, "f", options, Q0, options.f_iters,
                                         "stage F", progress)
        if options.stage == "w":
            Qs, terms, w_traces, seq = (
                _solve_sequential(plan, layers, globals_, stats, options, Qs, net, progress) if options.sequential
                else (*_solve_stage(plan, layers, globals_, stats, "w", options, Qs, options.w_iters, "stage W",
                                    progress), None))
            traces = {**{f"F/{k}": v for k, v in traces.items()}, **{f"W/{k}": v for k, v in w_traces.items()}}
    factors, rel = {}, {}
    for t in terms:
        factors[t.name] = t.factors
        Q = Qs[plan.by_name()[t.name].segment]
        rel[t.name] = float(torch.linalg.matrix_norm(t.M @ Q - t.structure.dense(t.factors)) /
                            torch.linalg.matrix_norm(t.M).clamp_min(1e-300))
    return SolveResult(Qs, factors, traces, rel, seq)


def _pca_rotations(stats: CalibrationStats, n_seg: int, q_mode: str) -> list[torch.Tensor]:
    """SliceGPT: eigenvectors of the residual stream's second moment, largest first."""
    def pca(C):
        lam, V = torch.linalg.eigh((C + C.T) / 2)
        return V[:, torch.argsort(lam, descending=True)]
    if q_mode == "global":
        Q = pca(sum(C / C.trace().clamp_min(1e-300) for C in stats.stream))
        return [Q] * n_seg
    return [pca(C) for C in stats.stream]


# ---------------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------------
def module_tensors(structure: st.Structure, factors: st.Factors) -> Tensors:
    """Factors (math layout, :mod:`..symmetry.structured`) -> the parameters of the matching module of
    ``modeling_compressed_llama`` (``[out, in]`` orientation)."""
    if structure.kind == "dense":
        return {"weight": factors[0]}
    if structure.kind == "lowrank":
        return {"lr_u": factors[0], "lr_v": factors[1]}
    if structure.kind == "kron":
        return {"kron_a": factors[0].permute(1, 0, 2), "kron_b": factors[1].permute(1, 0, 2)}
    if structure.kind == "gs":
        return {"gs_left": factors[0], "gs_right": factors[1]}
    raise AssertionError(structure.kind)


def _module_factors(m: MatrixPlan, res: SolveResult) -> st.Factors:
    f = res.factors[m.name]
    return f if m.module_structure is m.structure else m.structure.transpose_factors(f)


def assemble(plan: Plan, layers: list[Tensors], globals_: Tensors, gamma: torch.Tensor, res: SolveResult,
             dtype: torch.dtype, progress: bool = True) -> Tensors:
    """The compressed model's state dict (cast to ``dtype``) from the norm-folded layers and globals and
    the final norm's γ."""
    dr, Qs, L = plan.residual, res.Qs, plan.n_layers
    out: Tensors = {}

    def put(prefix: str, tensors: Tensors) -> None:
        for k, v in tensors.items():
            out[f"{prefix}.{k}"] = v.to(dtype).contiguous()

    def matrix(m: MatrixPlan, rotated: torch.Tensor, prefix: str, bias: torch.Tensor | None) -> None:
        """``rotated``: the exactly rotated ``[out, in]`` matrix, used when ``m`` stays dense."""
        if m.compressed:
            tensors = module_tensors(m.module_structure, _module_factors(m, res))
        else:
            sliced = rotated[:, :dr] if (m.role == "reader" or m.canon == "embed") else rotated[:dr, :]
            tensors = {"weight": sliced}
        if bias is not None:
            tensors["bias"] = bias if m.role == "reader" else bias[:dr]
        put(prefix, tensors)

    rot_g = actions.rotate_residual_globals(globals_, Qs[0], Qs[2 * L])
    ms = plan.by_name()
    matrix(ms["embed"], rot_g["embed.weight"], "model.embed_tokens.matrix", None)
    for i in tqdm(range(L), desc="assemble", unit="layer", disable=not progress):
        rot = actions.rotate_residual_layer(layers[i], Qs[2 * i], Qs[2 * i + 1], Qs[2 * i + 2])
        for canon, m in plan.layer_matrices(i).items():
            path = _LAYER_MODULES[canon][0]
            matrix(m, rot[f"{canon}.weight"], f"model.layers.{i}.{path}", rot.get(f"{canon}.bias"))
        for name, (a, b) in (("attn_skip", (2 * i, 2 * i + 1)), ("mlp_skip", (2 * i + 1, 2 * i + 2))):
            _put_skip(put, f"model.layers.{i}.{name}", plan.skip, Qs[a][:, :dr].T @ Qs[b][:, :dr])
    if plan.lm_head == "separate":
        matrix(ms["lm_head"], rot_g["lm_head.weight"], "lm_head", None)
    elif plan.lm_head == "tied_mixed":
        M = Qs[2 * L][:, :dr].T @ (gamma[:, None] * Qs[0][:, :dr])   # logits = RMSNorm(s) M Êᵀ
        put("head_mix", {"weight": M.T})
    return out


def _put_skip(put, prefix: str, kind: str, S: torch.Tensor) -> None:
    if kind == "none":
        return
    if kind == "dense":
        put(prefix, {"weight": S.T})
        return
    from ..modeling.modeling_compressed_llama import cayley_decode

    k, signs = cayley_encode(S)
    err = (cayley_decode(k, signs) - S).abs().max().item()
    if err > 1e-8:
        raise RuntimeError(f"{prefix}: Cayley encoding of the skip rotation is inaccurate ({err:.1e})")
    put(prefix, {"skip_k": k, "skip_signs": signs})


def compressed_config(config: dict, plan: Plan, options: CompressOptions, hf_config=None) -> dict:
    """Config dict of the ``hf_symmetry_compressed_llama`` model."""
    ms = plan.by_name()

    def spec(m: MatrixPlan) -> dict:
        return {**m.module_structure.spec(), "bias": m.bias}

    layer_structures = [{_LAYER_MODULES[c][0].split(".")[1]: spec(m) for c, m in plan.layer_matrices(i).items()}
                        for i in range(plan.n_layers)]
    rope = getattr(hf_config, "rope_parameters", None) if hf_config is not None else config.get("rope_parameters")
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}
    L = Adapter.from_config(config).layout
    new = {
        "architectures": ["CompressedLlamaForCausalLM"],
        "model_type": "hf_symmetry_compressed_llama",
        "vocab_size": int(config["vocab_size"]), "hidden_size": plan.hidden, "residual_size": plan.residual,
        "intermediate_size": int(config["intermediate_size"]), "num_hidden_layers": plan.n_layers,
        "num_attention_heads": L.n_heads, "num_key_value_heads": L.n_kv_heads, "head_dim": L.head_dim,
        "hidden_act": config.get("hidden_act", "silu"),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "initializer_range": float(config.get("initializer_range", 0.02)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
        "attention_dropout": float(config.get("attention_dropout", 0.0) or 0.0),
        "rope_parameters": dict(rope), "skip_connections": plan.skip, "lm_head": plan.lm_head,
        "layer_structures": layer_structures, "embed_structure": spec(ms["embed"]),
        "lm_head_structure": spec(ms["lm_head"]) if "lm_head" in ms else None,
        "compression": {"method": "slicegpt" if options.structure == "slice" else "procrustesgpt",
                        "structure": options.structure, "stage": options.stage, "q_mode": options.q_mode,
                        "ratio": options.ratio,
                        "ratio_over_compressed": plan.accounting["ratio_over_compressed"],
                        "ratio_over_model": plan.accounting["ratio_over_model"],
                        "source_model_type": config.get("model_type")},
    }
    return new


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
@dataclass
class CompressReport:
    source: str
    output: str | None
    family: str
    options: dict
    accounting: dict
    relative_errors: dict
    objective: dict                  # per solved problem: first and last objective value, steps
    calibration_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _source_numels(source: TensorSource, keys: list[str], tied: bool) -> int:
    """Parameters of the source model (tied weights once)."""
    keys = [k for k in keys if not (tied and k == "lm_head.weight")]
    if isinstance(source, DictSource):
        return sum(source.state_dict[k].numel() for k in keys)
    from safetensors import safe_open

    total = 0
    by_file: dict[str, list[str]] = {}
    for k in keys:
        by_file.setdefault(source.key_to_file[k], []).append(k)
    for fname, ks in by_file.items():
        with safe_open(source.path / fname, framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in ks)
    return total


def read_folded(source: TensorSource, adapter: Adapter, keys: list[str], tied: bool):
    """Canonical float64 layers with both norms folded, the globals with the final norm folded into an
    untied head (a tied head has none: the final γ goes into the head's change of basis), and that γ."""
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    rest = [k for k in rest if not k.endswith("rotary_emb.inv_freq")]
    if rest:
        raise ValueError(f"checkpoint has tensors compress does not know how to carry: {rest[:4]}")
    g = adapter.read_globals(source.get(global_keys))
    if tied:
        g.pop("lm_head.weight", None)
    gamma = g["final_norm.weight"].clone()
    layers = [actions.fold_layer_norms(adapter.read_layer(i, source.get(per_layer[i])))
              for i in range(adapter.n_layers)]
    return layers, actions.fold_final_norm(g), gamma


def _final_gamma(source: TensorSource, adapter: Adapter) -> torch.Tensor:
    name = f"{adapter.prefix}{adapter.spec.final_norm}.weight"
    return source.get([name])[name].to(torch.float64)


def _summarise(traces: dict) -> dict:
    return {k: {"first": v[0], "last": v[-1], "steps": len(v)} for k, v in traces.items() if v}


def plan_for(source: TensorSource, config: dict, options: CompressOptions) -> tuple[Plan, Adapter]:
    keys = source.keys()
    adapter = check_family(config, keys)
    dense_total = _source_numels(source, keys, adapter.tied_embeddings)
    return plan_compression(config, keys, dense_total, _final_gamma(source, adapter), options), adapter


def compress_tensors(source: TensorSource, config: dict, options: CompressOptions, calib_model=None,
                     calib_ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                     progress: bool = True, plan: Plan | None = None, stats: CalibrationStats | None = None,
                     hf_config=None, rotations: list[torch.Tensor] | None = None) -> tuple[Tensors, dict, CompressReport]:
    """The whole pipeline on tensors: (compressed state dict, config dict, report). ``stats`` may be
    passed in (e.g. cached by a benchmark) instead of ``calib_model``/``calib_ids``; ``plan`` and
    ``rotations`` override the planned structures and the starting rotations (see :func:`solve`)."""
    times = {}
    t0 = time.perf_counter()
    if plan is None:
        plan, adapter = plan_for(source, config, options)
    else:
        adapter = check_family(config, source.keys())
    if stats is None and options.needs_calibration:
        if calib_ids is None or calib_ids.numel() < 2:
            raise ValueError("this compression needs calibration text (--calib) with at least two tokens")
        stats = collect_statistics(calib_model, adapter, calib_ids[: options.calib_tokens], options.calib_seq_len,
                                   want_normed=options.stage == "w" and options.structure != "slice"
                                   and not options.sequential,
                                   want_stream=options.structure == "slice", progress=progress)
    times["calibration"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    layers, globals_, gamma = read_folded(source, adapter, source.keys(), plan.tied)
    new_config = compressed_config(config, plan, options, hf_config)
    net = None
    if options.sequential:
        if calib_ids is None or calib_ids.numel() < 2:
            raise ValueError("sequential calibration needs calibration text with at least two tokens")
        net = FoldedLlama(layers, globals_, adapter, new_config, calib_ids[: options.calib_tokens],
                          options.calib_seq_len)
    with st.limit_threads(1):
        res = solve(plan, layers, globals_, stats, options, progress, rotations, net)
    del net
    times["solve"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    state = assemble(plan, layers, globals_, gamma, res, dtype, progress)
    times["assemble"] = time.perf_counter() - t2
    report = CompressReport(source="", output=None, family=plan.family, options=asdict(options),
                            accounting=plan.accounting, relative_errors=res.relative_errors,
                            objective=_summarise(res.traces), calibration_tokens=stats.tokens if stats else 0,
                            seconds=times)
    return state, new_config, report


def _config_object(config: dict):
    """The :class:`CompressedLlamaConfig` of a :func:`compressed_config` dict."""
    from ..modeling.configuration_compressed_llama import CompressedLlamaConfig

    cfg = CompressedLlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    cfg.architectures = ["CompressedLlamaForCausalLM"]
    return cfg


def build_model(state: Tensors, config: dict, dtype: torch.dtype = torch.float32):
    """A :class:`CompressedLlamaForCausalLM` holding ``state`` (strict: every parameter accounted for)."""
    from ..modeling.modeling_compressed_llama import CompressedLlamaForCausalLM

    model = CompressedLlamaForCausalLM(_config_object(config)).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"compressed state does not match the model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs"))
    return model.eval(), counted


def compress_model(model, options: CompressOptions, calib_ids: torch.Tensor | None = None, progress: bool = False,
                   stats: CalibrationStats | None = None):
    """In memory: a loaded HF Llama-family model -> (CompressedLlamaForCausalLM, report)."""
    options.validate()
    dtype = next(model.parameters()).dtype
    config = model.config.to_dict()
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    state, new_config, report = compress_tensors(source, config, options, calib_model=model, calib_ids=calib_ids,
                                                 dtype=dtype, progress=progress, stats=stats, hf_config=model.config)
    compressed, counted = build_model(state, new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return compressed, report


def compress_checkpoint(src: str | Path, out: str | Path, options: CompressOptions, calib_text: str | Path | None,
                        overwrite: bool = False, progress: bool = True, eval_text: str | Path | None = None,
                        eval_tokens: int = 4096) -> CompressReport:
    """Compress the HF folder ``src`` into ``out`` (loadable with ``trust_remote_code=True``). Every
    input is checked before any work; ``out`` appears only when everything succeeded."""
    from transformers import AutoConfig

    from ..evaluation.compare import load_model, load_tokenizer
    from ..evaluation.perplexity import perplexity, read_text, tokenize_text

    options.validate()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    plan, adapter = plan_for(reader, reader.config, options)
    calib_ids = None
    if options.needs_calibration:
        if calib_text is None:
            raise ValueError(f"--calib is required for {'SliceGPT' if options.structure == 'slice' else 'stage ' + options.stage}"
                             " (calibration text: a UTF-8 file or an embedded name)")
        text = read_text(calib_text)          # an empty file fails here, before anything is loaded
        calib_ids = tokenize_text(load_tokenizer(src), text, max_tokens=options.calib_tokens)
        if calib_ids.numel() < 2:
            raise ValueError(f"calibration text {calib_text} has fewer than two tokens")
    eval_ids = None
    if eval_text is not None:
        text = read_text(eval_text)
        eval_ids = tokenize_text(load_tokenizer(src), text, max_tokens=eval_tokens)
    hf_config = AutoConfig.from_pretrained(src)
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    calib_model = (load_model(src) if options.structure == "slice" or (options.stage == "w" and not options.sequential)
                   else None)
    state, new_config, report = compress_tensors(reader, reader.config, options, calib_model=calib_model,
                                                 calib_ids=calib_ids, dtype=dtype, progress=progress, plan=plan,
                                                 hf_config=hf_config)
    del calib_model
    model, counted = build_model(state, new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    report.source, report.output = str(src), str(out)
    if eval_ids is not None:
        original = load_model(src)
        window, stride = 512, 256
        report.perplexity = {"text": str(eval_text), "tokens": int(eval_ids.numel()), "window": window,
                             "stride": stride,
                             "original": perplexity(original, eval_ids, window, stride, progress=False).perplexity,
                             "compressed": perplexity(model, eval_ids, window, stride, progress=False).perplexity}
        del original
    with atomic_output_dir(out, overwrite) as tmp:
        model.save_pretrained(tmp)
        copy_side_files(reader.path, tmp)
        (tmp / REPORT_FILE).write_text(json.dumps(public_report(report.as_dict()), indent=2, default=str) + "\n")
        _write_card(tmp, report)
    return report


def _write_card(folder: Path, report: CompressReport) -> None:
    """A README model card via :mod:`hf_symmetry.hub.cards` (the compression record stays in
    ``compression_report.json``)."""
    from ..hub.cards import perplexity_result, public_model_label, public_text_label, write_card

    acc, opts = report.accounting, report.options
    method = "SliceGPT" if opts["structure"] == "slice" else f"ProcrustesGPT ({opts['structure']}, stage {opts['stage']})"
    results = []
    if report.perplexity:
        pp = report.perplexity
        results.append(perplexity_result(pp["compressed"], pp["text"], max_tokens=pp["tokens"], window=pp["window"],
                                         stride=pp["stride"], tokens=pp["tokens"]))
    write_card(folder, "compress", {
        "title": f"{Path(report.source).name} compressed with {method}",
        "summary": (f"Structured compression of `{public_model_label(report.source)}` with {method}: "
                    f"{acc['ratio_over_compressed']:.1%} of the compressed matrices' parameters removed "
                    f"({acc['ratio_over_model']:.1%} of the whole model, {acc['compressed_model_params']:,} parameters "
                    f"left). Load with `trust_remote_code=True`."),
        "method": method, "parameters": {k: v for k, v in opts.items() if not isinstance(v, (list, tuple))},
        "inputs": [report.source],
        "size": {"parameters": acc["compressed_model_params"]},
        "eval_results": results,
        "extra": {"ratio_over_compressed": acc["ratio_over_compressed"], "ratio_over_model": acc["ratio_over_model"],
                  "parameters_before": acc["dense_model_params"], "parameters_after": acc["compressed_model_params"],
                  "per_matrix": _per_matrix_rows(acc["per_matrix"]),
                  "perplexity": report.perplexity and {**report.perplexity,
                                                       "text": public_text_label(report.perplexity["text"])}},
    })


def _per_matrix_rows(per_matrix: dict) -> list[dict]:
    """The accounting's per-matrix entries grouped by module (``layers.3.q_proj`` → ``q_proj``) and
    structure, for the card."""
    rows: dict = {}
    for name, m in per_matrix.items():
        module = name.split(".")[-1]
        spec = ", ".join(f"{k}={v}" for k, v in m["structure"].items())
        row = rows.setdefault((module, spec, m["params"], m["dense_params"]),
                              {"matrix": module, "count": 0, "structure": spec, "dense_params": m["dense_params"],
                               "params": m["params"], "ratio": m["ratio"]})
        row["count"] += 1
    return list(rows.values())
