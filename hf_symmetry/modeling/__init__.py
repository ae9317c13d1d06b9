"""Custom Hugging Face model families shipped by hf_symmetry, registered with the Auto classes
when ``hf_symmetry`` is imported (``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``)."""

from __future__ import annotations

# the KV cache's argument/output name in the installed transformers
from .modeling_tpa import cache_field as cache_field


def causal_lm_model_types() -> tuple[str, ...]:
    """The ``model_type`` of every hf_symmetry family with a causal-LM head (the ones registered with
    ``AutoModelForCausalLM`` below): what ``heal`` can train besides transformers' own families."""
    from .configuration_compressed_llama import CompressedLlamaConfig
    from .configuration_farr import FarrLlamaConfig
    from .configuration_rms_decoder import RMSDecoderConfig
    from .configuration_tpa import TPAConfig

    return tuple(c.model_type for c in (TPAConfig, CompressedLlamaConfig, FarrLlamaConfig, RMSDecoderConfig))


def register_auto_classes() -> None:
    """Register every family with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_tpa import TPAConfig
    from .modeling_tpa import TPAForCausalLM, TPAModel

    AutoConfig.register(TPAConfig.model_type, TPAConfig, exist_ok=True)
    AutoModel.register(TPAConfig, TPAModel, exist_ok=True)
    AutoModelForCausalLM.register(TPAConfig, TPAForCausalLM, exist_ok=True)

    from .configuration_farr import FarrBertConfig, FarrLlamaConfig, FarrRobertaConfig
    from .modeling_farr import FarrBertModel, FarrLlamaForCausalLM, FarrLlamaModel, FarrRobertaModel

    for config_cls, model_cls in (
        (FarrLlamaConfig, FarrLlamaModel),
        (FarrBertConfig, FarrBertModel),
        (FarrRobertaConfig, FarrRobertaModel),
    ):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
    AutoModelForCausalLM.register(FarrLlamaConfig, FarrLlamaForCausalLM, exist_ok=True)

    from .configuration_compressed_llama import CompressedLlamaConfig
    from .modeling_compressed_llama import CompressedLlamaForCausalLM, CompressedLlamaModel

    AutoConfig.register(CompressedLlamaConfig.model_type, CompressedLlamaConfig, exist_ok=True)
    AutoModel.register(CompressedLlamaConfig, CompressedLlamaModel, exist_ok=True)
    AutoModelForCausalLM.register(CompressedLlamaConfig, CompressedLlamaForCausalLM, exist_ok=True)

    from .configuration_rms_decoder import RMSDecoderConfig
    from .modeling_rms_decoder import RMSDecoderForCausalLM, RMSDecoderModel

    AutoConfig.register(RMSDecoderConfig.model_type, RMSDecoderConfig, exist_ok=True)
    AutoModel.register(RMSDecoderConfig, RMSDecoderModel, exist_ok=True)
    AutoModelForCausalLM.register(RMSDecoderConfig, RMSDecoderForCausalLM, exist_ok=True)


register_auto_classes()
