"""Configuration of LayerNorm decoders (OPT, GPT-2, GPT-NeoX, GPT-J) after residual-stream rotation
(``hf-symmetry rotate --residual`` on a LayerNorm model) or compression (``hf-symmetry compress``: SliceGPT
slices the stream, the structured classes replace linears by structured ones).

This file is copied next to saved checkpoints (``trust_remote_code`` loading), so it imports only
``transformers`` (and ``huggingface_hub``, which transformers depends on).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


@strict
class RMSDecoderConfig(PreTrainedConfig):
    r"""A pre-norm decoder (learned absolute positions or rotary, sequential or parallel blocks) whose
    norms are RMSNorms without weight.

    A LayerNorm decoder (OPT, GPT-2, GPT-NeoX) becomes one exactly: centring every writer to the residual stream (the
    embeddings' rows, the attention output and FFN output projections, with their biases) makes the
    stream zero-mean, so each LayerNorm equals an RMSNorm followed by its γ and β; those fold into
    the linear layers that read the norm. The stream can then be rotated by any orthogonal matrix.

    Args:
        position_offset: rows of the position table before position 0 (OPT: 2).
        positions_from_mask: count positions over the attention mask (OPT: left padding does not
            shift positions) instead of from the cache position (GPT-2).
        attention_bias / mlp_bias: biases on q/k/v/o and on the FFN's two projections.
        lm_head_bias: the head's bias (the final LayerNorm's β folded in).
        residual_size: width of the residual stream (``hidden_size`` unless sliced: SliceGPT keeps the
            stream's first principal directions). The norms still divide ``Σ x²`` by ``hidden_size``, and
            the attention keeps ``hidden_size`` channels (``num_attention_heads × head_dim``).
        head_dim: ``hidden_size // num_attention_heads`` unless given.
        rotary: rotary position embeddings (``rope_parameters``, rotate-half pairing, on the first
            ``partial_rotary_factor`` of each head, as GPT-NeoX) instead of a learned position table.
            Only a rotary config has ``rope_parameters`` (one with learned positions has no RoPE to
            scale); the ``rope_parameters`` that configs with learned positions written before carry
            are dropped on loading.
        parallel_block: attention and FFN both read the layer's input and both add to it (GPT-NeoX's
            ``use_parallel_residual``); otherwise the FFN reads the stream after attention.
        layer_structures: per layer, ``{module: structure}`` for ``q_proj``, ``k_proj``, ``v_proj``,
            ``o_proj``, ``up_proj``, ``down_proj`` (ProcrustesGPT, ``hf-symmetry compress``): ``{"type":
            "dense"}``, ``{"type": "lowrank", "rank": r}``, ``{"type": "kron", "rank": r, "a_shape": [m1,
            n1]}`` or ``{"type": "gs", "rank": b, "blocks": [kl, kr]}``, in the module's ``[out, in]``
            orientation. ``None`` (or a module left out): an ordinary ``nn.Linear``.
        embed_structure / lm_head_structure: the token embedding's ``[vocab, d]`` and the head's
            structure in the same form (``None``: dense).
        skip_connections: ``"none"`` (one basis for the whole stream) or ``"orthogonal"`` (one basis per
            residual segment: every skip connection carries the orthogonal ``Q_prevᵀ Q_next``, stored as
            a Cayley parameter).
        compression: what made the model (method, ratio, source model type); informational.
    """

    model_type = "hf_symmetry_rms_decoder"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 50272
    hidden_size: int = 768
    residual_size: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    hidden_act: str = "relu"
    max_position_embeddings: int = 2048
    position_offset: int = 0
    rotary: bool = False
    parallel_block: bool = False
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
    layer_structures: list | None = None
    embed_structure: dict | None = None
    lm_head_structure: dict | None = None
    skip_connections: str = "none"
    compression: dict | None = None

    def __post_init__(self, **kwargs):
        if self.residual_size is None:
            self.residual_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        rope_parameters = kwargs.pop("rope_parameters", None)
        if self.rotary:  # set before PreTrainedConfig standardises it (defaults, legacy rope_theta/rope_scaling)
            self.rope_parameters = rope_parameters
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if not 0 < self.residual_size <= self.hidden_size:
            raise ValueError(f"residual_size must be in (0, hidden_size={self.hidden_size}], got {self.residual_size}")
        if self.skip_connections not in ("none", "orthogonal"):
            raise ValueError(f"skip_connections must be 'none' or 'orthogonal', got {self.skip_connections!r}")
        if self.skip_connections == "orthogonal" and (self.parallel_block or self.residual_size != self.hidden_size):
            raise ValueError("orthogonal skip connections need sequential blocks and an unsliced stream")
        if self.layer_structures is not None and len(self.layer_structures) != self.num_hidden_layers:
            raise ValueError(
                f"layer_structures has {len(self.layer_structures)} entries for {self.num_hidden_layers} layers"
            )

    def kv_cache_elements_per_token(self, per_layer: bool = True) -> int:
        """Cached elements per token (one layer if ``per_layer`` else all): K and V, ``2 · hidden``."""
        return 2 * self.hidden_size * (1 if per_layer else self.num_hidden_layers)


RMSDecoderConfig.register_for_auto_class()

__all__ = ["RMSDecoderConfig"]
