"""``compress``: ProcrustesGPT structured compression with orthogonal transforms, and SliceGPT as a
built-in baseline, saved as loadable Hugging Face models (RMSNorm decoders the compressed family can
express; LayerNorm decoders through the RMS-decoder family; ``hf-symmetry families`` gives the reason for
any other). See ``docs/compress.md``. The steps, in the order a run takes them:

- :mod:`.options` — the flags, and what their combinations mean (decided once);
- :mod:`.routes` — one conversion as one object (:class:`CompressRun`) and the routes an output folder takes;
- :mod:`.plan` — which matrices are compressed, into which structure and size, and the parameter accounting;
- :mod:`.moments` — the calibration moments the solvers weight by (one pass, or sequential);
- :mod:`.folded` — the source checkpoint with its norms folded, read a matrix at a time;
- :mod:`.allocate`, :mod:`.allocate_widths` — non-uniform sizes at the same total, from measured sensitivity;
- :mod:`.terms`, :mod:`.targets`, :mod:`.tall` — each compressed matrix weighted for its stage;
- :mod:`.solve`, :mod:`.global_q` — rotations and structured factors, segment by segment or one global Q;
- :mod:`.pca` — SliceGPT's rotations and slice;
- :mod:`.assemble` — the compressed model's tensors and config, written as the solver finishes them;
- :mod:`.core`, :mod:`.pipeline` — the pipeline on tensors, a loaded model and a checkpoint folder;
- :mod:`.stock` — SliceGPT written as the source's own stock family;
- :mod:`.layernorm_decoders` — LayerNorm decoders, centred, then sliced or structured;
- :mod:`.report`, :mod:`.card` — ``compression_report.json`` and the model card.
"""

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
from .targets import matched_target

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
