"""Configurations of FaRR (fuse and rank reduce) models: stock Llama/BERT/RoBERTa architectures whose
attention head dims differ per layer (and, for SmolLM3-style decoders, some layers have no RoPE).

FaRR truncates the fused value map ``W_O^h W_V^h`` (and, where exact, the score map ``W_Q^hᵀ W_K^h``)
and splits it back, so layer ``i`` has value/output head dim ``v_head_dims[i]`` (and query/key head
dim ``qk_head_dims[i]``) instead of ``head_dim``. The attention scale stays ``1/√(original head dim)``:
the reduced maps approximate the original scores, not rescaled ones.

Bias conventions of FaRR models (both exact rewrites of the original model):

* ``v_proj``/``value`` has no bias: ``b_V`` is folded into the output bias, because every softmax row
  sums to 1 (``Σ_j α_ij W_O b_V = W_O b_V``).
* encoders: ``key`` has no bias: ``b_K`` adds ``q_i · b_K`` to all scores of query i, a per-row
  constant that softmax ignores (not so under RoPE, so decoders keep theirs).

This file is copied next to saved checkpoints (``trust_remote_code`` loading), so it imports only
``transformers`` (and ``huggingface_hub``, which transformers depends on).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import BertConfig, LlamaConfig, RobertaConfig


def vo_parameters(hidden: int, n_heads: int, n_kv_heads: int, v_dim: int, o_bias: bool) -> int:
    """Parameters of one layer's ``v_proj`` (no bias) and ``o_proj``."""
    return n_kv_heads * v_dim * hidden + hidden * n_heads * v_dim + (hidden if o_bias else 0)


def qk_parameters(
    hidden: int, n_heads: int, n_kv_heads: int, qk_dim: int, q_bias: bool, k_bias: bool, qk_norm: bool = False
) -> int:
    """Parameters of one layer's ``q_proj`` and ``k_proj`` (and per-head QK-norms)."""
    return (
        n_heads * qk_dim * (hidden + int(q_bias))
        + n_kv_heads * qk_dim * (hidden + int(k_bias))
        + (2 * qk_dim if qk_norm else 0)
    )


def _check_dims(config, name: str, dims) -> None:
    if dims is None:
        return
    if len(dims) != config.num_hidden_layers:
        raise ValueError(
            f"{type(config).__name__}: {name} needs one entry per layer ({config.num_hidden_layers}), got {len(dims)}"
        )
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, int) or d <= 0]
    if bad:
        raise ValueError(f"{type(config).__name__}: {name} must be positive integers, got {bad[:3]}")


@strict
class FarrLlamaConfig(LlamaConfig):
    r"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3) after FaRR.

    Args (besides :class:`~transformers.LlamaConfig`'s):
        v_head_dims: value/output head dim of each layer (``None``: ``head_dim`` everywhere).
        qk_head_dims: query/key head dim of each layer (``None``: ``head_dim`` everywhere). Only NoPE
            layers may differ from ``head_dim``: RoPE rotates every query/key dim of RoPE layers, so
            their score map cannot be fused.
        no_rope_layers: SmolLM3's convention, one flag per layer, 0 for a NoPE layer (no rotary
            embedding on q/k); ``None``: RoPE everywhere.
        attention_bias: biases on ``q_proj`` and ``k_proj`` (Qwen2); unlike Llama it does not
            cover ``v_proj``/``o_proj``.
        o_bias: bias on ``o_proj`` (holds the folded value bias).
        qk_norm: per-head RMSNorms on q and k before RoPE (Qwen3).
        sliding_window / layer_types: per-layer sliding-window attention, as Qwen2/3 and Gemma
            declare it (``"sliding_attention"`` or ``"full_attention"`` per layer); a
            ``sliding_window`` without ``layer_types`` (Mistral) makes every layer sliding.
    """

    model_type = "hf_symmetry_farr_llama"

    v_head_dims: list[int] | None = None
    qk_head_dims: list[int] | None = None
    no_rope_layers: list[int] | None = None
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {
            "sliding_attention",
            "full_attention",
        }:
            raise ValueError(
                f"FarrLlamaConfig: layer_types needs one of 'sliding_attention'/'full_attention' per "
                f"layer ({self.num_hidden_layers}), got {self.layer_types}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("FarrLlamaConfig: sliding_attention layers need a sliding_window")
        _check_dims(self, "v_head_dims", self.v_head_dims)
        _check_dims(self, "qk_head_dims", self.qk_head_dims)
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise ValueError(
                f"FarrLlamaConfig: no_rope_layers needs one flag per layer ({self.num_hidden_layers}), "
                f"got {len(self.no_rope_layers)}"
            )
        changed = [i for i in range(self.num_hidden_layers) if self.qk_head_dim(i) != self.head_dim]
        roped = [i for i in changed if self.uses_rope(i) or self.qk_norm]
        if roped:
            raise ValueError(
                f"FarrLlamaConfig: layers {roped} change the query/key head dim, which only NoPE "
                "layers without QK-norm can (RoPE and QK-norm act on the full head dim)"
            )

    def uses_rope(self, layer: int) -> bool:
        return not self.no_rope_layers or bool(self.no_rope_layers[layer])

    def v_head_dim(self, layer: int) -> int:
        return self.v_head_dims[layer] if self.v_head_dims else self.head_dim

    def qk_head_dim(self, layer: int) -> int:
        return self.qk_head_dims[layer] if self.qk_head_dims else self.head_dim

    def kv_cache_elements_per_token(self, per_layer: bool = True) -> int:
        """Cached elements per token: ``n_kv (d_qk + d_v)`` of layer 0 if ``per_layer``, else summed
        over all layers (each layer's own head dims)."""
        layers = [0] if per_layer else range(self.num_hidden_layers)
        return sum(self.num_key_value_heads * (self.qk_head_dim(i) + self.v_head_dim(i)) for i in layers)

    def attention_parameters(self, layer: int | None = None) -> int:
        """Attention parameters of one layer (or of all layers when ``layer`` is None)."""
        if layer is None:
            return sum(self.attention_parameters(i) for i in range(self.num_hidden_layers))
        d, h, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        return qk_parameters(
            d, h, kv, self.qk_head_dim(layer), self.attention_bias, self.attention_bias, self.qk_norm
        ) + vo_parameters(d, h, kv, self.v_head_dim(layer), self.o_bias)


class _FarrEncoderMixin:
    """Per-layer head dims of a FaRR encoder (BERT/RoBERTa): query ``bias``, no key/value bias."""

    def _check_farr(self) -> None:
        if self.is_decoder or self.add_cross_attention:
            raise ValueError(f"{type(self).__name__}: FaRR encoders do not support is_decoder/add_cross_attention")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{type(self).__name__}: hidden_size must be a multiple of num_attention_heads")
        _check_dims(self, "qk_head_dims", self.qk_head_dims)
        _check_dims(self, "v_head_dims", self.v_head_dims)

    @property
    def head_dim(self) -> int:
        """The original head dim; the attention scale is ``head_dim ** -0.5``."""
        return self.hidden_size // self.num_attention_heads

    def qk_head_dim(self, layer: int) -> int:
        return self.qk_head_dims[layer] if self.qk_head_dims else self.head_dim

    def v_head_dim(self, layer: int) -> int:
        return self.v_head_dims[layer] if self.v_head_dims else self.head_dim

    def attention_parameters(self, layer: int | None = None) -> int:
        if layer is None:
            return sum(self.attention_parameters(i) for i in range(self.num_hidden_layers))
        d, h = self.hidden_size, self.num_attention_heads
        return qk_parameters(d, h, h, self.qk_head_dim(layer), True, False) + vo_parameters(
            d, h, h, self.v_head_dim(layer), True
        )


@strict
class FarrBertConfig(_FarrEncoderMixin, BertConfig):
    r"""A BERT encoder after FaRR. ``qk_head_dims`` / ``v_head_dims``: per-layer query/key and
    value/output head dims (``None``: ``hidden_size // num_attention_heads`` everywhere)."""

    model_type = "hf_symmetry_farr_bert"

    qk_head_dims: list[int] | None = None
    v_head_dims: list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check_farr()


@strict
class FarrRobertaConfig(_FarrEncoderMixin, RobertaConfig):
    r"""A RoBERTa encoder after FaRR (see :class:`FarrBertConfig`)."""

    model_type = "hf_symmetry_farr_roberta"

    qk_head_dims: list[int] | None = None
    v_head_dims: list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check_farr()


FarrLlamaConfig.register_for_auto_class()
FarrBertConfig.register_for_auto_class()
FarrRobertaConfig.register_for_auto_class()

__all__ = ["FarrBertConfig", "FarrLlamaConfig", "FarrRobertaConfig", "qk_parameters", "vo_parameters"]
