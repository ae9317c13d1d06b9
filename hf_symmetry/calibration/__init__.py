"""Layer-wise, device-aware calibration: the one engine every calibrated conversion uses.

* :mod:`.data`: calibration text (:class:`CalibrationText`, the one shape every conversion takes) -> token
  ids -> batches;
* :mod:`.statistics`: what a conversion asks for (:class:`StatsRequest`: sites and kinds) and the
  one accumulation rule (:class:`LayerStats`);
* :mod:`.engine`: :class:`CalibrationEngine`, one decoder layer at a time from the checkpoint on
  the chosen device: the empty model, layers materialised, the embedding pass;
* :mod:`.capture`: the layer catcher of the embedding pass and the host-side rotary tables;
* :mod:`.run`: the layer-by-layer loop (:class:`CalibrationRun`), with a sequential mode
  (:class:`LayerStep`);
* :mod:`.memory`: freed layer memory handed back to the OS.
"""

from .data import CalibrationText, calibration_ids, token_batches, token_counts
from .engine import CalibrationEngine, CalibrationResult
from .run import CalibrationRun, LayerStep
from .statistics import FINAL_SITES, LAYER_SITES, LayerStats, StatsRequest

__all__ = [
    "CalibrationText",
    "CalibrationEngine",
    "CalibrationResult",
    "CalibrationRun",
    "LayerStep",
    "LayerStats",
    "StatsRequest",
    "LAYER_SITES",
    "FINAL_SITES",
    "token_batches",
    "calibration_ids",
    "token_counts",
]
