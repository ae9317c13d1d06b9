"""LayerNorm decoders (OPT, GPT-2, GPT-NeoX) after residual-stream rotation: pre-norm blocks (sequential,
or parallel as GPT-NeoX) with learned absolute positions or rotary embeddings (GPT-NeoX's own, imported
from transformers), biases everywhere, and RMSNorms without weight (see ``configuration_rms_decoder``).

After ProcrustesGPT compression (``hf-symmetry compress --structure kron|gs|lowrank``) the linears that
read or write the stream, the token embedding and the head may be structured (Kronecker sums,
group-and-shuffle, low rank: factorised forward passes, the dense matrix is never formed), and with one
basis per residual segment every skip connection carries an orthogonal matrix; the config says which
(``layer_structures``, ``embed_structure``, ``lm_head_structure``, ``skip_connections``). Biases stay dense.

This file is copied next to saved checkpoints for ``trust_remote_code`` loading: it imports only
torch, transformers and its sibling ``configuration_rms_decoder``.
"""

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_rms_decoder import RMSDecoderConfig


# ----------------------------------------------------------------------------------------------
# The KV cache's name: transformers 5.24 renamed the argument and output field `past_key_values` to
# `cache`. Models here take either as an argument, and write their output under the installed name.
# ----------------------------------------------------------------------------------------------
# Copied from hf_symmetry.modeling.modeling_tpa.cache_field
def cache_field() -> str:
    """The name of the KV cache field of the installed transformers' model outputs."""
    return "cache" if any(f.name == "cache" for f in dataclasses.fields(BaseModelOutputWithPast)) else "past_key_values"


#: read once at import: a forward pass must not call ``dataclasses.fields`` (torch.compile cannot trace it)
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
# Structured linear layers and orthogonal skips (ProcrustesGPT; the compressed family's own, copied so
# that this file stays flat). Which module a layer gets is read from the config: ``layer_structures``,
# ``embed_structure``, ``lm_head_structure``, ``skip_connections``.
# ----------------------------------------------------------------------------------------------
# Copied from hf_symmetry.modeling.modeling_compressed_llama._StructuredLinear
class _StructuredLinear(nn.Module):
    """``y = x Wᵀ (+ b)`` for a structured ``W [out_features, in_features]``. Subclasses implement
    ``_matmul(x2d)``, ``rows(ids)`` (rows of W, for embeddings) and ``dense_weight()`` (for tests and
    inspection only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        """``x Wᵀ (+ b)``; with ``embed``, ``x`` holds token ids and the rows ``W[x]`` come back (the
        embedding's lookup goes through this module's call, so that hooks on it see its parameters:
        accelerate's offloading loads them there)."""
        if embed:
            return self.rows(x)
        y = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# Copied from hf_symmetry.modeling.modeling_compressed_llama.DenseLinear
class DenseLinear(_StructuredLinear):
    def __init__(self, in_features, out_features, bias=False):
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def _matmul(self, x):
        return F.linear(x, self.weight)

    def rows(self, ids):
        return F.embedding(ids, self.weight)

    def dense_weight(self):
        return self.weight


# Copied from hf_symmetry.modeling.modeling_compressed_llama.LowRankLinear
class LowRankLinear(_StructuredLinear):
    """``W = U V``: ``lr_u [out, r]``, ``lr_v [r, in]``."""

    def __init__(self, in_features, out_features, rank: int, bias=False):
        super().__init__(in_features, out_features, bias)
        self.rank = rank
        self.lr_u = nn.Parameter(torch.empty(out_features, rank))
        self.lr_v = nn.Parameter(torch.empty(rank, in_features))

    def _matmul(self, x):
        return F.linear(F.linear(x, self.lr_v), self.lr_u)

    def rows(self, ids):
        return F.embedding(ids, self.lr_u) @ self.lr_v

    def dense_weight(self):
        return self.lr_u @ self.lr_v

    def extra_repr(self):
        return f"{super().extra_repr()}, rank={self.rank}"


# Copied from hf_symmetry.modeling.modeling_compressed_llama.KroneckerLinear
class KroneckerLinear(_StructuredLinear):
    """``W = Σ_{s<r} A_s ⊗ B_s`` with ``A_s [m1, n1]``, ``B_s [m2, n2]`` (``(A ⊗ B)[i1 m2 + i2, j1 n2 + j2]
    = A[i1, j1] B[i2, j2]``). Stored factor-row-major so that both contraction orders are plain
    matmuls on views: ``kron_a[i, s, j] = A_s[i, j]`` (``[m1, r, n1]``), ``kron_b[i, s, j] = B_s[i, j]``
    (``[m2, r, n2]``). The cheaper contraction order is fixed at construction."""

    def __init__(self, in_features, out_features, rank: int, a_shape, bias=False):
        super().__init__(in_features, out_features, bias)
        m1, n1 = (int(a) for a in a_shape)
        if m1 <= 0 or n1 <= 0 or out_features % m1 or in_features % n1:
            raise ValueError(
                f"Kronecker factor shape {tuple(a_shape)} does not divide the {out_features}x{in_features} matrix"
            )
        m2, n2 = out_features // m1, in_features // n1
        self.rank, self.a_shape, self.b_shape = rank, (m1, n1), (m2, n2)
        self.kron_a = nn.Parameter(torch.empty(m1, rank, n1))
        self.kron_b = nn.Parameter(torch.empty(m2, rank, n2))
        # flops per token of each order: contract A first / B first
        self.a_first = rank * m1 * n2 * (n1 + m2) <= rank * m2 * n1 * (n2 + m1)

    def _matmul(self, x):
        (m1, n1), (m2, n2), r, N = self.a_shape, self.b_shape, self.rank, x.shape[0]
        if self.a_first:
            u = F.linear(x.view(N, n1, n2).transpose(1, 2), self.kron_a.reshape(m1 * r, n1))  # [N, n2, (i1, s)]
            u = u.view(N, n2, m1, r).permute(0, 2, 3, 1).reshape(N * m1, r * n2)  # [(N, i1), (s, j2)]
            return F.linear(u, self.kron_b.reshape(m2, r * n2)).view(N, m1 * m2)
        t = F.linear(x.view(N, n1, n2), self.kron_b.reshape(m2 * r, n2))  # [N, n1, (i2, s)]
        t = t.view(N, n1, m2, r).permute(0, 2, 3, 1).reshape(N * m2, r * n1)  # [(N, i2), (s, j1)]
        y = F.linear(t, self.kron_a.reshape(m1, r * n1)).view(N, m2, m1)
        return y.transpose(1, 2).reshape(N, m1 * m2)

    def rows(self, ids):
        m2 = self.b_shape[0]
        flat = ids.reshape(-1)
        a, b = self.kron_a[flat // m2], self.kron_b[flat % m2]  # [N, r, n1], [N, r, n2]
        return torch.bmm(a.transpose(1, 2), b).reshape(*ids.shape, self.in_features)

    def dense_weight(self):
        return torch.einsum("asc,bsd->abcd", self.kron_a, self.kron_b).reshape(self.out_features, self.in_features)

    def extra_repr(self):
        return f"{super().extra_repr()}, rank={self.rank}, a_shape={self.a_shape}, b_shape={self.b_shape}"


# Copied from hf_symmetry.modeling.modeling_compressed_llama.GSLinear
class GSLinear(_StructuredLinear):
    """Group-and-shuffle ``W = L · P · R``: ``gs_right [kr, kl·b, in/kr]`` (block-diagonal, applied first),
    the shuffle routing ``b`` channels from every R-block to every L-block, ``gs_left [kl, out/kl, kr·b]``
    (block-diagonal). Tile (i, j) of W is ``gs_left[i][:, j-th b] @ gs_right[j][i-th b, :]``."""

    def __init__(self, in_features, out_features, rank: int, blocks, bias=False):
        super().__init__(in_features, out_features, bias)
        kl, kr = (int(k) for k in blocks)
        if kl <= 0 or kr <= 0 or out_features % kl or in_features % kr:
            raise ValueError(f"GS blocks {tuple(blocks)} do not divide the {out_features}x{in_features} matrix")
        self.kl, self.kr, self.rank = kl, kr, rank
        self.gs_left = nn.Parameter(torch.empty(kl, out_features // kl, kr * rank))
        self.gs_right = nn.Parameter(torch.empty(kr, kl * rank, in_features // kr))

    def _matmul(self, x):
        kl, kr, b, N = self.kl, self.kr, self.rank, x.shape[0]
        h = torch.bmm(x.view(N, kr, -1).transpose(0, 1), self.gs_right.transpose(1, 2))  # [kr, N, (i, c)]
        h = h.view(kr, N, kl, b).permute(2, 1, 0, 3).reshape(kl, N, kr * b)  # shuffle: [kl, N, (j, c)]
        y = torch.bmm(h, self.gs_left.transpose(1, 2))  # [kl, N, out/kl]
        return y.transpose(0, 1).reshape(N, self.out_features)

    def rows(self, ids):
        kl, kr, b = self.kl, self.kr, self.rank
        flat = ids.reshape(-1)
        bl = self.out_features // kl
        right = self.gs_right.view(kr, kl, b, -1)
        if torch.compiler.is_compiling():  # no data-dependent shapes: each block's rows for every token, then pick
            block, out = flat // bl, None
            for i in range(kl):
                left = self.gs_left[i][flat % bl].view(-1, kr, b).transpose(0, 1)  # [kr, N, b]
                rows_i = torch.bmm(left, right[:, i]).transpose(0, 1).reshape(-1, self.in_features)
                out = rows_i if out is None else torch.where((block == i)[:, None], rows_i, out)
            return out.reshape(*ids.shape, self.in_features)
        out = torch.empty(flat.shape[0], self.in_features, dtype=self.gs_left.dtype, device=flat.device)
        for i in range(kl):
            sel = (flat // bl) == i
            if kl > 1 and not bool(sel.any()):
                continue
            left = self.gs_left[i][flat[sel] % bl].view(-1, kr, b).transpose(0, 1)  # [kr, n_i, b]
            out[sel] = torch.bmm(left, right[:, i]).transpose(0, 1).reshape(-1, self.in_features)
        return out.reshape(*ids.shape, self.in_features)

    def dense_weight(self):
        kl, kr, b = self.kl, self.kr, self.rank
        left = self.gs_left.view(kl, -1, kr, b)
        right = self.gs_right.view(kr, kl, b, -1)
        return torch.einsum("ipjc,jicq->ipjq", left, right).reshape(self.out_features, self.in_features)

    def extra_repr(self):
        return f"{super().extra_repr()}, blocks=({self.kl}, {self.kr}), rank={self.rank}"


# Copied from hf_symmetry.modeling.modeling_compressed_llama.structured_linear
def structured_linear(in_features: int, out_features: int, spec: dict) -> _StructuredLinear:
    """The module a config structure entry describes."""
    kind, bias = spec["type"], bool(spec.get("bias", False))
    if kind == "dense":
        return DenseLinear(in_features, out_features, bias)
    if kind == "lowrank":
        return LowRankLinear(in_features, out_features, int(spec["rank"]), bias)
    if kind == "kron":
        return KroneckerLinear(in_features, out_features, int(spec["rank"]), spec["a_shape"], bias)
    if kind == "gs":
        return GSLinear(in_features, out_features, int(spec["rank"]), spec["blocks"], bias)
    raise ValueError(f"unknown structure type {kind!r}")


# Copied from hf_symmetry.modeling.modeling_compressed_llama.StructuredEmbedding
class StructuredEmbedding(nn.Embedding):
    """Token embeddings as rows of a structured ``[vocab, d]`` matrix (``matrix``), looked up through the
    matrix module's own call (so that hooks on it, such as accelerate's offloading, see its parameters).

    An ``nn.Embedding`` as transformers' ``resize_token_embeddings`` needs one: when the matrix is dense,
    ``weight`` is its ``[vocab, d]`` table, and setting ``weight`` (the resize swaps in a longer table)
    sets the dense matrix's. A structured matrix has no table of rows to extend: its ``weight`` is an
    ``AttributeError`` that says so."""

    def __init__(self, vocab_size: int, dim: int, spec: dict):
        nn.Module.__init__(self)  # no table of its own: the rows come from `matrix`
        self.num_embeddings, self.embedding_dim, self.padding_idx = vocab_size, dim, None
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.matrix = structured_linear(dim, vocab_size, {**spec, "bias": False})

    def __getattr__(self, name: str):
        if name == "weight":
            matrix = self._modules["matrix"]
            if isinstance(matrix, DenseLinear):
                return matrix.weight
            raise AttributeError(
                f"this token embedding is a {type(matrix).__name__} (structured) matrix and has no dense `weight` "
                "table: resize_token_embeddings needs a dense embedding"
            )
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            if not isinstance(self.matrix, DenseLinear):
                raise AttributeError(f"a {type(self.matrix).__name__} token embedding cannot take a dense `weight`")
            self.matrix.weight = value
            self.matrix.out_features = value.shape[0]
            return
        super().__setattr__(name, value)
        if name == "num_embeddings" and isinstance(self._modules.get("matrix"), DenseLinear):
            self.matrix.out_features = value  # the table was resized in place (resize_token_embeddings)

    def forward(self, input_ids):
        return self.matrix(input_ids, embed=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


# Copied from hf_symmetry.modeling.modeling_compressed_llama.cayley_decode
def cayley_decode(k: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) (I + K)(I − K)⁻¹`` with K skew-symmetric, upper triangle ``k`` (row-major);
    computed in float64 and returned in ``k``'s dtype. ``I − K`` is always invertible (K is skew)."""
    d = signs.shape[0]
    iu = torch.triu_indices(d, d, 1, device=k.device)
    K = torch.zeros(d, d, dtype=torch.float64, device=k.device)
    K[iu[0], iu[1]] = k.to(torch.float64)
    K = K - K.T
    eye = torch.eye(d, dtype=torch.float64, device=k.device)
    C = torch.linalg.solve((eye - K).T, (eye + K).T).T
    return (signs.to(torch.float64)[:, None] * C).to(k.dtype)


# Copied from hf_symmetry.modeling.modeling_compressed_llama.OrthogonalSkip
class OrthogonalSkip(nn.Module):
    """``x -> x S`` for an orthogonal ``S = Q_prevᵀ Q_next`` stored as ``d(d+1)/2`` numbers
    (``skip_k``: Cayley parameter; ``skip_signs``: ±1). S is formed once into the non-persistent buffer
    ``skip_matrix``: at initialisation and after loading (``_init_weights``), and again by an eager call
    when ``skip_k`` or ``skip_signs`` changed (``.to()``, in-place edits, optimizer steps). Compiled and
    exported graphs read the buffer as it is (they cannot see tensor versions): after editing the
    parameters, ``refresh()`` (or one eager call) before compiling. While training with a trainable
    ``skip_k``, S is formed on every call, so that gradients flow."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.skip_k = nn.Parameter(torch.zeros(dim * (dim - 1) // 2))
        self.register_buffer("skip_signs", torch.ones(dim))
        self.register_buffer("skip_matrix", torch.eye(dim), persistent=False)  # S of skip_k = 0, signs = 1
        self._formed_from: tuple | None = None  # the parameters skip_matrix was formed from

    def _parameters_now(self) -> tuple:
        k, signs = self.skip_k, self.skip_signs
        return (k.data_ptr(), k._version, signs.data_ptr(), signs._version, k.dtype, k.device)

    @torch.no_grad()
    def refresh(self) -> None:
        """Form ``S`` from ``skip_k`` and ``skip_signs`` into ``skip_matrix`` (skipped while the parameters
        are on the meta device: offloaded or not loaded yet)."""
        if self.skip_k.is_meta or self.skip_signs.is_meta:
            return
        self.skip_matrix = cayley_decode(self.skip_k.detach(), self.skip_signs)
        self._formed_from = self._parameters_now()

    def matrix(self) -> torch.Tensor:
        if self.training and self.skip_k.requires_grad and torch.is_grad_enabled():
            return cayley_decode(self.skip_k, self.skip_signs)
        if not torch.compiler.is_compiling() and self._formed_from != self._parameters_now():
            self.refresh()
        return self.skip_matrix

    def forward(self, x):
        return x @ self.matrix()


class WeightlessRMSNorm(nn.Module):
    """``x / sqrt(Σ x² / norm_dim + eps)``, in the input's dtype (its γ and β live in the next linears).
    ``norm_dim`` is the original width, also when the stream is sliced to fewer dims (SliceGPT)."""

    def __init__(self, eps: float, norm_dim: int | None = None):
        super().__init__()
        self.variance_epsilon, self.norm_dim = eps, norm_dim

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.norm_dim is None or self.norm_dim == hidden_states.shape[-1]:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
        else:
            variance = hidden_states.pow(2).sum(-1, keepdim=True) / self.norm_dim
        return hidden_states * torch.rsqrt(variance + self.variance_epsilon)


# Copied from transformers.models.llama.modeling_llama.eager_attention_forward (no GQA: one KV head
# per query head; the softmax keeps the input dtype)
def _linear(in_features: int, out_features: int, bias: bool, spec: dict | None) -> nn.Module:
    """``nn.Linear`` where the config gives no structure (or a dense one), else the structured module."""
    if spec is None or spec.get("type", "dense") == "dense":
        return nn.Linear(in_features, out_features, bias=bias)
    return structured_linear(in_features, out_features, {**spec, "bias": bias})


def _layer_spec(config: RMSDecoderConfig, layer_idx: int, name: str) -> dict | None:
    return None if config.layer_structures is None else config.layer_structures[layer_idx].get(name)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class RMSDecoderAttention(nn.Module):
    def __init__(self, config: RMSDecoderConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        r, inner = config.residual_size, config.num_attention_heads * config.head_dim
        spec = lambda name: _layer_spec(config, layer_idx, name)  # noqa: E731
        self.q_proj = _linear(r, inner, config.attention_bias, spec("q_proj"))
        self.k_proj = _linear(r, inner, config.attention_bias, spec("k_proj"))
        self.v_proj = _linear(r, inner, config.attention_bias, spec("v_proj"))
        self.o_proj = _linear(inner, r, config.attention_bias, spec("o_proj"))

    def forward(
        self, hidden_states, attention_mask=None, cache: Cache | None = None, position_embeddings=None, **kwargs
    ):
        input_shape = hidden_states.shape[:-1]
        shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if position_embeddings is not None:  # rotary (partial: the first dims of each head)
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class RMSDecoderMLP(nn.Module):
    def __init__(self, config: RMSDecoderConfig, layer_idx: int = 0):
        super().__init__()
        r, h = config.residual_size, config.intermediate_size
        self.up_proj = _linear(r, h, config.mlp_bias, _layer_spec(config, layer_idx, "up_proj"))
        self.down_proj = _linear(h, r, config.mlp_bias, _layer_spec(config, layer_idx, "down_proj"))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class RMSDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: RMSDecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = WeightlessRMSNorm(config.rms_norm_eps, config.hidden_size)
        self.self_attn = RMSDecoderAttention(config, layer_idx)
        self.post_attention_layernorm = WeightlessRMSNorm(config.rms_norm_eps, config.hidden_size)
        self.mlp = RMSDecoderMLP(config, layer_idx)
        orthogonal = config.skip_connections == "orthogonal"
        self.attn_skip = OrthogonalSkip(config.residual_size) if orthogonal else None
        self.mlp_skip = OrthogonalSkip(config.residual_size) if orthogonal else None
        self.parallel_block = config.parallel_block

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        normed = self.input_layernorm(hidden_states)
        attn, _ = self.self_attn(normed, attention_mask=attention_mask, cache=cache, **kwargs)
        if self.parallel_block:  # both read the layer input (its two weightless norms are the same map)
            return hidden_states + attn + self.mlp(normed)
        if self.attn_skip is not None:  # one basis per residual segment: the skip changes basis
            hidden_states = self.attn_skip(hidden_states)
        hidden_states = hidden_states + attn
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        if self.mlp_skip is not None:
            hidden_states = self.mlp_skip(hidden_states)
        return hidden_states + mlp


class RMSDecoderPreTrainedModel(PreTrainedModel):
    config_class = RMSDecoderConfig
    config: RMSDecoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RMSDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": RMSDecoderLayer, "attentions": RMSDecoderAttention}

    @torch.no_grad()
    def _init_weights(self, module):
        """Random initialisation for ``from_config`` (converted checkpoints overwrite all of it): structured
        matrices start near N(0, initializer_range²) entries, skips at the identity."""
        std = self.config.initializer_range
        if isinstance(module, DenseLinear):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LowRankLinear):
            init.normal_(module.lr_u, mean=0.0, std=std**0.5 / module.rank**0.25)
            init.normal_(module.lr_v, mean=0.0, std=std**0.5 / module.rank**0.25)
        elif isinstance(module, KroneckerLinear):
            init.normal_(module.kron_a, mean=0.0, std=1.0 / module.rank**0.5)
            init.normal_(module.kron_b, mean=0.0, std=std / max(module.a_shape[1], 1) ** 0.5)
        elif isinstance(module, GSLinear):
            init.normal_(module.gs_left, mean=0.0, std=1.0 / (module.kr * module.rank) ** 0.5)
            init.normal_(module.gs_right, mean=0.0, std=std * module.kr**0.5)
        elif isinstance(module, OrthogonalSkip):
            init.zeros_(module.skip_k)
            init.ones_(module.skip_signs)
            module.refresh()  # S of the loaded (or initialised) parameters
        elif isinstance(module, StructuredEmbedding):
            pass  # its matrix is initialised as a structured linear
        else:
            super()._init_weights(module)
        if isinstance(module, _StructuredLinear) and module.bias is not None:
            init.zeros_(module.bias)


class RMSDecoderModel(RMSDecoderPreTrainedModel):
    def __init__(self, config: RMSDecoderConfig):
        super().__init__(config)
        if config.embed_structure is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.residual_size)
        else:  # rows of a structured (or dense) matrix, as the compressed family's embedding
            self.embed_tokens = StructuredEmbedding(config.vocab_size, config.residual_size, config.embed_structure)
        if config.rotary:
            self.rotary_emb = GPTNeoXRotaryEmbedding(config)
        else:
            self.embed_positions = nn.Embedding(
                config.max_position_embeddings + config.position_offset, config.residual_size
            )
        self.layers = nn.ModuleList([RMSDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = WeightlessRMSNorm(config.rms_norm_eps, config.hidden_size)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _positions(self, inputs_embeds, attention_mask, past_seen: int) -> torch.Tensor:
        n = inputs_embeds.shape[1]
        if self.config.positions_from_mask and attention_mask is not None and attention_mask.dim() == 2:
            pos = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()  # OPT: padding-aware
            return pos[:, past_seen : past_seen + n]
        return (torch.arange(n, device=inputs_embeds.device) + past_seen).unsqueeze(0)

    @renamed_cache_kwarg
    @merge_with_config_defaults
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
    ) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values  # the name before transformers 5.24
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = self._positions(inputs_embeds, attention_mask, past_seen)
        if self.config.rotary:
            hidden_states = inputs_embeds
            kwargs["position_embeddings"] = self.rotary_emb(hidden_states, position_ids)
        else:
            hidden_states = inputs_embeds + self.embed_positions(position_ids + self.config.position_offset)
        # the real positions: sequences packed in one row restart them (padding-free batches), and the mask
        # keeps each to itself. Positional: the cache argument's keyword is `cache` from transformers 5.24
        causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=causal_mask, position_ids=position_ids, cache=cache, **kwargs
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_FIELD: cache})


class RMSDecoderForCausalLM(RMSDecoderPreTrainedModel, GenerationMixin):
    def __init__(self, config: RMSDecoderConfig):
        super().__init__(config)
        self.model = RMSDecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = _linear(config.residual_size, config.vocab_size, config.lm_head_bias, config.lm_head_structure)
        self.post_init()

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


RMSDecoderModel.register_for_auto_class("AutoModel")
RMSDecoderForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["RMSDecoderForCausalLM", "RMSDecoderModel"]
