"""Stock SliceGPT: one global PCA and one uniform width, written as the source's own family.

SliceGPT with one rotation ``Q`` for the whole residual stream and one width ``d′`` is a stock decoder
with ``hidden_size = d′``: the embedding is ``E Q′``, every reader ``W Q′``, every writer ``Q′ᵀ W``
(``Q′`` the first ``d′`` principal directions, norms folded first, docs/math.md §1.4). One thing
differs from the compressed family: its RMSNorms divide ``Σ x²`` by the original width ``d``, a stock
RMSNorm of width ``d′`` divides by ``d′``. With ``S = Σ x²`` over the ``d′`` kept coordinates,

    rsqrt(S/d + ε) = rsqrt((d′/d) (S/d′ + ε d/d′)) = c · rsqrt(S/d′ + ε′),   c = √(d/d′),  ε′ = ε d/d′,

so a stock norm with ``ε′`` gives the compressed family's normalised stream divided by ``c``: every
reader of a norm (q, k, v, gate, up and the head) is multiplied by ``c``, all norm weights stay 1,
and the config's ``rms_norm_eps`` becomes ``ε d/d′``. This is exact (float round-off), with ε rescaled;
``c`` alone, ε unchanged, is off by a relative ``ε (d/d′ − 1) / (2 S/d′)`` per norm (tiny, not zero).
The constant goes into the readers rather than the norm weights: they are rounded to the checkpoint
dtype once anyway, where a norm weight of ``c`` in bfloat16 would be off by up to 0.4 %.

QK-norm (Qwen3) reads ``config.rms_norm_eps`` too: with ``q`` and ``k`` scaled by ``c²`` instead of
``c`` (so ``q_stock = c q``), ``c q · rsqrt(c² m + ε′) = q · rsqrt(m + ε)`` since ``ε′ / c² = ε``:
the per-head norms stay exact as well.

The head is untied (the output's ``lm_head`` reads the sliced stream: ``W_head diag(γ) Q′ c``), so a
source with tied embeddings needs ``--untie``: vocab × d′ more parameters, in the budget, where the
compressed family pays d′² for its ``head_mix``. Widths are rounded to a multiple of ``round_to`` (64
by default: GPU kernels want that). Per-segment widths or rotations, LayerNorm decoders and tied heads
without ``--untie`` stay in the compressed (remote-code) families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ...architectures import Adapter
from ...architectures.spec import SPECS, find_spec
from ...checkpoint_io import write_config
from ...solvers import structures as st
from ..stream import DictSink, DictSource, StreamOptions, TensorSource
from .options import CompressOptions
from .pca import SliceOutput, slice_into
from .plan import (
    Accounting,
    accounting,
    check_family,
    in_policy,
    matrix_entries,
    nearest_width,
    params_at,
    plan_for,
    sliced_entry,
    source_numels,
)
from .report import CompressReport
from .routes import CompressRun, Route

#: model types whose stock RMSNorm is ``weight · x · rsqrt(mean(x²) + config.rms_norm_eps)`` and whose
#: config takes an explicit ``head_dim`` (the sliced hidden size no longer fixes it): ``ArchSpec.stock_slice``
STOCK_TYPES = tuple(t for s in SPECS if s.stock_slice for t in s.model_types)


@dataclass(frozen=True)
class StockOptions:
    """Whether and how a SliceGPT output is written as the source's stock family: ``remote_code`` (``--remote-code``;
    :data:`REMOTE_CODE`) keeps the compressed family even where the stock one is possible; else ``untie`` a
    tied head (vocab × d′ parameters), widths rounded to a multiple of ``round_to`` (1: no rounding).
    ``constant`` / ``rescale_eps`` ``False`` (for the negative controls only): leave the constant ``c`` out of
    the readers, or keep ε as it was. The other structures are always the compressed family."""

    untie: bool = False
    round_to: int = 64
    constant: bool = True
    rescale_eps: bool = True
    remote_code: bool = False

    def validate(self) -> None:
        if not isinstance(self.round_to, int) or self.round_to < 1:
            raise ValueError(f"--round-to must be a positive integer, got {self.round_to!r}")


REMOTE_CODE = StockOptions(remote_code=True)  # the compressed family for SliceGPT too (``--remote-code``)


def why_not_stock(config: dict, options: CompressOptions, untie: bool = False) -> str | None:
    """``None`` where ``options`` on this source can be written as the source's stock family, else the
    reason the output stays in the compressed family."""
    if not options.slicing:
        return "only SliceGPT keeps the stock architecture (the structured classes need their own modules)"
    if options.q_mode != "global" or options.sequential:
        return "one rotation per residual segment puts a matrix on every skip connection"
    if options.allocation != "uniform":
        return "per-segment residual widths need the compressed family"
    model_type = config.get("model_type")
    if model_type not in STOCK_TYPES:
        return (
            f"{model_type} has no stock RMSNorm family that holds the sliced stream (stock: {', '.join(STOCK_TYPES)})"
        )
    if bool(config.get("tie_word_embeddings", True)) and not untie:
        return (
            "the source ties its head to the embedding: a sliced tied head needs the compressed family's "
            "head mix (d′² parameters); --untie writes the stock family with an untied head (vocab × d′)"
        )
    return None


def stock_class(config: dict) -> str:
    """The stock ``...ForCausalLM`` class name of ``config``'s model type."""
    archs = config.get("architectures")
    if archs:
        return archs[0]

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]


def stock_params(entries, w: int, n_layers: int, vocab: int, tied: bool, carried: int) -> int:
    """Parameters of the stock model at width ``w``: the sliced matrices (:func:`.plan.params_at`), the head
    (untied), the 2L + 1 norm weights of width ``w`` and the QK-norm γ."""
    return params_at(entries, lambda _: w) + (vocab * w if tied else 0) + (2 * n_layers + 1) * w + carried


def plan_stock_width(
    source: TensorSource,
    config: dict,
    options: CompressOptions,
    stock: StockOptions = StockOptions(),
    width: int | None = None,
) -> tuple[int, Accounting]:
    """The width ``d′`` (the one whose parameter count is closest to the ratio's target, then the nearest
    multiple of ``stock.round_to``; ``width`` given: that one, not rounded) and the parameter accounting
    at it. The budget is the compressed family's: removed parameters per dense parameter of the matrices
    it compresses, the untied head paid for."""
    stock.validate()
    keys = source.keys()
    adapter = check_family(config, keys)
    d, L, tied = adapter.hidden, adapter.n_layers, adapter.tied_embeddings
    vocab = int(config["vocab_size"])
    entries = matrix_entries(config, keys, adapter)
    carried = 2 * L * adapter.layout.head_dim if adapter.layout.qk_norm else 0
    dense_total = source_numels(source, keys, tied)
    p_compressed = sum(e.shape[0] * e.shape[1] for e in entries if in_policy(e.canon, options))
    target = dense_total - options.ratio * p_compressed

    def params(w):
        return stock_params(entries, w, L, vocab, tied, carried)

    exact = nearest_width(params, target, range(1, d + 1))
    n = stock.round_to
    if n > d:
        raise ValueError(f"--round-to {n} exceeds the hidden size {d}: choose a smaller multiple (1: no rounding)")
    w = nearest_width(params, target, range(d // n * n, 0, -n))  # the wider one on a tie
    if width is not None:
        if not 1 <= width <= d:
            raise ValueError(f"width must be in [1, {d}], got {width}")
        w, n = int(width), None
    total = params(w)
    per_matrix = {e.name: sliced_entry(e.shape[0], d, w) for e in entries}
    if tied:
        per_matrix["lm_head"] = {
            "structure": {"type": "dense", "width": w},
            "params": vocab * w,
            "dense_params": 0,
            "ratio": 0.0,
        }
    return w, Accounting(
        dense_model_params=dense_total,
        compressed_model_params=total,
        ratio_over_compressed=(dense_total - total) / p_compressed,
        ratio_over_model=1 - total / dense_total,
        ratio_per_matrix_mean=1 - w / d,
        skip_params=0,
        head_mix_params=0,
        per_matrix=per_matrix,
        target_ratio=options.ratio,
        target_params=round(target),
        dense_params_of_compressed_matrices=p_compressed,
        untied_head_params=vocab * w if tied else 0,
        output_family="stock",
        hidden=d,
        residual=w,
        norm_params=(2 * L + 1) * w,
        width_unrounded=exact,
        round_to=n,
        stock_class=stock_class(config),
    )


def compressed_plan_at(source: TensorSource, config: dict, options: CompressOptions, width: int):
    """The compressed family's SliceGPT plan (one global PCA) at residual width ``width`` instead of the
    ratio's: the same slice as :class:`StockSlice` at that width, in the remote-code family (for
    comparisons; the ratio's slack does not apply)."""
    plan, _ = plan_for(source, config, options.with_(ratio_slack=1.0))
    plan.residual = int(width)
    plan.matrices = [replace(m, structure=st.Dense((m.structure.shape[0], int(width)))) for m in plan.matrices]
    ratios = plan.accounting
    plan.accounting = accounting(plan, ratios.dense_model_params, ratios.dense_params_of_compressed_matrices, options)
    plan.accounting.target_params = ratios.target_params
    return plan


def normalisation(d: int, w: int, eps: float) -> tuple[float, float]:
    """``(c, ε′)``: the stock norm of width ``w`` with ``ε′ = ε d/w``, its output times ``c = √(d/w)``,
    is the compressed family's norm (``Σ x² / d + ε``)."""
    return math.sqrt(d / w), eps * d / w


def stock_config(config: dict, adapter: Adapter, width: int, eps: float) -> dict:
    """The source's config with ``hidden_size = width``, ``rms_norm_eps = eps``, an untied head and an
    explicit ``head_dim``. ``LlamaConfig`` refuses a hidden size that is not a multiple of the number
    of heads (even with ``head_dim`` given); a Llama without biases is then written as
    ``MistralForCausalLM`` without sliding window, the same computation in a stock class whose config
    takes any ``head_dim`` (``ArchSpec.narrow_stock_type``)."""
    new = {k: v for k, v in config.items() if not k.startswith("_") and k != "auto_map"}
    new.update(
        hidden_size=int(width),
        rms_norm_eps=float(eps),
        tie_word_embeddings=False,
        head_dim=int(adapter.layout.head_dim),
        architectures=[stock_class(config)],
    )
    heads = adapter.layout.n_heads
    spec = find_spec(config.get("model_type"))
    narrow = spec.narrow_stock_type if spec is not None else None
    if narrow is not None and config.get("model_type") != narrow and width % heads:
        own = stock_class(config).removesuffix("ForCausalLM")
        if any(config.get(k) for k in spec.bias_attrs):
            raise ValueError(
                f"width {width} is not a multiple of the {heads} attention heads, which {own}Config "
                f"requires, and a {own} with biases has no other stock class: use a --round-to that is "
                f"a multiple of {heads}"
            )
        for k in spec.bias_attrs + spec.narrow_stock_drop:
            new.pop(k, None)
        new.update(model_type=narrow, architectures=[stock_class({"model_type": narrow})])
        if spec.window_attr:
            new[spec.window_attr] = None
    return new


def stock_slice_model(
    model,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    stock: StockOptions = StockOptions(),
    width: int | None = None,
    rotation: torch.Tensor | None = None,
    progress: bool = False,
    placement=None,
    **controls,
):
    """In memory: a loaded Llama / Mistral / Qwen2 / Qwen3 / Phi-3 ``...ForCausalLM`` -> (the same stock
    class at ``hidden_size = d′``, report). A tied source is untied (as ``--untie``). ``controls``:
    :class:`StockOptions`' negative controls (``constant``, ``rescale_eps``)."""
    options.validate()
    reason = why_not_stock(model.config.to_dict(), options, untie=True)
    if reason is not None:
        raise ValueError(f"no stock output: {reason}")
    dtype = next(model.parameters()).dtype
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    sink = DictSink()
    new_config, report = slice_into(
        CompressRun(source, model.config.to_dict(), options, calib_ids, placement, progress, sink=sink),
        StockSlice(replace(stock, **controls)),
        width,
        rotation,
    )
    cfg = AutoConfig.for_model(**{k: v for k, v in new_config.items() if k != "transformers_version"})
    out = AutoModelForCausalLM.from_config(cfg).to(dtype)
    missing, unexpected = out.load_state_dict({k: v.to(dtype) for k, v in sink.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(
            f"stock slice does not match {type(out).__name__}: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    report.accounting.compressed_model_params_counted = sum(p.numel() for p in out.parameters())
    return out.eval(), report


class StockSlice(Route, SliceOutput):
    """The folder route where :func:`why_not_stock` allows (:func:`.pipeline.route_for` decides), and the
    stock output of :func:`.pca.slice_into`: the source's own stock family at ``hidden_size = d′`` (no remote
    code), every reader of a norm times ``c`` (q and k times ``c²`` under QK-norm: ``q_stock = c q``), all
    norm weights 1, ``rms_norm_eps`` times ``d/d′``."""

    def __init__(self, stock: StockOptions):
        super().__init__()
        self.stock = stock
        self.c = self.qk = 1.0

    def check(self, reader, options: CompressOptions) -> None:
        w, _ = plan_stock_width(reader, reader.config, options, self.stock)  # a bad --round-to fails here
        stock_config(reader.config, Adapter.from_config(reader.config, reader.keys()), w, 1.0)  # so does its class

    def write(self, run: CompressRun) -> CompressReport:
        new_config, report = slice_into(run, self)
        write_config(run.folder, new_config)
        return report

    def plan(self, source: TensorSource, config: dict, options: CompressOptions, width: int | None = None):
        w, accounting = plan_stock_width(source, config, options, self.stock, width)
        return check_family(config, source.keys()), w, accounting

    def output(self, source: TensorSource, adapter: Adapter, config: dict, width: int, accounting: Accounting):
        c, eps = normalisation(adapter.hidden, width, adapter.eps)
        self.c = c if self.stock.constant else 1.0
        self.qk = self.c * self.c if adapter.layout.qk_norm else self.c
        eps = eps if self.stock.rescale_eps else adapter.eps
        new_config = stock_config(config, adapter, width, eps)
        accounting.stock_class = new_config["architectures"][0]
        accounting.norm_constant, accounting.rms_norm_eps, accounting.source_rms_norm_eps = self.c, eps, adapter.eps
        return new_config, StreamOptions()

    def finish_layer(self, layer: dict) -> dict:
        c, qk = self.c, self.qk
        for n in ("q", "k", "v", "gate", "up"):
            s = qk if n in ("q", "k") else c
            layer[f"{n}.weight"] = layer[f"{n}.weight"] * s
            if f"{n}.bias" in layer and s != c:  # a reader's bias scales only with its output
                layer[f"{n}.bias"] = layer[f"{n}.bias"] * (s / c)
        for norm in ("attn_norm", "ffn_norm"):
            layer[f"{norm}.weight"] = torch.ones(layer["o.weight"].shape[0], dtype=torch.float64)
        return layer

    def finish_globals(self, g: dict) -> dict:
        g["lm_head.weight"] = g["lm_head.weight"] * self.c
        g["final_norm.weight"] = torch.ones(g["embed.weight"].shape[1], dtype=torch.float64)
        return g

    def method(self, accounting: Accounting) -> str:
        return f"stock {accounting.stock_class}"

    def output_lines(self, report: CompressReport, config: dict) -> list[str]:
        """The stock class and its width rounding (and what an untied head costs)."""
        acc = report.accounting
        lines = [
            f"  output: stock {acc.stock_class} (no remote code), hidden size {acc.residual} of "
            f"{acc.hidden}; width {acc.width_unrounded} rounded to a multiple of {acc.round_to} "
            f"(--round-to); norms: weights 1, readers × √(d/d′) = {acc.norm_constant:.6g}, rms_norm_eps "
            f"{acc.source_rms_norm_eps:.6g} × d/d′ = {acc.rms_norm_eps:.6g}"
        ]
        if acc.untied_head_params:
            lines.append(
                f"  untied head (--untie): vocab × width = {acc.untied_head_params:,} parameters, counted in the ratio"
            )
        return lines
