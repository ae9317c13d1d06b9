"""Configuration of LayerNorm decoders (OPT, GPT-2) after residual-stream rotation (``hf-symmetry
rotate --residual`` on a LayerNorm model).

This file is copied next to saved checkpoints (``trust_remote_code`` loading), so it imports only
``transformers`` (and ``huggingface_hub``, which transformers depends on).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


@strict
class RMSDecoderConfig(PreTrainedConfig):
    r"""A pre-norm decoder with learned absolute positions whose norms are RMSNorms without weight.

    A LayerNorm decoder becomes one exactly: centring every writer to the residual stream (the
    embeddings' rows, the attention output and FFN output projections, with their biases) makes the
    stream zero-mean, so each LayerNorm equals an RMSNorm followed by its γ and β; those fold into
    the linear layers that read the norm. The stream can then be rotated by any orthogonal matrix.

    Args:
        position_offset: rows of the position table before position 0 (OPT: 2).
        positions_from_mask: count positions over the attention mask (OPT: left padding does not
            shift positions) instead of from the cache position (GPT-2).
        attention_bias / mlp_bias: biases on q/k/v/o and on the FFN's two projections.
        lm_head_bias: the head's bias (the final LayerNorm's β folded in).
    """

    model_type = "hf_symmetry_rms_decoder"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 50272
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    hidden_act: str = "relu"
    max_position_embeddings: int = 2048
    position_offset: int = 0
    positions_from_mask: bool = False
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    mlp_bias: bool = True
    lm_head_bias: bool = True
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def validate_architecture(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_cache_elements_per_token(self, per_layer: bool = True) -> int:
        """Cached elements per token (one layer if ``per_layer`` else all): K and V, ``2 · hidden``."""
        return 2 * self.hidden_size * (1 if per_layer else self.num_hidden_layers)


RMSDecoderConfig.register_for_auto_class()

__all__ = ["RMSDecoderConfig"]
