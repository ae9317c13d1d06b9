"""SliceGPT on LayerNorm decoders (OPT, GPT-2), through the RMS-decoder family.

A LayerNorm decoder takes SliceGPT's own route (Ashkboos et al., 2024, §3.2): every writer to the residual stream (token
and position embeddings, attention and FFN output projections with their biases) is mean-centred, which
leaves the function unchanged and makes each LayerNorm an RMSNorm followed by its γ and β; those fold
into the readers. The stream of this centred model is ``P x`` (``P = I − 11ᵀ/d``), so its second moment
per residual segment is ``P C P`` with ``C`` measured on the original model; one global rotation ``Q``
(the principal directions of all segments, each normalised by its trace, as the compressed family's
global SliceGPT) then maps the stream, and only its first ``w`` coordinates are kept. The result is the
RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`) with ``residual_size = w``: its
norms still divide by the original width, and the head (untied, as the centring requires) reads the
sliced stream. At ``w = d`` this is an exact residual rotation.

``w`` is chosen as the compressed family's SliceGPT chooses it: the width whose total parameter count is
closest to ``dense − ratio × (parameters of the matrices on the stream)``, so equal ratios mean equal
model sizes across families. The slice itself (calibration, the centred PCA, every matrix rotated and cut)
is SliceGPT's one route, :func:`..pca.slice_into`; here is what the RMS-decoder family writes
(:class:`RMSDecoderSlice`).
"""

from __future__ import annotations

import torch

from ....architectures import Adapter
from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ....solvers import structures as st
from ....symmetry import actions
from ...rms_decoder import check_layer_norm_decoder, rms_decoder_config
from ...stream import StreamOptions, TensorSource, partition_keys
from ..options import LAYER_MODULES, SEGMENT_OFFSET, CompressOptions
from ..pca import SliceOutput
from ..plan import Accounting, MatrixPlan, nearest_width, params_at, sliced_entry, source_numels
from .checks import check

_READERS, _WRITERS = ("q", "k", "v", "up"), ("o", "down")


def _shapes(adapter: Adapter, source: TensorSource, keys: list[str]) -> dict:
    """Shapes that fix the parameter count at a given width (layer 0 read through the adapter, which
    splits fused and transposed projections; globals from the checkpoint's header)."""
    _, per_layer, _ = partition_keys(adapter, keys)
    layer0 = adapter.read_layer(0, source.get(per_layer[0]))
    shapes = source.shapes()
    rows = sum(shapes[f"{adapter.prefix}{name}.weight"][0] for name in adapter.spec.pos_embed)
    return {
        "out": {c: layer0[f"{c}.weight"].shape[0] for c in _READERS},
        "in": {c: layer0[f"{c}.weight"].shape[1] for c in _WRITERS},
        "vocab": shapes[f"{adapter.prefix}{adapter.spec.embed}.weight"][0],
        "rows": rows,
    }


def _matrices(adapter: Adapter, shapes: dict) -> list[MatrixPlan]:
    """The RMS-decoder model's matrices at full width, as a plan holds them: every layer's linears with
    their biases, the embedding and the position table (writers of segment 0), the untied head with its
    bias; no norm weights. Their count at a width is :func:`..plan.params_at`'s."""
    d, L, vocab = adapter.hidden, adapter.n_layers, shapes["vocab"]
    layers = [
        MatrixPlan(f"layers.{i}.{c}", c, i, LAYER_MODULES[c][1], 2 * i + SEGMENT_OFFSET[c], st.Dense((k, d)), True)
        for i in range(L)
        for c, k in (*shapes["out"].items(), *shapes["in"].items())
    ]
    return layers + [
        MatrixPlan("embed", "embed", None, "writer", 0, st.Dense((vocab, d))),
        MatrixPlan("pos", "pos", None, "writer", 0, st.Dense((shapes["rows"], d))),
        MatrixPlan("lm_head", "lm_head", None, "reader", 2 * L, st.Dense((vocab, d)), True),
    ]


def plan_width(
    adapter: Adapter, source: TensorSource, keys: list[str], options: CompressOptions, width: int | None = None
) -> tuple[int, Accounting]:
    """The residual width (the ratio's; ``width`` given: that one) and the parameter accounting at it."""
    d, L = adapter.hidden, adapter.n_layers
    shapes = _shapes(adapter, source, keys)
    matrices = _matrices(adapter, shapes)
    dense_total = source_numels(source, keys, adapter.tied_embeddings)
    layer_params = L * (sum(shapes["out"].values()) + sum(shapes["in"].values())) * d
    embed_params = (shapes["vocab"] * (1 if adapter.tied_embeddings else 2) + shapes["rows"]) * d
    p_compressed = layer_params + (embed_params if options.compress_embeddings else 0)
    target = dense_total - options.ratio * p_compressed
    w = nearest_width(lambda x: params_at(matrices, lambda _: x), target, range(1, d + 1))
    nearest = (dense_total - params_at(matrices, lambda _: w)) / p_compressed
    if abs(nearest - options.ratio) > options.ratio_slack:
        raise ValueError(
            f"SliceGPT on {adapter.family} cannot meet ratio {options.ratio:g} within {options.ratio_slack:g} "
            f"(nearest: {nearest:.4f}; a tied head is untied by the centring and costs vocab × width)"
        )
    w = w if width is None else int(width)
    total = params_at(matrices, lambda _: w)
    per_matrix = {m.name: sliced_entry(m.shape[0], d, w) for m in matrices if m.layer is not None}
    return w, Accounting(
        dense_model_params=dense_total,
        compressed_model_params=total,
        ratio_over_compressed=(dense_total - total) / p_compressed,
        ratio_over_model=(dense_total - total) / dense_total,
        ratio_per_matrix_mean=1 - w / d,
        skip_params=0,
        head_mix_params=0,
        per_matrix=per_matrix,
        untied_head_params=shapes["vocab"] * (w + 1) if adapter.tied_embeddings else 0,
        output_family=RMSDecoderConfig.model_type,
        hidden=d,
        residual=w,
    )


class RMSDecoderSlice(SliceOutput):
    """The output of :func:`..pca.slice_into` for a LayerNorm decoder: the RMS-decoder family with
    ``residual_size = w`` (its norms weightless, the head untied with a bias; GPT-J's interleaved rotary
    pairs written as the family's rotate-half)."""

    layout = None  # the source's head layout where its rotary pairs are interleaved

    def plan(self, source: TensorSource, config: dict, options: CompressOptions, width: int | None = None):
        keys = source.keys()
        adapter = Adapter.from_config(config, keys)
        check(adapter, options, keys)
        w, accounting = plan_width(adapter, source, keys, options, width)
        return adapter, w, accounting

    def output(self, source: TensorSource, adapter: Adapter, config: dict, width: int, accounting: Accounting):
        check_layer_norm_decoder(config)
        shapes = _shapes(adapter, source, source.keys())
        new_config = rms_decoder_config(adapter, config, shapes["out"]["up"], shapes["rows"], residual_size=width)
        self.layout = adapter.layout if adapter.layout.rope_layout == "interleaved" else None
        return new_config, StreamOptions(globals_dtype=torch.float64, writer=Adapter.from_config(new_config))

    def finish_layer(self, layer: dict) -> dict:
        return layer if self.layout is None else actions.interleaved_to_half(layer, self.layout)

    def method(self, accounting: Accounting) -> str:
        return "centred into the RMS-decoder family"
