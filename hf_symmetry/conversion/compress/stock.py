"""Stock SliceGPT: one global PCA and one width ``d′``, written as the source's own family.

One rotation and one width make a stock decoder with ``hidden_size = d′`` (embedding ``E Q′``, readers
``W Q′``, writers ``Q′ᵀ W``, norms folded first, docs/math.md §1.4), but the compressed family's RMSNorms
divide ``Σ x²`` by ``d``, a stock one by ``d′``. With ``S = Σ x²`` over the kept coordinates,

    rsqrt(S/d + ε) = rsqrt((d′/d) (S/d′ + ε d/d′)) = c · rsqrt(S/d′ + ε′),   c = √(d/d′),  ε′ = ε d/d′,

so every reader of a norm (q, k, v, gate, up, the head) is multiplied by ``c``, all norm weights are 1 and
``rms_norm_eps`` becomes ``ε′``: exact up to round-off (``c`` alone, ε unchanged, is off by a relative
``ε (d/d′ − 1) / (2 S/d′)`` per norm). ``c`` goes into the readers, which are rounded to the checkpoint dtype
anyway; a norm weight ``c`` in bfloat16 would be off by up to 0.4 %. QK-norm (Qwen3) reads ``ε′`` too: with
``q`` and ``k`` scaled by ``c²`` (``q_stock = c q``), ``c q · rsqrt(c² m + ε′) = q · rsqrt(m + ε)`` since
``ε′ / c² = ε``.

The head reads the sliced stream (``W_head diag(γ) Q′ c``), so a tied source needs ``--untie`` (vocab × d′
parameters, in the budget, where the compressed family pays d′² for its head mix). Widths are rounded to a
multiple of ``round_to`` (64 by default, for GPU kernels). Per-segment widths or rotations, LayerNorm decoders
and tied heads without ``--untie`` stay in the compressed (remote-code) families.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ...architectures import Adapter
from ...architectures.spec import SPECS, find_spec
from ...checkpoint_io import write_config
from ..stream import DictSink, DictSource, StreamOptions, TensorSource
from .options import CompressOptions
from .assemble import loaded
from .pca import SliceOutput, slice_into
from .plan import (
    Accounting,
    budget,
    carried_params,
    check_family,
    matrix_entries,
    nearest_width,
    params_at,
    sliced_entry,
    source_numels,
)
from .report import CompressReport
from .routes import CompressRun, Route

#: model types whose stock RMSNorm is ``weight · x · rsqrt(mean(x²) + config.rms_norm_eps)`` and whose
#: config takes an explicit ``head_dim`` (``ArchSpec.stock_slice``)
STOCK_TYPES = tuple(t for s in SPECS if s.stock_slice for t in s.model_types)


def why_not_stock(config: dict, options: CompressOptions, untie: bool = False) -> str | None:
    """``None`` where ``options`` on this source can be written as its stock family, else the reason not."""
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


def stock_config(config: dict, adapter: Adapter, width: int, eps: float) -> dict:
    """The source's config at ``hidden_size = width``, ``rms_norm_eps = eps``, untied, with ``head_dim``.
    ``LlamaConfig`` refuses a hidden size that is not a multiple of the heads (even with ``head_dim``); a
    Llama without biases is then written as the same computation in ``ArchSpec.narrow_stock_type``'s class
    (Mistral, no sliding window), whose config takes any ``head_dim``."""
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
    stock: StockSlice | None = None,
    width: int | None = None,
    rotation: torch.Tensor | None = None,
    progress: bool = False,
    placement=None,
):
    """In memory: a loaded stock ``...ForCausalLM`` -> (the same class at ``hidden_size = d′``, report), a
    tied head untied; ``stock``: the route's settings (default ``StockSlice(untie=True)``)."""
    options.validate()
    reason = why_not_stock(model.config.to_dict(), options, untie=True)
    if reason is not None:
        raise ValueError(f"no stock output: {reason}")
    dtype = next(model.parameters()).dtype
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    sink = DictSink()
    new_config, report = slice_into(
        CompressRun(source, model.config.to_dict(), options, calib_ids, placement, progress, sink=sink),
        stock or StockSlice(untie=True),
        width,
        rotation,
    )
    cfg = AutoConfig.for_model(**{k: v for k, v in new_config.items() if k != "transformers_version"})
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)  # in the source's dtype before the weights go in
    out, report.accounting.compressed_model_params_counted = loaded(model, dict(sink))
    return out, report


class StockSlice(Route, SliceOutput):
    """The folder route where :func:`why_not_stock` allows, and the stock output of :func:`.pca.slice_into`:
    ``untie`` a tied head (``--untie``), widths rounded to a multiple of ``round_to`` (1: none). ``constant`` /
    ``rescale_eps`` ``False`` (negative controls only): leave ``c`` out of the readers, or keep ε."""

    def __init__(self, untie: bool = False, round_to: int = 64, constant: bool = True, rescale_eps: bool = True):
        if not isinstance(round_to, int) or round_to < 1:
            raise ValueError(f"--round-to must be a positive integer, got {round_to!r}")
        super().__init__()
        self.untie, self.round_to, self.constant, self.rescale_eps = untie, round_to, constant, rescale_eps
        self.c = self.qk = 1.0

    def check(self, reader, options: CompressOptions) -> None:
        adapter, w, _ = self.plan(reader, reader.config, options)  # a bad --round-to fails here
        stock_config(reader.config, adapter, w, 1.0)  # so does its class

    def write(self, run: CompressRun) -> CompressReport:
        new_config, report = slice_into(run, self)
        write_config(run.folder, new_config)
        return report

    def plan(self, source: TensorSource, config: dict, options: CompressOptions, width: int | None = None):
        """The width ``d′`` whose parameter count is closest to the ratio's target, then the nearest multiple
        of ``round_to`` (``width`` given: that one, not rounded), and the accounting at it."""
        keys = source.keys()
        adapter = check_family(config, keys)
        d, L, tied = adapter.hidden, adapter.n_layers, adapter.tied_embeddings
        vocab, carried = int(config["vocab_size"]), carried_params(adapter)
        entries = matrix_entries(config, keys, adapter)
        dense_total = source_numels(source, tied)
        p_compressed, target = budget(entries, dense_total, options, tied)

        def params(w):  # the sliced matrices, the untied head, the 2L + 1 norm weights and the QK-norm γ
            return params_at(entries, lambda _: w) + (vocab * w if tied else 0) + (2 * L + 1) * w + carried

        exact = nearest_width(params, target, range(1, d + 1))
        n = self.round_to
        if n > d:
            raise ValueError(f"--round-to {n} exceeds the hidden size {d}: choose a smaller multiple (1: no rounding)")
        w = nearest_width(params, target, range(d // n * n, 0, -n))  # the wider one on a tie
        if width is not None:
            if not 1 <= width <= d:
                raise ValueError(f"width must be in [1, {d}], got {width}")
            w, n = int(width), None
        per_matrix = {e.name: sliced_entry(e.shape[0], d, w) for e in entries}
        if tied:
            per_matrix["lm_head"] = {**sliced_entry(vocab, d, w), "dense_params": 0, "ratio": 0.0}
        acc = Accounting.of(
            dense_total,
            params(w),
            p_compressed,
            w / d,
            per_matrix,
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
        return adapter, w, acc

    def output(self, source: TensorSource, adapter: Adapter, config: dict, width: int, accounting: Accounting):
        d, eps = adapter.hidden, adapter.eps  # c and ε′ of the module docstring
        self.c = math.sqrt(d / width) if self.constant else 1.0
        self.qk = self.c * self.c if adapter.layout.qk_norm else self.c
        eps = eps * d / width if self.rescale_eps else eps
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
