"""Convert a stock Llama-family checkpoint (MHA or GQA; Llama, Mistral without sliding windows, Qwen2, Qwen3,
Phi-3 — whatever :mod:`hf_symmetry.architectures.capabilities` allows for ``to_tpa``) into a Tensor Product
Attention model. The source is read one layer at a time through the family's adapter (fused projections split,
no module path spelled here); the TPA family's tensor names come from ``modeling_tpa``.

Qwen3's per-head QK-norm goes along (the TPA family normalises each query head and each key factor):
exact at full key rank, where every key head is one factor. A reduced key rank mixes key heads, which does
not commute with the norm, and is refused (``to_tpa_key_rank``); the value rank may be reduced.

Full rank (``k_rank = v_rank = num_key_value_heads``, the default) is exact: GQA is non-contextual TPA
with ``R = G`` and ``a_j = G·mask_j`` (docs/math.md §4). Queries keep an ordinary projection (the
TPA-KV-only variant); K/V become non-contextual TPA whose B projections are the original K/V
heads, so the cache holds ``(R_K + R_V) d_h`` elements per token and layer.

Below full rank the KV-head mode is reduced by a head-mode SVD. For each layer let ``M`` be the
``h × (d_h (d+1))`` matrix whose row ``i`` is query head ``i``'s effective key map ``[W_K, b_K]`` of its
KV group. The best rank-R approximation ``M ≈ U_R U_R^T M`` (``U_R`` the top-R left singular
vectors, i.e. eigenvectors of ``M C M^T``) gives ``a[u, i] = R √g U[i, u]`` and
``[W_b, b_b]_u = Σ_i U[i, u] M_i / √g`` (g = query heads per KV head). With ``C = I`` that is the plain
weight-space SVD; with calibration (``C = Xᵀ X`` of the layer's attention inputs, augmented by a
ones column for the bias) it is the exact least-squares optimum of ``Σ_i ‖X (W_i - Ŵ_i)ᵀ‖²`` over both
factors, i.e. the reduction that best preserves the K (and V) activations on the calibration text.
RoPE acts on the ``d_h`` mode only, so it commutes with any head-mode mixing.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter
from ..architectures.capabilities import require
from ..checkpoint import atomic_output_dir, check_output_dir, copy_side_files
from ..hub.cards import write_card
from ..hub.lineage import public_report
from ..modeling.configuration_tpa import TPAConfig
from ..modeling.modeling_tpa import FACTORS as TPA_FACTORS
from ..modeling.modeling_tpa import GLOBAL_MODULES as TPA_GLOBAL_MODULES
from ..modeling.modeling_tpa import LAYER_MODULES as TPA_LAYER_MODULES
from ..modeling.modeling_tpa import LAYER_PREFIX as TPA_LAYER_PREFIX
from ..modeling.modeling_tpa import TPAForCausalLM
from .layer_parts import module_of, read_part, stand_ins
from .stream import DictSource, partition_keys

Tensors = dict[str, torch.Tensor]


@dataclass
class LayerError:
    layer: int
    k_weight_rel_err: float
    v_weight_rel_err: float
    k_activation_rel_err: float | None = None  # on the calibration text (when given)
    v_activation_rel_err: float | None = None


@dataclass
class ToTPAReport:
    source: str
    family: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    k_rank: int
    v_rank: int
    exact: bool
    calibrated: bool
    calib_tokens: int = 0
    cache_elements_per_token_source: int = 0  # all layers
    cache_elements_per_token_tpa: int = 0  # all layers (A is stored once, not per token)
    layers: list[LayerError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    verification: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Reading the source
# ----------------------------------------------------------------------------------------------
def check_supported(model) -> None:
    """Refuse (ValueError, with the structural reason) anything the TPA family cannot express."""
    require(model.config, "to_tpa")


def _check_ranks(adapter: Adapter, k_rank: int | None, v_rank: int | None) -> tuple[int, int]:
    """The ranks to use (default: full, exact), after refusing impossible or inexpressible ones."""
    n_kv = adapter.layout.n_kv_heads
    for name, r in (("k_rank", k_rank), ("v_rank", v_rank)):
        if r is not None and not 1 <= r <= n_kv:
            raise ValueError(
                f"{name} must be in [1, num_key_value_heads={n_kv}] (rank {n_kv} is already exact), got {r}"
            )
    k_rank = n_kv if k_rank is None else int(k_rank)
    v_rank = n_kv if v_rank is None else int(v_rank)
    if k_rank < n_kv:
        require(adapter, "to_tpa_key_rank")
    return k_rank, v_rank


def _heads(adapter: Adapter) -> tuple[int, int, int]:
    L = adapter.layout
    if L.n_heads % L.n_kv_heads:
        raise ValueError(f"num_attention_heads ({L.n_heads}) is not a multiple of num_key_value_heads ({L.n_kv_heads})")
    return L.n_heads, L.n_kv_heads, L.head_dim


def tpa_config_from(
    source_config,
    k_rank: int,
    v_rank: int,
    attention_bias: bool,
    attention_out_bias: bool,
    mlp_bias: bool,
    qk_norm: bool = False,
) -> TPAConfig:
    h, _, dh = _heads(Adapter.from_config(source_config))
    c = source_config
    return TPAConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=h,
        head_dim=dh,
        q_rank=None,
        k_rank=k_rank,
        v_rank=v_rank,
        contextual_a=False,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=float(getattr(c, "initializer_range", 0.02)),
        rms_norm_eps=float(c.rms_norm_eps),
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        rope_parameters=copy.deepcopy(dict(c.rope_parameters)),
        attention_bias=attention_bias,
        attention_out_bias=attention_out_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
    )


def group_masks(num_heads: int, num_kv_heads: int, group_of=None) -> torch.Tensor:
    """``[n_kv, h]`` 0/1 masks: ``mask[j, i] = 1`` iff query head ``i`` reads KV head ``j``
    (HF ``repeat_kv``: ``j = i // (h / n_kv)``). ``group_of`` overrides the grouping (tests)."""
    g = num_heads // num_kv_heads
    mask = torch.zeros(num_kv_heads, num_heads, dtype=torch.float64)
    for i in range(num_heads):
        mask[group_of(i) if group_of else i // g, i] = 1.0
    return mask


def _source_biases(canon0: dict) -> dict:
    """The TPA config flags that follow from the source's first layer (canonical tensors)."""
    return {
        "attention_bias": "q.bias" in canon0 or "k.bias" in canon0 or "v.bias" in canon0,
        "attention_out_bias": "o.bias" in canon0,
        "mlp_bias": "gate.bias" in canon0 or "up.bias" in canon0,
        "qk_norm": "q_norm.weight" in canon0,
    }


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------
def attention_input_grams(
    model, ids: torch.Tensor, window: int = 512, progress: bool = True, placement=None, lazy: bool = False
):
    """Per layer ``C = X̃ᵀ X̃`` (float64, ``(d+1)×(d+1)``) of the attention inputs (after the pre-norm),
    ``X̃ = [X, 1]``, over ``ids`` cut into windows of ``window`` tokens.

    ``model``: an HF model folder (read one layer at a time by the calibration engine, never
    loaded whole) or an in-memory model (its state dict is the engine's source). ``placement``:
    device and calibration dtype (:func:`hf_symmetry.devices.resolve`; default CPU float32).
    ``lazy``: an iterator that calibrates layer ``i`` only when its Gram is asked for, so a caller
    that converts each layer before asking for the next holds one Gram at a time (a list otherwise)."""
    from ..calibration import CalibrationEngine, StatsRequest, token_batches

    if isinstance(model, (str, Path)):
        engine = CalibrationEngine(model, placement=placement, progress=progress)
    else:
        engine = CalibrationEngine(
            DictSource(model.state_dict()), model.config.to_dict(), placement=placement, progress=progress
        )
    run = engine.start(token_batches(ids, window))

    def grams():
        # each layer's statistics are dropped once augmented (collect() would keep every layer's
        # twice), and the engine's layer before the caller converts that layer
        for step in run.layers(StatsRequest(grams=("attn_in",), sums=("attn_in",))):
            step.release()
            gram = step.stats.augmented_gram("attn_in")
            del step
            yield gram

    return grams() if lazy else list(grams())


# ----------------------------------------------------------------------------------------------
# The factorisation
# ----------------------------------------------------------------------------------------------
def _head_mode_factors(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv: int,
    rank: int,
    gram: torch.Tensor | None = None,
    eval_gram: torch.Tensor | None = None,
    group_of=None,
):
    """Factor one projection ([n_kv*dh, d] weight, optional bias) into non-contextual A ``[R, h]`` and a
    B projection (``[R*dh, d]`` weight, ``[R*dh]`` bias), fitting in the metric ``gram`` (identity when
    None). Returns ``(A, W_b, b_b, weight_err, act_err)``: the relative error of all query heads'
    effective maps, in the Frobenius norm and (with ``eval_gram``) on the calibration activations."""
    dh = weight.shape[0] // num_kv
    d = weight.shape[1]
    g = num_heads // num_kv
    W = weight.detach().to(torch.float64).reshape(num_kv, dh, d)
    b = None if bias is None else bias.detach().to(torch.float64).reshape(num_kv, dh, 1)
    Wt = W if b is None else torch.cat([W, b], dim=2)  # [n_kv, dh, F], F = d (+1 with a bias)
    masks = group_masks(num_heads, num_kv, group_of).to(W.device)  # [n_kv, h]

    if rank == num_kv:
        # exact GQA form: a_j = R·mask_j, B_j = K/V head j
        A, Wb = rank * masks, Wt
        w_err, a_err = 0.0, (0.0 if eval_gram is not None else None)
    else:

        def head_gram(C):
            """``M C Mᵀ`` over query heads (``h × h``), from the KV-head Gram."""
            flat = Wt.reshape(num_kv * dh, -1)
            if C is not None:
                flat = flat @ (C if b is not None else C[:d, :d])
            kv = torch.einsum("jef,kef->jk", flat.reshape(num_kv, dh, -1), Wt)
            return masks.T @ kv @ masks

        G_fit = head_gram(gram)
        evals, evecs = torch.linalg.eigh(G_fit)
        U = evecs[:, torch.argsort(evals, descending=True)[:rank]]  # [h, R], top head-mode components
        A = rank * math.sqrt(g) * U.T
        Wb = ((U.T @ masks.T) @ Wt.reshape(num_kv, -1)).reshape(rank, dh, -1) / math.sqrt(g)
        resid = torch.eye(num_heads, dtype=torch.float64, device=W.device) - U @ U.T  # heads' maps: M -> U Uᵀ M

        def rel_err(G):
            return (torch.trace(resid @ G @ resid).clamp_min(0) / torch.trace(G).clamp_min(1e-300)).sqrt().item()

        w_err = rel_err(G_fit if gram is None else head_gram(None))
        a_err = None if eval_gram is None else rel_err(G_fit if eval_gram is gram else head_gram(eval_gram))

    Wb = Wb.reshape(rank * dh, -1)
    if b is not None:
        return A, Wb[:, :d].contiguous(), Wb[:, d].contiguous(), w_err, a_err
    return A, Wb.contiguous(), None, w_err, a_err


def _tpa_layer(
    canon: Tensors,
    layout,
    k_rank: int,
    v_rank: int,
    flags: dict,
    gram=None,
    calibrate: bool = True,
    group_of=None,
    device=None,
) -> tuple[Tensors, tuple]:
    """One layer: TPA tensors (names relative to the layer prefix, float64) from the source layer's
    canonical tensors (:mod:`hf_symmetry.architectures.adapter`), which it consumes, and the layer's
    errors ``(k_err, v_err, k_act_err, v_act_err)``."""
    h, n_kv, dh = layout.n_heads, layout.n_kv_heads, layout.head_dim
    out: Tensors = {}
    for cname, module in TPA_LAYER_MODULES.items():
        for kind in ("weight", "bias"):
            t = canon.pop(f"{cname}.{kind}", None)
            if t is not None:
                out[f"{module}.{kind}"] = t
    q_bias = f"{TPA_LAYER_MODULES['q']}.bias"
    if flags["attention_bias"] and q_bias not in out:
        out[q_bias] = torch.zeros(h * dh, dtype=torch.float64)
    fit = gram if calibrate else None
    errs = {}
    for kind, rank in (("k", k_rank), ("v", v_rank)):
        a_name, b_name = TPA_FACTORS[kind]
        w, b = canon.pop(f"{kind}.weight"), canon.pop(f"{kind}.bias", None)
        dev = device or w.device
        a, wb, bb, err, aerr = _head_mode_factors(
            w.to(dev), None if b is None else b.to(dev), h, n_kv, rank, fit, gram, group_of
        )
        out[a_name], out[f"{b_name}.weight"] = a.cpu(), wb.cpu()
        if flags["attention_bias"]:
            out[f"{b_name}.bias"] = bb.cpu() if bb is not None else torch.zeros(rank * dh, dtype=torch.float64)
        errs[kind] = (err, aerr)
    left = sorted(k for k, v in canon.items() if not (k.endswith("norm.bias") and not v.any()))
    if left:
        raise ValueError(f"to-tpa: the source layer has tensors the TPA family has no place for: {left}")
    return out, (errs["k"][0], errs["v"][0], errs["k"][1], errs["v"][1])


def _layer_parts(adapter: Adapter, i: int, keys: list[str], shapes: dict) -> tuple[list[str], list[str]]:
    """Layer ``i``'s checkpoint keys split into what the conversion computes on (the key and value
    projections, fused ones included, and every vector: norms, biases), read in float64, and the
    matrices it passes through unchanged (query, output and FFN projections), read in their own dtype."""
    a = adapter.spec.attention
    kv = {m for m in (a.k, a.v, a.qkv) if m}
    converted = [k for k in keys if module_of(adapter, i, k) in kv or len(shapes[k]) < 2]
    return converted, [k for k in keys if k not in set(converted)]


def _tpa_name(canonical: str) -> str:
    """The TPA tensor name (relative to the layer prefix) of a canonical tensor passed through."""
    module, kind = canonical.rsplit(".", 1)
    if module not in TPA_LAYER_MODULES:
        raise ValueError(f"to-tpa: the source layer has tensors the TPA family has no place for: {[canonical]}")
    return f"{TPA_LAYER_MODULES[module]}.{kind}"


def _tpa_globals(adapter: Adapter, raw: Tensors, tied: bool) -> Tensors:
    """TPA global tensors (the source's dtype) from the source's raw global tensors (the tensors
    read are written: no vocabulary-sized copy)."""
    g = adapter.read_globals(raw, dtype=None, copy=False)
    out = {
        f"{module}.{kind}": g[f"{cname}.{kind}"]
        for cname, module in TPA_GLOBAL_MODULES.items()
        for kind in ("weight", "bias")
        if f"{cname}.{kind}" in g and not (tied and cname == "lm_head")
    }
    left = sorted(set(g) - {f"{c}.{k}" for c in TPA_GLOBAL_MODULES for k in ("weight", "bias")})
    if left:
        raise ValueError(f"to-tpa: the source has global tensors the TPA family has no place for: {left}")
    return out


def _layout_keys(adapter: Adapter, keys: list[str]) -> tuple[list[str], dict[int, list[str]]]:
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    rest = [k for k in rest if not k.endswith("rotary_emb.inv_freq")]
    if rest:
        raise ValueError(f"to-tpa: the source has tensors the TPA family has no place for: {rest[:4]}")
    return global_keys, per_layer


def _report(
    src: str,
    adapter: Adapter,
    tcfg: TPAConfig,
    k_rank: int,
    v_rank: int,
    exact: bool,
    calibrated: bool,
    calib_tokens: int,
) -> "ToTPAReport":
    h, n_kv, dh = _heads(adapter)
    return ToTPAReport(
        source=src,
        family=str(getattr(adapter.config, "model_type", "")),
        num_attention_heads=h,
        num_key_value_heads=n_kv,
        head_dim=dh,
        k_rank=k_rank,
        v_rank=v_rank,
        exact=exact,
        calibrated=calibrated,
        calib_tokens=calib_tokens,
        cache_elements_per_token_source=2 * n_kv * dh * adapter.n_layers,
        cache_elements_per_token_tpa=tcfg.kv_cache_elements_per_token(per_layer=False),
    )


@torch.no_grad()
def convert_model_to_tpa(
    model,
    k_rank: int | None = None,
    v_rank: int | None = None,
    calib_ids: torch.Tensor | None = None,
    calibrate: bool = True,
    calib_window: int = 512,
    calib_grams: list[torch.Tensor] | None = None,
    group_of=None,
    progress: bool = True,
) -> tuple[TPAForCausalLM, ToTPAReport]:
    """In-memory conversion of a loaded ``...ForCausalLM`` of a family the TPA family can express
    (Llama, Mistral without sliding windows, Qwen2, Qwen3) into a :class:`TPAForCausalLM` (same dtype).
    The source is read through the family's adapter, like a checkpoint.

    With ``calib_ids`` (and a reduced rank) the attention inputs on that text are collected: the
    head-mode reduction is fitted to them when ``calibrate`` (else it is the plain weight SVD) and
    the per-layer activation errors are reported either way. ``calib_grams`` (from
    :func:`attention_input_grams`) can be passed instead of ``calib_ids`` to reuse them. ``group_of(i)``
    overrides the head grouping (a deliberately wrong grouping is the negative control of the tests)."""
    t0 = time.time()
    check_supported(model)
    cfg = model.config
    source = DictSource(model.state_dict())
    adapter = Adapter.from_config(cfg, source.keys())
    _heads(adapter)
    k_rank, v_rank = _check_ranks(adapter, k_rank, v_rank)
    n_kv = adapter.layout.n_kv_heads
    reduced = k_rank < n_kv or v_rank < n_kv
    global_keys, per_layer = _layout_keys(adapter, source.keys())
    flags = _source_biases(adapter.read_layer(0, source.get(per_layer[0])))
    tcfg = tpa_config_from(cfg, k_rank, v_rank, **flags)
    report = _report(
        str(getattr(cfg, "_name_or_path", "")),
        adapter,
        tcfg,
        k_rank,
        v_rank,
        exact=not reduced and group_of is None,
        calibrated=(calib_ids is not None or calib_grams is not None) and calibrate and reduced,
        calib_tokens=0 if calib_ids is None else int(calib_ids.numel()),
    )
    grams = calib_grams
    if grams is None and calib_ids is not None and reduced:
        grams = attention_input_grams(model, calib_ids, window=calib_window, progress=progress)

    dtype = next(model.parameters()).dtype
    sd = _tpa_globals(adapter, source.get(global_keys), tcfg.tie_word_embeddings)
    for i in tqdm(range(adapter.n_layers), desc="to-tpa", disable=not progress, leave=False):
        canon = adapter.read_layer(i, source.get(per_layer[i]))  # one float64 layer at a time
        new, errs = _tpa_layer(
            canon, adapter.layout, k_rank, v_rank, flags, None if grams is None else grams[i], calibrate, group_of
        )
        sd.update({TPA_LAYER_PREFIX.format(i) + k: v.to(dtype) for k, v in new.items()})
        report.layers.append(LayerError(i, *errs))
    tpa = _empty_model(tcfg).to(dtype)
    target = tpa.state_dict()
    missing = set(target) - set(sd)
    if tcfg.tie_word_embeddings:
        missing.discard(f"{TPA_GLOBAL_MODULES['lm_head']}.weight")
    unexpected = set(sd) - set(target)
    if missing or unexpected:
        raise RuntimeError(
            f"to-tpa weight mapping mismatch: missing={sorted(missing)[:5]} unexpected={sorted(unexpected)[:5]}"
        )
    tpa.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    if tcfg.tie_word_embeddings:
        tpa.tie_weights()
    tpa.generation_config = copy.deepcopy(model.generation_config)
    tpa.eval()
    report.seconds = time.time() - t0
    return tpa, report


def _save_tpa_config(tcfg: TPAConfig, dtype: torch.dtype, folder: Path) -> None:
    """config.json with ``auto_map`` plus the flat remote-code files, as ``save_pretrained`` writes
    them (the weights are streamed separately)."""
    from accelerate import init_empty_weights
    from transformers.dynamic_module_utils import custom_object_save

    with init_empty_weights():
        skeleton = TPAForCausalLM(tcfg)
    skeleton.config.dtype = str(dtype).split(".")[1]
    skeleton.config.architectures = [type(skeleton).__name__]
    custom_object_save(skeleton, folder, config=skeleton.config)
    skeleton.config.save_pretrained(folder)


def _empty_model(config: TPAConfig) -> TPAForCausalLM:
    """A TPA model whose weights are about to be overwritten: skip the (slow) random initialisation."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: just initialise
        return TPAForCausalLM(config)
    with no_init_weights():
        return TPAForCausalLM(config)


# ----------------------------------------------------------------------------------------------
# Checkpoint to checkpoint
# ----------------------------------------------------------------------------------------------
def tpa_card_data(src, out, report) -> dict:
    """The model card of a conversion: ranks and cache size (per-layer errors stay in
    ``tpa_conversion.json``; exactness and perplexity are added by the verification)."""
    params = {"k_rank": report.k_rank, "v_rank": report.v_rank, "exact": report.exact}
    if report.calibrated:
        params.update(calibrated=True, calib_tokens=report.calib_tokens)
    return {
        "title": Path(out).name,
        "inputs": [str(src)],
        "method": "to-tpa",
        "parameters": params,
        "notes": "\n".join(f"- {n}" for n in report.notes) or None,
        "extra": {
            "cache_elements_per_token": {
                "source": report.cache_elements_per_token_source,
                "tpa": report.cache_elements_per_token_tpa,
            },
            "report": "tpa_conversion.json",
        },
    }


def convert_checkpoint_to_tpa(
    source: str | Path,
    out: str | Path,
    k_rank: int | None = None,
    v_rank: int | None = None,
    calib: str | Path | None = None,
    calib_tokens: int = 2048,
    verify_text: str | Path | None = None,
    verify_tokens: int = 512,
    ppl_tokens: int = 2048,
    overwrite: bool = False,
    progress: bool = True,
    placement=None,
    max_shard_size: str | int = "2GB",
) -> ToTPAReport:
    """Convert the checkpoint ``source`` layer by layer (never loading the whole model; every layer
    read through the family's adapter) and write an HF folder (config with ``auto_map``,
    ``configuration_tpa.py``/``modeling_tpa.py``, weights, tokenizer, generation config,
    ``tpa_conversion.json``) to ``out`` via a temporary folder renamed into place. With ``calib`` the
    attention inputs are measured by the layer-wise calibration engine on ``placement``
    (:func:`hf_symmetry.devices.resolve`), and the head-mode reductions run on that device too."""
    from transformers import AutoConfig, AutoTokenizer

    from ..assets import resolve_model, resolve_text
    from ..calibration import calibration_ids
    from ..calibration.memory import release_free_memory
    from ..checkpoint import CheckpointReader, ShardedWriter, parse_size
    from ..devices import linalg_device

    t0 = time.time()
    src = resolve_model(source)
    out = Path(out)
    check_output_dir(out, overwrite)
    config = AutoConfig.from_pretrained(src)  # fail fast, before reading any weights
    require(config, "to_tpa")
    reader = CheckpointReader(src)
    adapter = Adapter.from_config(config, reader.keys())
    _heads(adapter)
    k_rank, v_rank = _check_ranks(adapter, k_rank, v_rank)
    n_kv = adapter.layout.n_kv_heads
    global_keys, per_layer = _layout_keys(adapter, reader.keys())
    if calib is not None:
        calib = resolve_text(calib)
    if verify_text is not None:
        resolve_text(verify_text)  # a missing text fails before any work
    reduced = k_rank < n_kv or v_rank < n_kv
    grams, calib_n = None, 0
    if calib is not None:
        ids = calibration_ids(AutoTokenizer.from_pretrained(src), calib, calib_tokens)
        calib_n = int(ids.numel())
        if reduced:
            # one layer calibrated per converted layer: one Gram in memory, whatever the depth
            grams = attention_input_grams(src, ids, progress=False, placement=placement, lazy=True)

    shapes, dtypes = reader.shapes(), reader.dtypes()
    dtype = dtypes[per_layer[0][0]]
    flags = _source_biases(adapter.read_layer(0, stand_ins(per_layer[0], shapes, dtypes)))
    tcfg = tpa_config_from(config, k_rank, v_rank, **flags)
    report = _report(
        str(src), adapter, tcfg, k_rank, v_rank, exact=not reduced, calibrated=grams is not None, calib_tokens=calib_n
    )
    device = linalg_device(placement)

    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size))
        for i in tqdm(range(adapter.n_layers), desc="to-tpa", disable=not progress, unit="layer"):
            # the engine runs layer i (and lets it go) before this layer is read
            gram = None if grams is None else next(grams).to(device)
            keys = per_layer[i]
            like = dtypes[keys[0]]  # every tensor of the layer is written in the dtype of its first
            stand = stand_ins(keys, shapes, dtypes)
            converted, passed = _layer_parts(adapter, i, keys, shapes)
            canon = read_part(adapter, i, stand, reader.get(converted), torch.float64)
            new, errs = _tpa_layer(canon, adapter.layout, k_rank, v_rank, flags, gram, True, None, device)
            report.layers.append(LayerError(i, *errs))
            prefix = TPA_LAYER_PREFIX.format(i)
            writer.add(dict(sorted((prefix + k, v.to(like)) for k, v in new.items())))
            del canon, new, gram
            release_free_memory()
            for key in passed:  # unchanged matrices: one at a time, in their own dtype
                part = read_part(adapter, i, stand, reader.get([key]), None)
                writer.add({prefix + _tpa_name(name): t.to(like) for name, t in part.items()})
                del part
        if grams is not None:
            grams.close()  # the calibration run's activations
        release_free_memory()
        for k in global_keys:  # vocabulary-sized: one at a time, as read
            writer.add(_tpa_globals(adapter, reader.get([k]), tcfg.tie_word_embeddings))
        writer.close()
        _save_tpa_config(tcfg, dtype, tmp)
        from .layer_map import LayerMap  # the residual stream is untouched: heal's layer targets are the original's

        LayerMap.identity(adapter.n_layers, tcfg.hidden_size, "to_tpa").save(tmp)
        if not copy_side_files(Path(src), tmp):
            report.notes.append("the source folder has no tokenizer to copy")
        report.seconds = time.time() - t0
        (tmp / "tpa_conversion.json").write_text(json.dumps(public_report(report.as_dict()), indent=2) + "\n")
        write_card(tmp, "to_tpa", tpa_card_data(src, out, report))
    if verify_text is not None:  # the shared verification of every conversion, on the written folder
        from ..hub.entries import verify_and_record_folder

        report.verification = verify_and_record_folder(
            src, out, verify_text, verify_tokens, ppl_tokens, progress=progress
        ).as_dict()
    return report
