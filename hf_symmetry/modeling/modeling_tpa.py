"""Tensor Product Attention (T6) for Hugging Face Transformers.

Zhang et al., "Tensor Product Attention Is All You Need". Per token and head i,

    Q_t = (1/R_Q) A_Q(x_t)^T B_Q(x_t),   K_t = (1/R_K) A_K^T B_K,   V_t = (1/R_V) A_V^T B_V,

with head factors ``A ∈ R^{R×h}`` and token factors ``B ∈ R^{R×d_h}``. RoPE (HF ``rotate_half``
convention) rotates the B factors, so K's B is cached already rotated. The cache (:class:`TPACache`)
holds ``A_K, B_K, A_V, B_V``: ``(R_K + R_V)(h + d_h)`` elements per token and layer, or
``(R_K + R_V) d_h`` with non-contextual A (A is then stored once, not per token).

Attention can run in factor space (the paper's FlashTPA idea, here in plain PyTorch), for decoding,
prefill and training alike (every route is differentiable): ``P = B_Q B_K^T`` is shared by all heads,
scores are ``Σ_{r,s} A_Q[r,i] A_K[s,i] P[r,s]`` and outputs are ``Σ_s α_s A_V^T B_V``; K and V are never
materialised. ``TPAAttention.attention_plan`` picks, per call, the cheapest score route and value route
(``tpa_decode_path="auto"``); ``"factor"`` forces factor space, ``"materialize"`` forces eager/SDPA.

This file is copied next to saved checkpoints for ``trust_remote_code`` loading: it imports only
torch, transformers and its sibling ``configuration_tpa``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_tpa import TPAConfig


# ----------------------------------------------------------------------------------------------
# The KV cache's name: transformers 5.24 renamed the argument and output field `past_key_values` to
# `cache`. Models here take either as an argument, and write their output under the installed name.
# ----------------------------------------------------------------------------------------------
def cache_field() -> str:
    """The name of the KV cache field of the installed transformers' model outputs."""
    return "cache" if any(f.name == "cache" for f in dataclasses.fields(BaseModelOutputWithPast)) else "past_key_values"


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------
class TPACacheLayer(DynamicLayer):
    """One layer of a factorised KV cache.

    Token-major tensors (sequence on dim 1, so ``[B, S*R, d]`` views are free):

    * ``keys``    – pre-rotated ``B_K``: ``[batch, seq, R_K, d_h]``
    * ``values``  – ``B_V``: ``[batch, seq, R_V, d_h]``
    * ``key_a``   – ``A_K``: ``[batch, seq, R_K, h]`` (contextual) or ``[R_K, h]`` stored once
    * ``value_a`` – ``A_V``: ``[batch, seq, R_V, h]`` (contextual) or ``[R_V, h]`` stored once
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.key_a: torch.Tensor | None = None
        self.value_a: torch.Tensor | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _per_token_names(self) -> list[str]:
        names = ["keys", "values"]
        for name in ("key_a", "value_a"):
            t = getattr(self, name)
            if t is not None and t.dim() == 4:
                names.append(name)
        return names

    def per_token_tensors(self) -> list[torch.Tensor]:
        """The tensors that grow with the sequence (for memory accounting)."""
        if not self.is_initialized or self.keys is None:
            return []
        return [getattr(self, n) for n in self._per_token_names()]

    def constant_tensors(self) -> list[torch.Tensor]:
        """Tensors stored once per layer (non-contextual A factors)."""
        return [t for t in (self.key_a, self.value_a) if t is not None and t.dim() == 2]

    def _apply(self, fn) -> None:
        if self.get_seq_length() > 0:
            for name in self._per_token_names():
                setattr(self, name, fn(getattr(self, name)))

    # -- CacheLayerMixin API -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.values = None
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        key_a: torch.Tensor | None = None,
        value_a: torch.Tensor | None = None,
        **kwargs,
    ):
        """Append the new tokens' factors. ``key_states``/``value_states`` are ``B_K`` (rotated) and ``B_V``
        ``[B, T, R, d_h]``; ``key_a``/``value_a`` are per-token ``[B, T, R, h]`` or constant ``[R, h]``.
        Returns the full ``(B_K, B_V)``; the A factors are in ``key_a``/``value_a``."""
        if key_a is None or value_a is None:
            raise ValueError("TPACacheLayer.update needs the A factors (key_a=..., value_a=...)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.keys is None
        self.keys = key_states if first else torch.cat([self.keys, key_states], dim=1)
        self.values = value_states if first else torch.cat([self.values, value_states], dim=1)
        for name, new in (("key_a", key_a), ("value_a", value_a)):
            if new.dim() == 2:  # non-contextual: stored once
                setattr(self, name, new)
            else:
                old = getattr(self, name)
                setattr(self, name, new if first or old is None else torch.cat([old, new], dim=1))
        return self.keys, self.values

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A_K, B_K, A_V, B_V)`` for the whole cached sequence."""
        return self.key_a, self.keys, self.value_a, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.shape[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.key_a = self.value_a = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.get_seq_length() == 0:
            return
        n = abs(tokens_to_remove)
        self._apply(lambda t: t[:, :-n])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self):
        if self.get_seq_length() > 0:
            self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.get_seq_length() > 0 and self.keys.device != self.device:
            self._apply(lambda t: t.to(self.device, non_blocking=True))


class TPACache(Cache):
    """A dynamic cache of TPA factors (one :class:`TPACacheLayer` per decoder layer)."""

    def __init__(self, config: TPAConfig | None = None, num_layers: int | None = None, **kwargs):
        if config is not None:
            num_layers = config.get_text_config(decoder=True).num_hidden_layers
        if num_layers is not None:
            super().__init__(layers=[TPACacheLayer() for _ in range(num_layers)], **kwargs)
        else:
            super().__init__(layer_class_to_replicate=TPACacheLayer, **kwargs)

    def update_factors(self, layer_idx: int, a_k, b_k, a_v, b_v):
        """Append new factors for ``layer_idx`` and return the cached ``(A_K, B_K, A_V, B_V)``."""
        self.update(b_k, b_v, layer_idx, key_a=a_k, value_a=a_v)
        return self.layers[layer_idx].factors()

    def cached_elements(self) -> dict[str, int]:
        """Element counts actually held: ``per_token`` (tensors that grow with the sequence, all
        layers and batch rows) and ``constant`` (non-contextual A factors, stored once per layer)."""
        per_token = sum(t.numel() for layer in self.layers for t in layer.per_token_tensors())
        constant = sum(t.numel() for layer in self.layers for t in layer.constant_tensors())
        return {"per_token": per_token, "constant": constant}

    def cached_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in layer.per_token_tensors() + layer.constant_tensors()
        )


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------
# Copied from transformers.models.llama.modeling_llama.LlamaRMSNorm
class TPARMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class TPARotaryEmbedding(nn.Module):
    """cos/sin tables from ``config.rope_parameters`` through transformers' ``ROPE_INIT_FUNCTIONS``."""

    def __init__(self, config: TPAConfig, device=None):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: TPAConfig, device=None, seq_len=None, **kwargs):
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        inv_freq = 1.0 / (base**exponents)
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


# Copied from transformers.models.llama.modeling_llama.rotate_half
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF convention: pairs ``(i, i + d/2)``."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, T, N, d]`` (N = heads or ranks) with ``cos``/``sin`` ``[B|1, T, rot]``;
    a rotary dim below d rotates the first ``rot`` dims only (partial rotary)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


class TPAFactorLinear(nn.Linear):
    """A projection producing R stacked factors of width ``factor_dim`` (A: h, B: d_h). Initialised
    with Xavier-uniform per rank (fan_in = d_model, fan_out = factor_dim) as in the paper."""

    def __init__(self, in_features: int, rank: int, factor_dim: int, bias: bool = False):
        super().__init__(in_features, rank * factor_dim, bias=bias)
        self.rank, self.factor_dim = rank, factor_dim


class TPAMLP(nn.Module):
    def __init__(self, config: TPAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax in float32 for half precisions, in the input precision otherwise (float64 stays exact)."""
    return torch.promote_types(dtype, torch.float32)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=_softmax_dtype(query.dtype)).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


def _compose(a: torch.Tensor, b: torch.Tensor, rank: int) -> torch.Tensor:
    """``(1/R) A^T B`` per token: ``a`` ``[B,T,R,h]`` or ``[R,h]``, ``b`` ``[B,T,R,d]`` -> ``[B,h,T,d]``."""
    if a.dim() == 2:
        out = torch.einsum("rh,btrd->bhtd", a, b)
    else:
        out = torch.einsum("btrh,btrd->bhtd", a, b)
    return out / rank


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
class TPAAttention(nn.Module):
    """Tensor Product Attention with a factorised cache and a factor-space decoding path."""

    def __init__(self, config: TPAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.q_rank, self.k_rank, self.v_rank = config.q_rank, config.k_rank, config.v_rank
        self.contextual_a = config.contextual_a
        self.num_key_value_groups = 1  # K/V are materialised per head (used by HF's attention functions)
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        d, h, dh = config.hidden_size, self.num_heads, self.head_dim

        if self.q_rank is None:  # TPA-KV-only
            self.q_proj = nn.Linear(d, h * dh, bias=config.attention_bias)
        else:
            self.q_b_proj = TPAFactorLinear(d, self.q_rank, dh, bias=config.attention_bias)
        self.k_b_proj = TPAFactorLinear(d, self.k_rank, dh, bias=config.attention_bias)
        self.v_b_proj = TPAFactorLinear(d, self.v_rank, dh, bias=config.attention_bias)
        for name, rank in (("q", self.q_rank), ("k", self.k_rank), ("v", self.v_rank)):
            if rank is None:
                continue
            if self.contextual_a:
                setattr(self, f"{name}_a_proj", TPAFactorLinear(d, rank, h, bias=False))
            else:
                setattr(self, f"{name}_a", nn.Parameter(torch.empty(rank, h)))
        self.o_proj = nn.Linear(h * dh, d, bias=config.attention_out_bias)
        if config.qk_norm:  # Qwen3's per-head QK-norm, on the query heads and the key factors
            self.q_norm = TPARMSNorm(dh, eps=config.rms_norm_eps)
            self.k_norm = TPARMSNorm(dh, eps=config.rms_norm_eps)

    def _qk_normed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``[..., d_h]``: query heads or Q/K token factors) through the QK-norm, if any."""
        return getattr(self, f"{name}_norm")(t) if self.config.qk_norm else t

    # -- factors ---------------------------------------------------------------------------------
    def _a(self, name: str, x: torch.Tensor, rank: int) -> torch.Tensor:
        if self.contextual_a:
            return getattr(self, f"{name}_a_proj")(x).view(*x.shape[:-1], rank, self.num_heads)
        return getattr(self, f"{name}_a")

    def compute_factors(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict:
        """Factors of the current tokens (B's of Q and K rotated). Keys: ``q`` (KV-only: rotated
        ``[B,T,h,d_h]``) or ``a_q``/``b_q``; ``a_k``, ``b_k``, ``a_v``, ``b_v``."""
        B, T, _ = x.shape
        out = {}
        if self.q_rank is None:
            q = self._qk_normed("q", self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
            out["q"] = apply_rotary(q, cos, sin)
        else:
            out["a_q"] = self._a("q", x, self.q_rank)
            b_q = self._qk_normed("q", self.q_b_proj(x).view(B, T, self.q_rank, self.head_dim))
            out["b_q"] = apply_rotary(b_q, cos, sin)
        out["a_k"] = self._a("k", x, self.k_rank)
        b_k = self._qk_normed("k", self.k_b_proj(x).view(B, T, self.k_rank, self.head_dim))
        out["b_k"] = apply_rotary(b_k, cos, sin)
        out["a_v"] = self._a("v", x, self.v_rank)
        out["b_v"] = self.v_b_proj(x).view(B, T, self.v_rank, self.head_dim)
        return out

    # -- path selection ----------------------------------------------------------------------------
    def _score_routes(self, T: int, S: int) -> tuple[float, float]:
        """Multiply-add estimates of the two factor-space score routes: via the full query
        (``q · B_K`` then ``A_K``) and via ``P = B_Q B_K^T`` (then ``A_Q``, ``A_K``)."""
        h, dh, rk, rq = self.num_heads, self.head_dim, self.k_rank, self.q_rank
        via_q = T * h * rk * S * (dh + 1) + (T * h * rq * dh if rq else 0)
        via_p = math.inf if rq is None else T * rq * rk * S * dh + T * h * rq * rk * S + T * h * rk * S
        return via_q, via_p

    # Contractions with a small inner dimension (R or 1: composing Q/K/V from factors, weighting by A)
    # run far below matrix-multiply throughput; measured on one CPU core, 30-100x per multiply-add.
    # Route costs count them with this weight, so "auto" follows wall time rather than raw FLOPs.
    non_gemm_weight: float = 32.0

    def route_costs(self, T: int, S: int) -> dict[str, float]:
        """Cost estimates of every route for ``T`` new tokens against ``S`` keys: matrix-multiply
        multiply-adds plus ``non_gemm_weight`` times the small-inner-dimension ones.

        Scores: ``"p"`` (``P = B_Q B_K^T``, shared by all heads, then ``A_Q``, ``A_K``), ``"q"`` (composed
        query against ``B_K``, then ``A_K``), ``"k"`` (compose K, then ``q K^T``). Values: ``"factor"``
        (``Σ_s α A_V^T B_V`` without forming V) or ``"v"`` (compose V, then ``α V``)."""
        h, dh, rk, rv, rq = self.num_heads, self.head_dim, self.k_rank, self.v_rank, self.q_rank
        w = self.non_gemm_weight
        compose_q = w * T * h * rq * dh if rq else 0.0
        p = math.inf if rq is None else T * rq * rk * S * dh + w * T * S * h * rk * (rq + 1)
        return {
            "p": p,
            "q": compose_q + T * h * S * rk * dh + w * T * h * S * rk,
            "k": compose_q + w * S * h * rk * dh + T * S * h * dh,
            "factor": T * h * S * rv * dh + w * T * h * S * rv,
            "v": w * S * h * rv * dh + T * S * h * dh,
        }

    def attention_plan(self, T: int, S: int) -> tuple[str, str]:
        """``(score route, value route)`` for ``T`` new tokens against ``S`` keys (see :meth:`route_costs`).

        ``tpa_decode_path="materialize"``: ``("k", "v")``, i.e. form Q/K/V and call eager/SDPA attention.
        ``"factor"``: never form K or V (``"p"``/``"q"`` and ``"factor"``). ``"auto"``: the cheapest route
        for each part; decoding (small T) then runs in factor space, and prefill/training computes its
        scores from ``P = B_Q B_K^T`` when the heads outnumber ``R_Q R_K`` enough to pay for it (the
        paper's T6 shapes), otherwise it materialises."""
        mode = self.config.tpa_decode_path
        if mode == "materialize":
            return "k", "v"
        cost = self.route_costs(T, S)
        scores = ("p", "q") if mode == "factor" else ("p", "q", "k")
        values = ("factor",) if mode == "factor" else ("factor", "v")
        return min(scores, key=cost.__getitem__), min(values, key=cost.__getitem__)

    def use_factor_path(self, T: int, S: int) -> bool:
        """Whether any part of the attention of ``T`` tokens against ``S`` keys runs from the factors."""
        return self.attention_plan(T, S) != ("k", "v")

    # -- attention ---------------------------------------------------------------------------------
    def materialized_attention(self, f: dict, a_k, b_k, a_v, b_v, attention_mask, output_attentions=False):
        q = f["q"].transpose(1, 2) if self.q_rank is None else _compose(f["a_q"], f["b_q"], self.q_rank)
        k = _compose(a_k, b_k, self.k_rank)
        v = _compose(a_v, b_v, self.v_rank)
        impl = self.config._attn_implementation
        if output_attentions or impl in (None, "eager"):
            attention_interface = eager_attention_forward
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        return attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )

    def factor_attention(
        self,
        f: dict,
        a_k,
        b_k,
        a_v,
        b_v,
        attention_mask,
        output_attentions=False,
        route: str | None = None,
        value_route: str = "factor",
    ):
        """Attention from the factors. Shapes: ``b_k [B,S,R_K,d]``, ``a_k [B,S,R_K,h]`` or ``[R_K,h]``
        (same for V). ``route`` picks the score route: ``"p"`` (via ``P = B_Q B_K^T``, never forming Q or K),
        ``"q"`` (composed query against ``B_K``, never forming K) or ``"k"`` (composed K); default: the
        cheaper of ``"p"``/``"q"``. ``value_route`` ``"factor"`` never forms V; ``"v"`` composes V first
        (cheaper for prefill and training). Every route is differentiable (training uses them).
        Returns ``([B,T,h,d], probs or None)``."""
        h, dh, rk, rv = self.num_heads, self.head_dim, self.k_rank, self.v_rank
        B, S = b_k.shape[0], b_k.shape[1]
        if route is None:
            via_q, via_p = self._score_routes(f.get("b_q", f.get("q")).shape[1], S)
            route = "p" if via_p <= via_q else "q"
        if route == "k":
            q = f["q"].transpose(1, 2) if self.q_rank is None else _compose(f["a_q"], f["b_q"], self.q_rank)
            T = q.shape[2]
            scores = torch.matmul(q, _compose(a_k, b_k, rk).transpose(2, 3)) * self.scaling
        elif self.q_rank is not None and route == "p":
            b_q, a_q = f["b_q"], f["a_q"]
            T, rq = b_q.shape[1], self.q_rank
            # P[b,t,r,(s,u)] = B_Q[b,t,r] · B_K[b,s,u]: shared by every head
            P = torch.matmul(b_q.reshape(B, T * rq, dh), b_k.reshape(B, S * rk, dh).transpose(1, 2))
            P = P.view(B, T, rq, S * rk)
            aq = a_q.transpose(-1, -2)  # [B,T,h,R_Q] or [h,R_Q]
            X = torch.matmul(aq, P).view(B, T, h, S, rk)  # Σ_r A_Q[r,i] P[r,(s,u)]
            if a_k.dim() == 2:
                scores = torch.matmul(X, a_k.t().reshape(1, 1, h, rk, 1)).squeeze(-1)
            else:
                scores = (X * a_k.permute(0, 3, 1, 2).unsqueeze(1)).sum(-1)
            scores = scores.transpose(1, 2) * (self.scaling / (rq * rk))  # [B,h,T,S]
        else:
            q = f["q"] if self.q_rank is None else _compose(f["a_q"], f["b_q"], self.q_rank).transpose(1, 2)
            T = q.shape[1]
            qh = q.transpose(1, 2)  # [B,h,T,d]
            if a_k.dim() == 2:
                # scores = Σ_u A_K[u,i] q_i · B_K[s,u] as one matmul over the (u, d) pair
                qa = (qh.unsqueeze(3) * a_k.t().reshape(1, h, 1, rk, 1)).reshape(B, h * T, rk * dh)
                scores = torch.matmul(qa, b_k.reshape(B, S, rk * dh).transpose(1, 2)).view(B, h, T, S)
            else:
                qb = torch.matmul(qh.reshape(B, h * T, dh), b_k.reshape(B, S * rk, dh).transpose(1, 2))
                scores = (qb.view(B, h, T, S, rk) * a_k.permute(0, 3, 1, 2).unsqueeze(2)).sum(-1)
            scores = scores * (self.scaling / rk)

        scores = scores.to(_softmax_dtype(scores.dtype))
        if attention_mask is None:
            if T > 1:  # plain causal, lower-right aligned
                keep = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril(S - T)
                scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        elif attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask.to(scores.dtype)
        probs = F.softmax(scores, dim=-1).to(b_v.dtype)
        probs = F.dropout(probs, p=self.attention_dropout if self.training else 0.0, training=self.training)

        if value_route == "v":
            out = torch.matmul(probs, _compose(a_v, b_v, rv)).transpose(1, 2).contiguous()
            return out, (probs if output_attentions else None)
        if a_v.dim() == 2:
            # out_i = Σ_u A_V[u,i] (α_i · B_V[:,u])
            Y = torch.matmul(probs.reshape(B, h * T, S), b_v.reshape(B, S, rv * dh)).view(B, h, T, rv, dh)
            out = torch.matmul(a_v.t().reshape(1, h, 1, 1, rv), Y).squeeze(3)
        else:
            W = probs.unsqueeze(-1) * a_v.permute(0, 3, 1, 2).unsqueeze(2)  # [B,h,T,S,R_V]
            out = torch.matmul(W.reshape(B, h * T, S * rv), b_v.reshape(B, S * rv, dh)).view(B, h, T, dh)
        out = (out / rv).transpose(1, 2).contiguous()
        return out, (probs if output_attentions else None)

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, cache=None, output_attentions=False, **kwargs
    ):
        B, T, _ = hidden_states.shape
        cos, sin = position_embeddings
        f = self.compute_factors(hidden_states, cos, sin)
        a_k, b_k, a_v, b_v = f["a_k"], f["b_k"], f["a_v"], f["b_v"]
        if cache is not None:
            a_k, b_k, a_v, b_v = cache.update_factors(self.layer_idx, a_k, b_k, a_v, b_v)
        score_route, value_route = self.attention_plan(T, b_k.shape[1])
        if (score_route, value_route) != ("k", "v"):
            out, weights = self.factor_attention(
                f, a_k, b_k, a_v, b_v, attention_mask, output_attentions, route=score_route, value_route=value_route
            )
        else:
            out, weights = self.materialized_attention(f, a_k, b_k, a_v, b_v, attention_mask, output_attentions)
        out = self.o_proj(out.reshape(B, T, -1).contiguous())
        return out, weights


class TPADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: TPAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TPAAttention(config, layer_idx)
        self.mlp = TPAMLP(config)
        self.input_layernorm = TPARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TPARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_embeddings=None,
        cache=None,
        use_cache=False,
        output_attentions=False,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            output_attentions=output_attentions,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, attn_weights


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------
class TPAPreTrainedModel(PreTrainedModel):
    config_class = TPAConfig
    config: TPAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TPADecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module):
        """Paper initialisation for the factor projections: Xavier-uniform per rank
        (bound ``sqrt(6 / (d_model + factor_dim))``); non-contextual A ~ N(0, 1) (so ``A^T B`` has the
        scale of the contextual case); everything else as in Llama."""
        if isinstance(module, TPAFactorLinear):
            bound = math.sqrt(6.0 / (module.in_features + module.factor_dim))
            init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, TPAAttention):
            for name in ("q_a", "k_a", "v_a"):
                param = getattr(module, name, None)
                if isinstance(param, nn.Parameter):
                    init.normal_(param, mean=0.0, std=1.0)
        elif isinstance(module, TPARMSNorm):
            init.ones_(module.weight)
        else:
            super()._init_weights(module)


class TPAModel(TPAPreTrainedModel):
    def __init__(self, config: TPAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([TPADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = TPARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = TPARotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _as_tpa_cache(self, cache):
        """``cache`` as a :class:`TPACache`. ``generate`` hands the model an empty generic cache
        (a ``DynamicCache``) unless it was given one: that one is swapped for the factorised cache here, and
        the model's output carries the swap back to ``generate``."""
        if cache is None or isinstance(cache, TPACache):
            return cache
        if (
            isinstance(cache, Cache)
            and cache.get_seq_length() == 0
            and all(isinstance(layer, DynamicLayer) for layer in cache.layers)
        ):
            return TPACache(config=self.config)  # an empty generic cache: swap in the factorised one
        raise ValueError(f"TPA models need a TPACache (factorised KV cache), got {type(cache).__name__}")

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        past_key_values=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values  # the name before transformers 5.24
        cfg = self.config
        output_attentions = output_attentions if output_attentions is not None else cfg.output_attentions
        output_hidden_states = output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states
        use_cache = use_cache if use_cache is not None else cfg.use_cache
        return_dict = return_dict if return_dict is not None else cfg.return_dict
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = TPACache(config=cfg)
        cache = self._as_tpa_cache(cache)

        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)

        # positional: the cache argument's keyword is `cache` from transformers 5.24, `past_key_values` before
        causal_mask = create_causal_mask(cfg, inputs_embeds, attention_mask, cache, position_ids)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden, all_attn = (), ()
        for layer in self.layers[: cfg.num_hidden_layers]:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            hidden_states, attn = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                cache=cache,
                use_cache=use_cache,
                output_attentions=output_attentions,
            )
            if output_attentions:
                all_attn += (attn,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden += (hidden_states,)
        out = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            **{cache_field(): cache if use_cache else None},
            hidden_states=all_hidden or None,
            attentions=all_attn or None,
        )
        return out if return_dict else out.to_tuple()


class TPAForCausalLM(TPAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TPAConfig):
        super().__init__(config)
        self.model = TPAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        **kwargs,
    ):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{cache_field(): getattr(outputs, cache_field())},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out if return_dict else out.to_tuple()


# ----------------------------------------------------------------------------------------------
# Checkpoint names, for converters (hf_symmetry's to-tpa writes through these and spells no path itself)
# ----------------------------------------------------------------------------------------------
#: layer ``i``'s tensors are named ``LAYER_PREFIX.format(i) + module + ".weight"`` (or ``".bias"``)
LAYER_PREFIX = "model.layers.{}."
#: hf_symmetry's canonical module names (``q o gate up down attn_norm ffn_norm q_norm k_norm``) -> module
#: inside a TPA decoder layer that holds the same tensor
LAYER_MODULES = {
    "q": "self_attn.q_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}
#: the factors of keys and values: (non-contextual A parameter, B projection module)
FACTORS = {"k": ("self_attn.k_a", "self_attn.k_b_proj"), "v": ("self_attn.v_a", "self_attn.v_b_proj")}
#: canonical global names -> module
GLOBAL_MODULES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}


TPAModel.register_for_auto_class("AutoModel")
TPAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["TPACache", "TPACacheLayer", "TPAForCausalLM", "TPAModel", "TPAPreTrainedModel"]
