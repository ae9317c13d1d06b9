"""The in-memory API: FaRR of a state dict (:func:`farr_state_dict`) or of a loaded model
(:func:`farr_model`), and the FaRR model instance holding a state dict (:func:`build_farr_model`)."""

from __future__ import annotations

import torch

from ..stream import DictSink, DictSource, Tensors
from .calibrated import LayerWeights, attention_input_moments
from .options import FarrOptions
from .reduce import INDEX_BUFFERS, run_farr, state_dict_parameters
from .target import farr_classes, normalised_config


def farr_state_dict(
    state_dict: Tensors,
    config,
    options: FarrOptions,
    progress: bool = False,
    moments: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
):
    """In-memory FaRR: returns (new state dict, FaRR config, report). ``moments`` (from
    :func:`attention_input_moments`) switches to the calibrated, activation-aware metric."""
    config = normalised_config(config)
    sink = DictSink()
    weights = LayerWeights.from_moments(moments, augmented=options.qk) if moments else None
    farr_config, report, _ = run_farr(DictSource(state_dict), config, options, sink, progress, weights)
    tied = bool(config.get("tie_word_embeddings"))
    report.params_before, report.params_after = (
        state_dict_parameters(state_dict, tied),
        state_dict_parameters(sink, tied),
    )
    return dict(sink), farr_config, report


def build_farr_model(state_dict: Tensors, farr_config, dtype: torch.dtype | None = None):
    """A FaRR model instance holding ``state_dict`` (in eval mode)."""
    target_cls = next(iter(farr_classes(farr_config).values()))
    dtype = dtype or next(iter(state_dict.values())).dtype
    model = target_cls(farr_config).to(dtype)  # before loading, so float64 weights stay float64
    own = model.state_dict()
    missing = [
        k for k in own if k not in state_dict and not (k == "lm_head.weight" and farr_config.tie_word_embeddings)
    ]
    unexpected = [k for k in state_dict if k not in own and not k.endswith(INDEX_BUFFERS)]
    if missing or unexpected:
        raise ValueError(f"FaRR state dict does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False)
    if getattr(farr_config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def farr_model(model, options: FarrOptions, progress: bool = False, calib_ids: torch.Tensor | None = None):
    """FaRR of an in-memory model: returns (FaRR model, report). ``calib_ids`` (1-D token ids)
    switches to the calibrated metric, measured on the model's own attention inputs."""
    moments = attention_input_moments(model, calib_ids) if calib_ids is not None else None
    sd, cfg, report = farr_state_dict(model.state_dict(), model.config, options, progress, moments)
    if calib_ids is not None:
        report.calibration = {"tokens": int(calib_ids.numel())}
    return build_farr_model(sd, cfg, next(model.parameters()).dtype), report
