"""``compress``: ProcrustesGPT structured compression with orthogonal transforms, and SliceGPT as a
built-in baseline, saved as loadable Hugging Face models (RMSNorm decoders the compressed family can
express; LayerNorm decoders through the RMS-decoder family; ``hf-symmetry families`` gives the reason for
any other). One module per step: the table "The steps" of ``docs/compress.md`` says which does what, in the
order a run takes them (options, plan, calibration moments, allocation, terms, solve, assembly, routes)."""

from __future__ import annotations

from ..stream import DictSource
from .assemble import Assembler, build_model, compressed_config
from .core import compress_into
from .folded import FoldedLayers, read_folded
from .moments import CalibrationStats, collect_statistics, sequential_weighted
from .options import PRESETS, CompressOptions
from .pca import sequential_stream_pca
from .pipeline import compress_checkpoint, compress_model, compress_tensors
from .plan import MatrixPlan, check_family, plan_compression, plan_for
from .report import record_verification
from .routes import CALIBRATION, CompressRun
from .terms import matched_target

__all__ = [
    "CALIBRATION",
    "PRESETS",
    "Assembler",
    "CalibrationStats",
    "CompressOptions",
    "CompressRun",
    "DictSource",
    "FoldedLayers",
    "MatrixPlan",
    "build_model",
    "check_family",
    "collect_statistics",
    "compress_checkpoint",
    "compress_into",
    "compress_model",
    "compress_tensors",
    "compressed_config",
    "matched_target",
    "plan_compression",
    "plan_for",
    "read_folded",
    "record_verification",
    "sequential_stream_pca",
    "sequential_weighted",
]
