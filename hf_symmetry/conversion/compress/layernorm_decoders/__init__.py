"""``compress`` on LayerNorm decoders (OPT, GPT-2, GPT-NeoX, GPT-J), through the RMS-decoder family.

The compressed family is a Llama (gated FFN, RoPE, no learned positions, no biases), so a LayerNorm
decoder is compressed into the RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`)
instead, after centring: every writer to the residual stream is mean-centred and each LayerNorm folded
into its readers, which leaves the function unchanged and makes the stream rotatable (:mod:`.centred`).
Then SliceGPT (:mod:`.slice`) or the structured classes (:mod:`.structured`). Here: what this route refuses
before any work, both routes on tensors and the folder route."""

from __future__ import annotations

import torch

from ....architectures import Adapter
from ....architectures.capabilities import facts, require
from ....checkpoint_io import CheckpointReader, write_config
from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ....modeling.modeling_rms_decoder import RMSDecoderForCausalLM
from ...rms_decoder import check_layer_norm_decoder, copy_remote_code
from ...stream import partition_keys
from ..options import CompressOptions
from ..assemble import loaded
from ..pca import slice_into
from ..report import CompressReport
from ..routes import CompressRun, Route
from .centred import CentredSource
from .slice import RMSDecoderSlice
from .structured import plan_structured, structured_tensors


def through_rms_decoder(config) -> bool:
    """True for the decoders compressed here (LayerNorm, so not the compressed family)."""
    f = facts(config)
    return f.decoder and f.norm_kind == "layer"


def check(config: dict, keys: list[str], options: CompressOptions) -> None:
    """Refuse, before any work, what this route cannot do, with the reason."""
    adapter = Adapter.from_config(config, keys)
    require(adapter, "slicegpt" if options.slicing else "compress")
    where = f"on a LayerNorm decoder ({adapter.family})"
    if options.slicing:
        if options.sequential:
            raise ValueError(
                f"sequential SliceGPT {where} is not implemented: drop --sequential (one pass of the "
                "original model, one global PCA of the centred stream)"
            )
        if options.q_mode != "global":
            raise ValueError(
                f"SliceGPT {where} writes the RMS-decoder family, which has one basis for the whole "
                "stream and no skip matrices: use --q-mode global (the default)"
            )
        if options.allocation != "uniform":
            raise ValueError(f"SliceGPT {where} keeps one width for every segment: --allocation uniform")
    else:
        if options.sequential:
            raise ValueError(
                f"sequential calibration {where} is not implemented (the layer-wise engine would "
                "replace the embedding without its position table): drop --sequential"
            )
        if options.allocation != "uniform":
            raise ValueError(f"--allocation sensitivity {where} is not implemented: use --allocation uniform")
        if facts(adapter).parallel_block:  # attention and FFN both read the layer input
            if options.segment_rotations:
                raise ValueError(
                    f"one rotation per residual segment {where}: {adapter.family} runs attention and "
                    "FFN in parallel, so there is no segment between them: use --q-mode global"
                )
            if options.weighted:
                raise ValueError(
                    f"stage w {where}: {adapter.family} runs attention and FFN in parallel, and the "
                    "calibration statistics of stage w are taken per sequential segment: use --stage f"
                )
    _, _, rest = partition_keys(adapter, keys)
    if rest:
        raise ValueError(f"checkpoint has tensors compress does not know how to carry: {rest[:4]}")
    check_layer_norm_decoder(config)


def build(state: dict, config: dict, dtype: torch.dtype):
    """The RMS-decoder model holding ``state``, and its counted parameters."""
    return loaded(RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(config)).to(dtype), state)


def layer_norm_tensors(run: CompressRun, width: int | None = None):
    """Either route into ``run.sink``: (config dict, report). ``width`` (SliceGPT only) overrides the
    planned residual width. Refused inputs are :func:`check`'s (the caller's, before any work)."""
    if run.options.slicing:
        return slice_into(run, RMSDecoderSlice(), width)
    return structured_tensors(run)


class LayerNormDecoders(Route):
    """The folder route of LayerNorm decoders (:func:`..pipeline.compress_checkpoint`): the checkpoint read
    one layer at a time, written as the RMS-decoder family (weights, config, its remote code)."""

    def check(self, reader: CheckpointReader, options: CompressOptions) -> None:
        check(reader.config, reader.keys(), options)
        if options.slicing:  # an unreachable ratio fails here
            RMSDecoderSlice().plan(reader, reader.config, options)
        else:
            plan_structured(CentredSource(reader, reader.config), options)

    def write(self, run: CompressRun) -> CompressReport:
        new_config, report = layer_norm_tensors(run)
        write_config(run.folder, new_config)
        copy_remote_code(run.folder)
        return report


__all__ = [
    "build",
    "check",
    "LayerNormDecoders",
    "layer_norm_tensors",
    "RMSDecoderSlice",
    "structured_tensors",
    "through_rms_decoder",
]
