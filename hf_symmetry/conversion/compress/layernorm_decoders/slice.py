"""SliceGPT on LayerNorm decoders (Ashkboos et al., 2024, §3.2), through the RMS-decoder family.

The centred stream (:mod:`.centred`) is ``P x`` (``P = I − 11ᵀ/d``), its second moment per segment ``P C P``;
one global rotation ``Q`` maps it and its first ``w`` coordinates are kept (the slice is
:func:`..pca.slice_into`'s). The output is the RMS-decoder family with ``residual_size = w`` (norms still divide
by ``d``; the head, untied by the centring, reads the sliced stream); at ``w = d`` an exact rotation. ``w`` meets
the ratio on the matrices on the stream, V and the position table included."""

from __future__ import annotations

import torch

from ....architectures import Adapter
from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ....solvers import structures as st
from ....symmetry import actions
from ...rms_decoder import rms_decoder_config
from ...stream import StreamOptions, TensorSource
from ..options import CompressOptions
from ..pca import SliceOutput
from ..plan import (
    Accounting,
    MatrixPlan,
    budget,
    check_ratio,
    dense_entries,
    nearest_width,
    params_at,
    sliced_entry,
    source_numels,
)
from .centred import CentredSource


class RMSDecoderSlice(SliceOutput):
    """The output of :func:`..pca.slice_into` for a LayerNorm decoder (GPT-J's interleaved rotary pairs
    written as the family's rotate-half)."""

    layout = None  # the source's head layout where its rotary pairs are interleaved
    intermediate = rows = 0  # the source's intermediate size and position-table rows (:meth:`plan`)

    def plan(self, source: TensorSource, config: dict, options: CompressOptions, width: int | None = None):
        """The width whose parameter count is closest to the ratio's target (``width`` given: that one) and
        the accounting at it (the source passed by the package's ``check``)."""
        centred = CentredSource(source, config)  # the centred model's sizes
        adapter = centred.adapter
        d, tied = adapter.hidden, adapter.tied_embeddings
        self.intermediate, self.rows = centred.config["intermediate_size"], centred.position_rows
        vocab = source.shapes()[f"{adapter.prefix}{adapter.spec.embed}.weight"][0]
        matrices = [
            *dense_entries(adapter, self.intermediate, vocab, lambda _: True, head=True),
            MatrixPlan("pos", "pos", None, "writer", 0, st.Dense((self.rows, d))),
        ]
        dense_total = source_numels(source, tied)
        p_compressed, target = budget(  # measured on every matrix on the stream (V and the positions too)
            matrices, dense_total, options, tied, lambda m: m.layer is not None or options.compress_embeddings
        )

        def params(w: int) -> int:
            return params_at(matrices, lambda _: w) + vocab  # and the head's bias

        def at(w: int) -> Accounting:
            total = params(w)
            # the report names a layer's matrices by their key, its readers first
            layers = sorted((m for m in matrices if m.layer is not None), key=lambda m: (m.layer, m.role))
            return Accounting.of(
                dense_total,
                total,
                p_compressed,
                w / d,
                {f"layers.{m.layer}.{m.canon}": sliced_entry(m.shape[0], d, w) for m in layers},
                ratio_over_model=(dense_total - total) / dense_total,  # this route's rounding of it
                untied_head_params=vocab * (w + 1) if tied else 0,
                output_family=RMSDecoderConfig.model_type,
                hidden=d,
                residual=w,
            )

        w = nearest_width(params, target, range(1, d + 1))
        acc = at(w)
        untied = "; the tied head is untied by the centring and costs vocab × width" if tied else ""
        check_ratio(acc, options, adapter.family, untied)
        return (adapter, w, acc) if width is None else (adapter, int(width), at(int(width)))

    def output(self, source: TensorSource, adapter: Adapter, config: dict, width: int, accounting: Accounting):
        new_config = rms_decoder_config(adapter, config, self.intermediate, self.rows, residual_size=width)
        self.layout = adapter.layout if adapter.layout.rope_layout == "interleaved" else None
        return new_config, StreamOptions(globals_dtype=torch.float64, writer=Adapter.from_config(new_config))

    def finish_layer(self, layer: dict) -> dict:
        return layer if self.layout is None else actions.interleaved_to_half(layer, self.layout)

    def method(self, accounting: Accounting) -> str:
        return "centred into the RMS-decoder family"
