"""``compress`` on LayerNorm decoders (OPT, GPT-2, GPT-NeoX, GPT-J), through the RMS-decoder family.

The compressed family is a Llama (gated FFN, RoPE, no learned positions, no biases), so a LayerNorm
decoder is compressed into the RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`)
instead, after centring: every writer to the residual stream is mean-centred and each LayerNorm folded
into its readers, which leaves the function unchanged and makes the stream rotatable. The steps:

- :mod:`.centred` — the centred model as a tensor source, one layer at a time from the checkpoint;
- :mod:`.slice` — SliceGPT's RMS-decoder output (the slice is :func:`..pca.slice_into`'s): one global PCA
  of the centred stream, the stream sliced;
- :mod:`.structured` — ProcrustesGPT (Kronecker sums, GS, low rank): the compressed family's plan,
  solvers and assembly on the centred model, biases and the position table kept dense;
- :mod:`.checks` — what this route refuses, before any work;
- here: both routes on tensors (:func:`layer_norm_tensors`) and the folder route (:class:`LayerNormDecoders`).
"""

from __future__ import annotations


import torch

from ....architectures import Adapter
from ....checkpoint_io import CheckpointReader, write_config
from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ....modeling.modeling_rms_decoder import RMSDecoderForCausalLM
from ...rms_decoder import copy_remote_code
from ..options import CompressOptions
from ..pca import slice_into
from ..report import CompressReport
from ..routes import CompressRun, Route
from .centred import CentredSource
from .checks import check, through_rms_decoder
from .slice import RMSDecoderSlice
from .structured import layer_norm_plan, plan_structured, structured_tensors


def build(state: dict, config: dict, dtype: torch.dtype):
    """The RMS-decoder model holding ``state`` (strict), and its counted parameters (with the ±1 signs of
    orthogonal skips, as the compressed family counts them)."""
    model = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(config)).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs")
    )
    return model.eval(), counted


def layer_norm_tensors(run: CompressRun, width: int | None = None):
    """Either route into ``run.sink``: (config dict, report). ``width`` (SliceGPT only) overrides the
    planned residual width."""
    check(Adapter.from_config(run.config, run.source.keys()), run.options, run.source.keys())
    if run.options.slicing:
        return slice_into(run, RMSDecoderSlice(), width)
    return structured_tensors(run)


class LayerNormDecoders(Route):
    """The folder route of LayerNorm decoders (:func:`..pipeline.compress_checkpoint`): the checkpoint read
    one layer at a time, written as the RMS-decoder family (weights, config, its remote code)."""

    def check(self, reader: CheckpointReader, options: CompressOptions) -> None:
        adapter = Adapter.from_config(reader.config, reader.keys())
        check(adapter, options, reader.keys())
        if options.slicing:  # an unreachable ratio fails here
            RMSDecoderSlice().plan(reader, reader.config, options)
        else:
            layer_norm_plan(reader, reader.config, options)

    def write(self, run: CompressRun) -> CompressReport:
        new_config, report = layer_norm_tensors(run)
        write_config(run.folder, new_config)
        copy_remote_code(run.folder)
        return report


__all__ = [
    "CentredSource",
    "build",
    "check",
    "LayerNormDecoders",
    "layer_norm_tensors",
    "layer_norm_plan",
    "plan_structured",
    "RMSDecoderSlice",
    "structured_tensors",
    "through_rms_decoder",
]
