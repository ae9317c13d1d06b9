"""``compress``: ProcrustesGPT structured compression with orthogonal transforms, and SliceGPT as a
built-in baseline, saved as loadable Hugging Face models (pre-norm RMSNorm decoders the compressed family
can express: Llama, Mistral without sliding window, Qwen2, Qwen3, Phi-3 with full rotary; also LayerNorm
decoders (OPT, GPT-2, GPT-NeoX, GPT-J), through the RMS-decoder family, :mod:`.layernorm_decoders`;
``hf-symmetry families`` gives the reason for any other). See ``docs/compress.md``.

The steps, one module each:

- :mod:`.options` — :class:`CompressOptions`, and what its flag combinations mean (one place);
- :mod:`.plan` — which matrices are compressed, into which structure and size, and the parameter
  accounting (equal ratios mean equal total parameter counts);
- :mod:`.moments` — the second moments the solvers weight by: one pass of the original model, or
  sequential (the partly compressed model, on the calibration engine's sequential mode);
- :mod:`.folded` — the source checkpoint with its norms folded, read one matrix (or block of rows) at a time;
- :mod:`.allocate` — non-uniform sizes at the same total, from measured sensitivity (:mod:`.allocate_widths`:
  SliceGPT's per-segment widths);
- :mod:`.terms` — the solvers' terms: each compressed matrix weighted for its stage;
- :mod:`.solve` — rotations (stage F / W) and structured factors, segment by segment (the structures
  themselves are :mod:`...solvers.structures`'s classes);
- :mod:`.pca` — SliceGPT's rotations, from one pass or sequential;
- :mod:`.global_q` — one global rotation, the weights streamed from the checkpoint on each alternation;
- :mod:`.targets` — the solvers' damped weights and sequential calibration's matched targets;
- :mod:`.tall` — the embedding and an untied head, solved and written a block of rows at a time;
- :mod:`.assemble` — the compressed model's tensors (written part by part as the solver finishes them) and config;
- :mod:`.layernorm_decoders` — the compress route of LayerNorm decoders (OPT, GPT-2, GPT-NeoX, GPT-J):
  centred, then sliced (SliceGPT) or structured (the steps above on the centred model), written as the
  RMS-decoder family;
- :mod:`.stock` — SliceGPT written as the source's own stock family, where it can be;
- :mod:`.routes` — one conversion as one object (:class:`CompressRun`: source, options, calibration text and
  ids, device, dtype, sink, folder; the calibration passes run on it), and the routes of an output folder as
  objects (compressed family, stock, LayerNorm decoders);
- :mod:`.pipeline` — the entry points (tensors, a loaded model, a checkpoint folder: the one folder entry
  point, which decides the route once);
- :mod:`.report` — the report and the finishing of an output folder, shared by every route;
- :mod:`.card` — the model card.
"""

from __future__ import annotations

from ..stream import DictSource, TensorSource
from .assemble import Assembler, build_model, compressed_config, config_object, module_tensors
from .folded import FoldedGlobals, FoldedLayers, read_folded
from .moments import (
    CalibrationStats,
    collect_statistics,
    one_pass_statistics,
    sequential_weighted,
    token_sequences,
)
from .options import (
    ALLOCATIONS,
    LAYER_MODULES,
    METHODS,
    PRESETS,
    Q_MODES,
    SLICE,
    STAGES,
    STRUCTURE_CHOICES,
    STRUCTURES,
    CompressOptions,
)
from .pca import SlicedLayer, pca_rotations, sequential_stream_pca
from .core import compress_into
from .pipeline import compress_checkpoint, compress_model, compress_tensors, route_for
from .plan import MatrixPlan, Plan, check_family, plan_compression, plan_for, source_numels
from .report import REPORT_FILE, CompressReport, record_verification
from .routes import CALIBRATION, CompressRun, Route
from .solve import Kept
from .targets import matched_target

__all__ = [
    "ALLOCATIONS",
    "DictSource",
    "TensorSource",
    "Assembler",
    "FoldedGlobals",
    "FoldedLayers",
    "build_model",
    "compressed_config",
    "config_object",
    "module_tensors",
    "read_folded",
    "CalibrationStats",
    "SlicedLayer",
    "sequential_stream_pca",
    "sequential_weighted",
    "token_sequences",
    "collect_statistics",
    "one_pass_statistics",
    "pca_rotations",
    "LAYER_MODULES",
    "PRESETS",
    "Q_MODES",
    "STAGES",
    "STRUCTURES",
    "STRUCTURE_CHOICES",
    "METHODS",
    "SLICE",
    "CompressOptions",
    "REPORT_FILE",
    "CompressReport",
    "compress_checkpoint",
    "compress_model",
    "compress_tensors",
    "compress_into",
    "route_for",
    "CALIBRATION",
    "CompressRun",
    "Route",
    "record_verification",
    "MatrixPlan",
    "Plan",
    "check_family",
    "plan_compression",
    "plan_for",
    "source_numels",
    "Kept",
    "matched_target",
]
