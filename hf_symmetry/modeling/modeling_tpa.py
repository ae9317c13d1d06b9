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

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import capture_outputs

from .cache_tpa import (
    TPACache,
    TPACacheLayer,
    TPAQuantizedCache,
    TPAQuantizedLayer,
    TPAStaticCache,
    TPAStaticLayer,
    as_factor_cache,
)
from .configuration_tpa import TPAConfig


# ----------------------------------------------------------------------------------------------
# The KV cache's name: transformers 5.24 renamed the argument and output field `past_key_values` to
# `cache`. Models here take either as an argument, and write their output under the installed name.
# ----------------------------------------------------------------------------------------------
def cache_field() -> str:
    """The name of the KV cache field of the installed transformers' model outputs."""
    return "cache" if any(f.name == "cache" for f in dataclasses.fields(BaseModelOutputWithPast)) else "past_key_values"


#: the installed transformers' cache field name, read once (``dataclasses.fields`` cannot run under dynamo)
CACHE_FIELD = cache_field()


# Copied from hf_symmetry.modeling.modeling_compressed_llama.renamed_cache_kwarg
def renamed_cache_kwarg(forward):
    """``forward`` taking the KV cache as ``cache`` or ``past_key_values``: where the installed transformers
    names it ``cache`` (5.24 and later) the old name is deprecated as in its own models (a warning), before
    that it is the name ``generate`` passes (no warning)."""
    if CACHE_FIELD != "cache":
        return forward
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)


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
    """Rotate ``x`` of shape ``[B, N, T, d]`` (N = heads or factors, as transformers lays out heads) with
    ``cos``/``sin`` ``[B|1, T, rot]``; a rotary dim below d rotates the first ``rot`` dims only (partial rotary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
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
    if key.shape[1] != query.shape[1]:  # grouped keys/values (GQA): each serves a block of query heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=_softmax_dtype(query.dtype)).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


def _compose(a: torch.Tensor, b: torch.Tensor, rank: int) -> torch.Tensor:
    """``(1/R) A^T B`` per token: ``a`` ``[B,R,T,h]`` or ``[R,h]``, ``b`` ``[B,R,T,d]`` -> ``[B,h,T,d]``."""
    if a.dim() == 2:
        out = torch.einsum("rh,brtd->bhtd", a, b)
    else:
        out = torch.einsum("brth,brtd->bhtd", a, b)
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
        # query heads per K/V head, read by transformers' attention functions: 1 (K/V composed per head), except
        # during a grouped call (:meth:`grouped_attention`)
        self.num_key_value_groups = 1
        self._groups_key, self._groups, self._unit_scales = None, False, False
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
            B, T, _ = x.shape
            return getattr(self, f"{name}_a_proj")(x).view(B, T, rank, self.num_heads).transpose(1, 2)
        return getattr(self, f"{name}_a")

    def _b(self, proj: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
        """``proj(x)`` as ``n`` rows of ``d_h`` per token, factor-major: ``[B, n, T, d_h]`` (a view)."""
        B, T, _ = x.shape
        return proj(x).view(B, T, n, self.head_dim).transpose(1, 2)

    def compute_factors(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict:
        """Factors of the current tokens (B's of Q and K rotated), factor-major as transformers lays out heads
        (factor, then token): ``q`` (KV-only: rotated queries ``[B,h,T,d_h]``) or ``a_q``/``b_q``; ``a_k``,
        ``b_k``, ``a_v``, ``b_v``. B factors are ``[B,R,T,d_h]``; A factors ``[B,R,T,h]`` (contextual) or the
        ``[R,h]`` parameter."""
        out = {}
        if self.q_rank is None:
            q = self._qk_normed("q", self._b(self.q_proj, x, self.num_heads))
            out["q"] = apply_rotary(q, cos, sin)
        else:
            out["a_q"] = self._a("q", x, self.q_rank)
            b_q = self._qk_normed("q", self._b(self.q_b_proj, x, self.q_rank))
            out["b_q"] = apply_rotary(b_q, cos, sin)
        out["a_k"] = self._a("k", x, self.k_rank)
        out["b_k"] = apply_rotary(self._qk_normed("k", self._b(self.k_b_proj, x, self.k_rank)), cos, sin)
        out["a_v"] = self._a("v", x, self.v_rank)
        out["b_v"] = self._b(self.v_b_proj, x, self.v_rank)
        return out

    def _queries(self, f: dict) -> torch.Tensor:
        """The composed queries ``[B,h,T,d_h]``."""
        return f["q"] if self.q_rank is None else _compose(f["a_q"], f["b_q"], self.q_rank)

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
    def head_chunk(self) -> int:
        """Query heads per call of the attention function when K/V are composed (:meth:`materialized_attention`):
        ``R_K`` (at most all heads), so that the K and V composed for one call hold no more elements per token
        than the cached factors they come from. Composing all heads at once would hold ``h/R_K`` times more
        (three times for a converted 9-head, 3-KV-head model): transient, but in a CPU process that memory
        stays with the heap as fragments (measured: peak decode RSS twice the source model's)."""
        return max(1, min(self.num_heads, self.k_rank))

    def _attention_interface(self, output_attentions: bool):
        impl = self.config._attn_implementation
        if output_attentions or impl in (None, "eager"):
            return eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)

    def factor_groups(self) -> bool:
        """Whether the (non-contextual) A factors are a grouping of the heads: ``R_K = R_V = R`` dividing ``h``,
        and column ``i`` of both ``A_K`` and ``A_V`` nonzero only in row ``i // (h/R)``. Then head ``i``'s key
        is ``(A_K[g,i]/R) B_K[g]`` (likewise V): GQA with the factors as the K/V heads, which
        :meth:`grouped_attention` runs without composing K or V (a converted GQA model at full rank, any model
        at rank 1). Checked on the values (one host sync, cached until A changes; while tracing, e.g.
        ``torch.compile``, the last eager check is used), never when gradients flow into A (the zeros of A
        have gradients too). Only with ``tpa_decode_path="auto"``."""
        if self.contextual_a or self.k_rank != self.v_rank or self.num_heads % self.k_rank:
            return False
        if self.config.tpa_decode_path != "auto":
            return False
        a_k, a_v = self.k_a, self.v_a
        if torch.is_grad_enabled() and (a_k.requires_grad or a_v.requires_grad):
            return False
        if torch.compiler.is_compiling():
            return self._groups if self._groups_key is not None else False
        key = (a_k.data_ptr(), a_k._version, a_v.data_ptr(), a_v._version)
        if self._groups_key != key:
            h, r = self.num_heads, self.k_rank
            heads = torch.arange(h, device=a_k.device)
            owner = torch.zeros(r, h, dtype=torch.bool, device=a_k.device)
            owner[heads // (h // r), heads] = True
            self._groups = bool(((a_k != 0) == owner).all() and ((a_v != 0) == owner).all())
            # a converted GQA model: A = R on its grouping, so every scale of grouped_attention is 1
            self._unit_scales = self._groups and bool((a_k[owner] == r).all() and (a_v[owner] == r).all())
            self._groups_key = key
        return self._groups

    def grouped_attention(self, f: dict, a_k, b_k, a_v, b_v, attention_mask, output_attentions=False, **kwargs):
        """Attention when :meth:`factor_groups` holds: the cached ``B_K``/``B_V`` are the K/V heads of a GQA call
        of the attention function (eager, SDPA or a registered backend), each query head scaled by its
        ``A_K[g,i]/R`` and each output head by its ``A_V[g,i]/R``. No K or V is composed: the same work and
        memory as the GQA model it came from. A single new token (decoding) with eager/SDPA attention and a mask
        shared by the heads runs as ``R`` heads of ``h/R`` query rows each (the queries of a group packed, as
        transformers' SDPA does for GQA decoding). Returns ``([B,T,h,d], weights or None)``."""
        h, r = self.num_heads, self.k_rank
        q = self._queries(f)
        if not self._unit_scales:
            heads = torch.arange(h, device=a_k.device)
            k_scale, v_scale = a_k[heads // (h // r), heads] / r, a_v[heads // (h // r), heads] / r
            q = q * k_scale.to(q.dtype).view(1, h, 1, 1)
        B, T = q.shape[0], q.shape[2]
        dropout = 0.0 if not self.training else self.attention_dropout
        mask = attention_mask
        packed = (
            T == 1
            and not self.uses_attention_function()
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1))
        )
        if packed:  # [B, R, h/R, d] queries against [B, R, S, d] factors; every row may see every cached slot
            out, weights = self._attention_interface(output_attentions)(
                self,
                q.reshape(B, r, h // r, q.shape[-1]),
                b_k,
                b_v,
                mask,
                dropout=dropout,
                scaling=self.scaling,
                is_causal=False,
                **kwargs,
            )
            out = out.reshape(B, h // r, r, -1).transpose(1, 2).reshape(B, 1, h, -1)
            weights = None if weights is None else weights.reshape(B, h, 1, -1)
        else:
            self.num_key_value_groups = h // r
            try:
                out, weights = self._attention_interface(output_attentions)(
                    self,
                    q,
                    b_k,
                    b_v,
                    mask,
                    dropout=dropout,
                    scaling=self.scaling,
                    **kwargs,
                )
            finally:
                self.num_key_value_groups = 1
        return (out if self._unit_scales else out * v_scale.to(out.dtype).view(1, 1, h, 1)), weights

    def materialized_attention(self, f: dict, a_k, b_k, a_v, b_v, attention_mask, output_attentions=False, **kwargs):
        """Compose Q, K, V and call the configured attention function (eager, SDPA or a registered backend),
        :meth:`head_chunk` query heads at a time (each call composes only its heads' K and V).
        Returns ``([B,T,h,d], weights or None)``."""
        q = self._queries(f)
        attention_interface = self._attention_interface(output_attentions)
        dropout = 0.0 if not self.training else self.attention_dropout
        h, step = self.num_heads, self.head_chunk()
        outs, weights = [], []
        for i in range(0, h, step):
            heads = slice(i, min(i + step, h))
            mask = attention_mask
            if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == h and h > 1:
                mask = mask[:, heads]
            out, w = attention_interface(
                self,
                q[:, heads],
                _compose(a_k[..., heads], b_k, self.k_rank),
                _compose(a_v[..., heads], b_v, self.v_rank),
                mask,
                dropout=dropout,
                scaling=self.scaling,
                **kwargs,
            )
            outs.append(out)
            weights.append(w)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        if weights[0] is None:
            return out, None
        return out, weights[0] if len(weights) == 1 else torch.cat(weights, dim=1)

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
        """Attention from the factors. Shapes: ``b_k [B,R_K,S,d]``, ``a_k [B,R_K,S,h]`` or ``[R_K,h]`` (same for
        V). ``route`` picks the score route: ``"p"`` (via ``P = B_Q B_K^T``, never forming Q or K), ``"q"``
        (composed query against each ``B_K`` factor, weighted by ``A_K``, never forming K) or ``"k"`` (composed K);
        default: the cheaper of ``"p"``/``"q"``. ``value_route`` ``"factor"`` never forms V; ``"v"`` composes V
        first (cheaper for prefill and training). Every route is differentiable (training uses them).
        Returns ``([B,T,h,d], probs or None)``."""
        h, dh, rk, rv = self.num_heads, self.head_dim, self.k_rank, self.v_rank
        B, S = b_k.shape[0], b_k.shape[2]
        if route is None:
            via_q, via_p = self._score_routes(f.get("b_q", f.get("q")).shape[2], S)
            route = "p" if via_p <= via_q else "q"
        if route == "k":
            q = self._queries(f)
            T = q.shape[2]
            scores = torch.matmul(q, _compose(a_k, b_k, rk).transpose(2, 3)) * self.scaling
        elif self.q_rank is not None and route == "p":
            b_q, a_q = f["b_q"], f["a_q"]
            T, rq = b_q.shape[2], self.q_rank
            # P[b,t,r,(u,s)] = B_Q[b,r,t] · B_K[b,u,s]: shared by every head
            P = torch.matmul(b_q.transpose(1, 2).reshape(B, T * rq, dh), b_k.reshape(B, rk * S, dh).transpose(1, 2))
            aq = a_q.t() if a_q.dim() == 2 else a_q.permute(0, 2, 3, 1)  # [h,R_Q] or [B,T,h,R_Q]
            X = torch.matmul(aq, P.view(B, T, rq, rk * S)).view(B, T, h, rk, S)  # Σ_r A_Q[r,i] P[r,(u,s)]
            if a_k.dim() == 2:
                scores = torch.matmul(a_k.t().reshape(1, 1, h, 1, rk), X).squeeze(-2)
            else:
                scores = (X * a_k.permute(0, 3, 1, 2).unsqueeze(1)).sum(3)
            scores = scores.transpose(1, 2) * (self.scaling / (rq * rk))  # [B,h,T,S]
        else:
            q = self._queries(f)  # [B,h,T,d]
            T = q.shape[2]
            if a_k.dim() == 2:
                # scores = Σ_u A_K[u,i] q_i · B_K[u]: one matmul per factor, over all heads at once
                qa = (q.unsqueeze(1) * a_k.view(1, rk, h, 1, 1)).reshape(B, rk, h * T, dh)
                scores = torch.matmul(qa, b_k.transpose(-1, -2)).sum(1).view(B, h, T, S)
            else:
                qb = torch.matmul(q.reshape(B, h * T, dh), b_k.reshape(B, rk * S, dh).transpose(1, 2))
                scores = (qb.view(B, h, T, rk, S) * a_k.permute(0, 3, 1, 2).unsqueeze(2)).sum(3)
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
            # out_i = Σ_u A_V[u,i] (α_i · B_V[u]): one matmul per factor, over all heads at once
            Y = torch.matmul(probs.reshape(B, 1, h * T, S), b_v).view(B, rv, h, T, dh)
            out = (Y * a_v.view(1, rv, h, 1, 1)).sum(1)
        else:
            W = probs.unsqueeze(3) * a_v.permute(0, 3, 1, 2).unsqueeze(2)  # [B,h,T,R_V,S]
            out = torch.matmul(W.reshape(B, h * T, rv * S), b_v.reshape(B, rv * S, dh)).view(B, h, T, dh)
        out = (out / rv).transpose(1, 2).contiguous()
        return out, (probs if output_attentions else None)

    def uses_attention_function(self) -> bool:
        """Whether every route must go through the configured attention function: a registered backend other
        than eager/SDPA takes masks in its own format, which only it reads (the factor-space routes read
        tensor masks)."""
        return self.config._attn_implementation not in (None, "eager", "sdpa")

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        B, T, _ = hidden_states.shape
        output_attentions = bool(kwargs.pop("output_attentions", False))
        cos, sin = position_embeddings
        f = self.compute_factors(hidden_states, cos, sin)
        a_k, b_k, a_v, b_v = f["a_k"], f["b_k"], f["a_v"], f["b_v"]
        if cache is not None:
            a_k, b_k, a_v, b_v = cache.layers[self.layer_idx].update_factors(a_k, b_k, a_v, b_v)
        plan = ("k", "v") if self.uses_attention_function() else self.attention_plan(T, b_k.shape[2])
        if self.factor_groups():  # GQA on the factors, prefill and decoding alike
            out, weights = self.grouped_attention(f, a_k, b_k, a_v, b_v, attention_mask, output_attentions, **kwargs)
        elif plan != ("k", "v"):
            out, weights = self.factor_attention(
                f, a_k, b_k, a_v, b_v, attention_mask, output_attentions, route=plan[0], value_route=plan[1]
            )
        else:
            out, weights = self.materialized_attention(
                f, a_k, b_k, a_v, b_v, attention_mask, output_attentions, **kwargs
            )
        out = self.o_proj(out.reshape(B, T, -1).contiguous())
        return out, weights


class TPADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: TPAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TPAAttention(config, layer_idx)
        self.mlp = TPAMLP(config)
        self.input_layernorm = TPARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TPARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        """The new hidden states (attention weights, when asked for, are recorded from the attention module by
        transformers' output capturing, as in Llama)."""
        kwargs.pop("use_cache", None)
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


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
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": TPADecoderLayer, "attentions": TPAAttention}

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

    @capture_outputs
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        past_key_values=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        cache = cache if cache is not None else past_key_values  # the name before transformers 5.24
        cfg = self.config
        use_cache = use_cache if use_cache is not None else cfg.use_cache
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = TPACache(config=cfg)
        # an empty DynamicCache/StaticCache/QuantizedCache (what generate builds) becomes a factor cache in place
        cache = as_factor_cache(cache, cfg)

        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)

        # positional: the cache argument's keyword is `cache` from transformers 5.24, `past_key_values` before
        causal_mask = create_causal_mask(cfg, inputs_embeds, attention_mask, cache, position_ids)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        kwargs.pop("output_hidden_states", None)
        if kwargs.get("output_attentions") is None:  # asked for in the config only: the layers must know too
            kwargs["output_attentions"] = cfg.output_attentions
        for layer in self.layers[: cfg.num_hidden_layers]:
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_FIELD: cache if use_cache else None})


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

    def logits_from_hidden(self, hidden_states):
        return self.lm_head(hidden_states)

    # Copied from hf_symmetry.modeling.modeling_compressed_llama.CompressedLlamaForCausalLM.forward
    @renamed_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.logits_from_hidden(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )


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

__all__ = [
    "TPACache",
    "TPACacheLayer",
    "TPAForCausalLM",
    "TPAModel",
    "TPAPreTrainedModel",
    "TPAQuantizedCache",
    "TPAQuantizedLayer",
    "TPAStaticCache",
    "TPAStaticLayer",
]
