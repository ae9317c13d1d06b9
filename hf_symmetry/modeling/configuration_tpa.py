"""Configuration of Tensor Product Attention (T6) models.

This file is copied verbatim next to saved checkpoints (``trust_remote_code`` loading), so it
imports only ``transformers`` (and ``huggingface_hub``, which transformers depends on).
"""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

TPA_DECODE_PATHS = ("auto", "factor", "materialize")


@strict
class TPAConfig(PreTrainedConfig):
    r"""Configuration of a T6 / Tensor Product Attention decoder (Zhang et al., "Tensor Product Attention
    Is All You Need").

    Per token, ``Q_t = (1/R_Q) A_Q(x)^T B_Q(x)`` with ``A_Q ∈ R^{R_Q×h}`` (head factor) and
    ``B_Q ∈ R^{R_Q×d_h}`` (token factor); likewise K (rank ``k_rank``) and V (rank ``v_rank``). RoPE
    rotates the B factors; the KV cache keeps ``A_K, rotated B_K, A_V, B_V``.

    Args:
        q_rank: R_Q. ``None`` selects the TPA-KV-only variant: an ordinary ``q_proj`` for queries.
        k_rank, v_rank: R_K, R_V (> 0).
        contextual_a: ``True``: A factors are linear in x (the paper's TPA). ``False``: A is a learned
            constant ``[R, h]`` per projection ("non-contextual A"); MHA/MQA/GQA are exact special cases and
            the cache then holds ``(R_K + R_V) d_h`` elements per token and layer.
        head_dim: defaults to ``hidden_size // num_attention_heads`` (which must then divide exactly).
        intermediate_size: SwiGLU width, default ``8/3 hidden_size`` rounded up to a multiple of 64.
        attention_bias: biases on the B projections (and on ``q_proj`` in KV-only mode), e.g. Qwen2.
        attention_out_bias: bias on ``o_proj``.
        qk_norm: a per-head RMSNorm (learned γ over ``head_dim``, Qwen3's QK-norm) on the queries and on the
            key token factors ``B_K``, before RoPE. With non-contextual A at full rank (a converted
            GQA model: every key head is one factor) it is exactly Qwen3's norm on each key head; the
            factor-space routes stay exact since the norm acts on each factor, not on composed keys.
        tpa_decode_path: ``"auto"`` (each part of the attention, scores and values, from the factors
            where that is estimated cheaper: decoding and short chunks against a long cache; whole-sequence
            prefill and training then form Q/K/V and use eager/SDPA), ``"factor"`` (always compute attention
            from the factors, never materialising K/V, also in training) or ``"materialize"`` (always form
            K/V and call eager/SDPA attention).
        rope_parameters: as in Llama (``{"rope_type": "default", "rope_theta": 10000.0}``); any type of
            transformers' ``ROPE_INIT_FUNCTIONS``. ``partial_rotary_factor`` rotates the first dims only.
    """

    model_type = "hf_symmetry_tpa"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    head_dim: int | None = None
    q_rank: int | None = 6
    k_rank: int = 2
    v_rank: int = 2
    contextual_a: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    attention_dropout: int | float = 0.0
    tpa_decode_path: str = "auto"

    def __post_init__(self, **kwargs):
        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TPAConfig: {name} must be a positive integer, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "k_rank", "v_rank"):
            positive(name, getattr(self, name))
        if self.q_rank is not None:
            positive("q_rank (None selects the TPA-KV-only variant)", self.q_rank)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"TPAConfig: hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); pass head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        positive("head_dim", self.head_dim)
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        positive("intermediate_size", self.intermediate_size)
        if self.tpa_decode_path not in TPA_DECODE_PATHS:
            raise ValueError(
                f"TPAConfig: tpa_decode_path must be one of {TPA_DECODE_PATHS}, got {self.tpa_decode_path!r}"
            )
        if not 0.0 <= float(self.attention_dropout) < 1.0:
            raise ValueError(f"TPAConfig: attention_dropout must be in [0, 1), got {self.attention_dropout}")
        if "num_key_value_heads" in kwargs:
            raise ValueError("TPAConfig has no num_key_value_heads: the KV structure is given by k_rank/v_rank")
        super().__post_init__(**kwargs)
        rope = self.rope_parameters or {}
        factor = rope.get("partial_rotary_factor", 1.0)
        rotary_dim = int(self.head_dim * factor)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(
                f"TPAConfig: the RoPE dimension must be even and positive, got {rotary_dim} "
                f"(head_dim={self.head_dim}, partial_rotary_factor={factor})"
            )

    # --- derived quantities -------------------------------------------------------------------
    @property
    def tpa_kv_only(self) -> bool:
        """True for the TPA-KV-only variant (ordinary query projection)."""
        return self.q_rank is None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * (self.rope_parameters or {}).get("partial_rotary_factor", 1.0))

    def kv_cache_elements_per_token(self, per_layer: bool = True) -> int:
        """Cached elements per token (one layer if ``per_layer`` else all layers):
        ``(R_K + R_V)(h + d_h)``, or ``(R_K + R_V) d_h`` with non-contextual A (A is stored once)."""
        per = (self.k_rank + self.v_rank) * (self.head_dim + (self.num_attention_heads if self.contextual_a else 0))
        return per if per_layer else per * self.num_hidden_layers

    def attention_parameters(self) -> int:
        """Attention weights per layer (no biases): factor projections plus ``o_proj``."""
        h, dh, d = self.num_attention_heads, self.head_dim, self.hidden_size
        a_cost = (lambda r: d * r * h) if self.contextual_a else (lambda r: r * h)
        total = sum(a_cost(r) + d * r * dh for r in (self.k_rank, self.v_rank))
        total += d * h * dh if self.q_rank is None else a_cost(self.q_rank) + d * self.q_rank * dh
        return total + h * dh * d


TPAConfig.register_for_auto_class()

__all__ = ["TPAConfig"]
