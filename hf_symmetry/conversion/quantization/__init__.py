"""Rotations and scalings aimed at low-bit weight quantization (``rotate --for-quantization``):
the exact transforms of one canonical layer (:mod:`.rotation`), the activation-aware exact
scales searched against a quantizer (:mod:`.scales`) and the exact channel scalings both set
(:mod:`.channel_scales`). :mod:`hf_symmetry.conversion.rotate` runs them
over a checkpoint."""

from .channel_scales import scale_ffn_channels, scale_norm_readers, scale_vo_channels
from .rotation import (
    LayerSteps,
    QuantBalance,
    ScaleSearch,
    balance_ffn,
    balance_norms,
    balance_vo,
    balanced,
    hadamard_except,
    head_hadamards,
    layer_matrices,
    learn_rotation,
    massive_channels,
    rotation_error,
    transform_layer,
)
from .scales import (
    GRID,
    SITES,
    apply_scales,
    layer_stats,
    scale_error,
    search_scales,
    to_layer_basis,
)

__all__ = [
    "GRID",
    "SITES",
    "LayerSteps",
    "QuantBalance",
    "ScaleSearch",
    "apply_scales",
    "balance_ffn",
    "balance_norms",
    "balance_vo",
    "balanced",
    "hadamard_except",
    "head_hadamards",
    "layer_matrices",
    "layer_stats",
    "learn_rotation",
    "massive_channels",
    "rotation_error",
    "scale_error",
    "scale_ffn_channels",
    "scale_norm_readers",
    "scale_vo_channels",
    "search_scales",
    "to_layer_basis",
    "transform_layer",
]
