"""Declarative per-family maps of checkpoints (spec) and the adapter that reads them."""

from .adapter import Adapter, adapter_for
from .capabilities import UnsupportedSymmetry
from .spec import SPECS, SUPPORTED_MODEL_TYPES, ArchSpec, spec_for_model_type

__all__ = [
    "Adapter",
    "ArchSpec",
    "SPECS",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedSymmetry",
    "adapter_for",
    "spec_for_model_type",
]
