"""hf_symmetry: exact weight-space symmetries of transformers, put to work."""

__version__ = "0.1.0"

from .modeling.configuration_tpa import TPAConfig  # noqa: E402  (registers the TPA family with the Auto classes)
from .modeling.modeling_tpa import TPAForCausalLM, TPAModel  # noqa: E402

__all__ = ["TPAConfig", "TPAForCausalLM", "TPAModel", "__version__"]
