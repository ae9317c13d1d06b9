"""Calibration of a reduced-rank conversion: the Gram of each layer's attention inputs, measured by
the layer-wise calibration engine, in which the head-mode reduction is fitted and judged."""

from __future__ import annotations

from pathlib import Path

import torch

from ...calibration import CalibrationEngine, StatsRequest, token_batches
from ..stream import DictSource


def attention_input_grams(
    model, ids: torch.Tensor, window: int = 512, progress: bool = True, placement=None, lazy: bool = False
):
    """Per layer ``C = X̃ᵀ X̃`` (float64, ``(d+1)×(d+1)``) of the attention inputs (after the pre-norm),
    ``X̃ = [X, 1]``, over ``ids`` cut into windows of ``window`` tokens.

    ``model``: an HF model folder (read one layer at a time by the calibration engine, never
    loaded whole) or an in-memory model (its state dict is the engine's source). ``placement``:
    device and calibration dtype (:func:`hf_symmetry.devices.resolve`; default CPU float32).
    ``lazy``: an iterator that calibrates layer ``i`` only when its Gram is asked for, so a caller
    that converts each layer before asking for the next holds one Gram at a time (a list otherwise)."""
    if isinstance(model, (str, Path)):
        engine = CalibrationEngine(model, placement=placement, progress=progress)
    else:
        engine = CalibrationEngine(
            DictSource(model.state_dict()), model.config.to_dict(), placement=placement, progress=progress
        )
    run = engine.start(token_batches(ids, window))

    def grams():
        # each layer's statistics are dropped once augmented (collect() would keep every layer's
        # twice), and the engine's layer before the caller converts that layer
        for step in run.layers(StatsRequest(grams=("attn_in",), sums=("attn_in",))):
            step.release()
            gram = step.stats.augmented_gram("attn_in")
            del step
            yield gram

    return grams() if lazy else list(grams())
