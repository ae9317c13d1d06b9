"""Which models go through the RMS-decoder route, and what it refuses, before any work."""

from __future__ import annotations

from ....architectures import Adapter
from ....architectures.capabilities import facts, require
from ...stream import partition_keys
from ..options import CompressOptions


def through_rms_decoder(config) -> bool:
    """True for the decoders compressed here (LayerNorm, so not the compressed family)."""
    f = facts(config)
    return f.decoder and f.norm_kind == "layer"


def check(adapter: Adapter, options: CompressOptions, keys: list[str]) -> None:
    """Refuse, before any work, what this route cannot do, with the reason."""
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
