"""ProcrustesGPT-compressed Llama-family models for Hugging Face Transformers.

Linear layers are structured matrices with factorised forward passes (the dense matrix is never
formed in ``forward``): the classes of ``structured_linear`` (Kronecker sums, GS, low rank, dense), one per
config ``"type"``.

The embedding matrix can be structured too (``rows`` gathers token rows from the factors) and the LM
head reuses it (``lm_head="tied"``/``"tied_mixed"``) or has its own structure.

The residual stream is rotated (after norm fusion, docs/math.md §1.4): RMSNorms have no weight and divide
``Σ x²`` by the original ``hidden_size``. With one basis per residual segment every skip connection
carries the orthogonal ``Q_prevᵀ Q_next``, stored as a Cayley parameter and turned into a matrix once
(cached, recomputed only when its parameters change), not on every forward.
With one basis for all segments (SliceGPT, one global PCA) the segments may have different widths
(``config.residual_sizes``): a skip connection into a narrower segment keeps the first coordinates,
into a wider one pads with zeros.

This file is copied next to saved checkpoints for ``trust_remote_code`` loading: it imports only torch,
transformers and its siblings ``configuration_compressed_llama`` and ``structured_linear``.
"""

import dataclasses
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_compressed_llama import CompressedLlamaConfig
from .structured_linear import (
    DenseLinear,
    GSLinear,
    KroneckerLinear,
    LowRankLinear,
    OrthogonalSkip,
    StructuredEmbedding,
    StructuredLinear,
    cayley_decode,
    structured_linear,
)


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


def renamed_cache_kwarg(forward):
    """``forward`` taking the KV cache as ``cache`` or ``past_key_values``: where the installed transformers
    names it ``cache`` (5.24 and later) the old name is deprecated as in its own models (a warning), before
    that it is the name ``generate`` passes (no warning)."""
    if CACHE_FIELD != "cache":
        return forward
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)


# ----------------------------------------------------------------------------------------------
# Residual stream: norms and skip connections
# ----------------------------------------------------------------------------------------------
class CompressedRMSNorm(nn.Module):
    """RMSNorm without weight (γ is folded into the readers, so that ``RMSNorm(x Q) = RMSNorm(x) Q``).
    ``Σ x²`` is divided by ``norm_dim``, the original width, also when the stream is sliced (SliceGPT)."""

    def __init__(self, norm_dim: int, eps: float):
        super().__init__()
        self.norm_dim, self.variance_epsilon = norm_dim, eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        # at least float32, like LlamaRMSNorm; float64 stays float64 (exactness checks)
        h = hidden_states if dtype == torch.float64 else hidden_states.to(torch.float32)
        variance = h.pow(2).sum(-1, keepdim=True) / self.norm_dim
        return (h * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)

    def extra_repr(self):
        return f"norm_dim={self.norm_dim}, eps={self.variance_epsilon}"


class DenseSkip(nn.Module):
    """``x -> x S`` for a general ``S`` (``weight = Sᵀ``, nn.Linear convention)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))

    def forward(self, x):
        return F.linear(x, self.weight)


def resize_stream(x: torch.Tensor, width: int) -> torch.Tensor:
    """The residual stream carried into a segment ``width`` wide (per-segment widths, one basis for
    all: keep the first ``width`` coordinates, or pad with zeros — the dropped directions are gone)."""
    have = x.shape[-1]
    if have == width:
        return x
    return x[..., :width] if have > width else F.pad(x, (0, width - have))


def make_skip(config: CompressedLlamaConfig) -> nn.Module | None:
    if config.skip_connections == "orthogonal":
        return OrthogonalSkip(config.residual_size)
    if config.skip_connections == "dense":
        return DenseSkip(config.residual_size)
    return None


# ----------------------------------------------------------------------------------------------
# Decoder
# ----------------------------------------------------------------------------------------------
def grouped_decode_attention(module, query, key, value, attention_mask, scaling):
    """SDPA attention of one new token in a GQA layer, the query heads of each KV head packed as its rows:
    ``[B, KV, groups, d]`` queries against the cached ``[B, KV, S, d]`` keys/values, no K/V repeated. It is
    what transformers' SDPA function runs when decoding eagerly (the same call, the same result); under
    ``torch.compile`` that function repeats K and V instead, which made compiled decoding slower than eager.
    Returns ``[B, 1, h, d_v]``, or ``None`` where the configured attention function runs as it is: another
    implementation than SDPA, more than one token, no grouping, a mask per head, or no mask and equal head
    dims (transformers then passes ``enable_gqa``, compiled or not)."""
    B, h, T, _ = query.shape
    groups, mask = module.num_key_value_groups, attention_mask
    if T != 1 or groups == 1 or module.config._attn_implementation != "sdpa":
        return None
    if mask is None and key.shape[-1] == value.shape[-1] <= 256:
        return None
    if mask is not None and not (mask.dim() == 4 and mask.shape[1] == 1):
        return None
    out = F.scaled_dot_product_attention(
        query.reshape(B, h // groups, groups, query.shape[-1]),
        key,
        value,
        attn_mask=mask,
        dropout_p=module.attention_dropout if module.training else 0.0,
        scale=scaling,
    )
    return out.reshape(B, h, 1, value.shape[-1]).transpose(1, 2).contiguous()


class CompressedLlamaAttention(nn.Module):
    def __init__(self, config: CompressedLlamaConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        entry = config.layer_structures[layer_idx]
        d_in, d_out = config.segment_width(2 * layer_idx), config.segment_width(2 * layer_idx + 1)
        q_out, kv_out = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = structured_linear(d_in, q_out, entry["q_proj"])
        self.k_proj = structured_linear(d_in, kv_out, entry["k_proj"])
        self.v_proj = structured_linear(d_in, kv_out, entry["v_proj"])
        self.o_proj = structured_linear(q_out, d_out, entry["o_proj"])
        if config.qk_norm:  # Qwen3's per-head QK-norm (transformers' own module)
            self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # decoding one token with SDPA: the queries packed per KV head (no K/V repeated, compiled or not)
        out, weights = grouped_decode_attention(self, q, k, v, attention_mask, self.scaling), None
        if out is None:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            out, weights = attention_interface(
                self,
                q,
                k,
                v,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                **kwargs,
            )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class CompressedLlamaMLP(nn.Module):
    def __init__(self, config: CompressedLlamaConfig, layer_idx: int):
        super().__init__()
        entry = config.layer_structures[layer_idx]
        d_in, d_out, h = (
            config.segment_width(2 * layer_idx + 1),
            config.segment_width(2 * layer_idx + 2),
            config.intermediate_size,
        )
        self.gate_proj = structured_linear(d_in, h, entry["gate_proj"])
        self.up_proj = structured_linear(d_in, h, entry["up_proj"])
        self.down_proj = structured_linear(h, d_out, entry["down_proj"])
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class CompressedLlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: CompressedLlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = CompressedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CompressedLlamaAttention(config, layer_idx)
        self.attn_skip = make_skip(config)
        self.post_attention_layernorm = CompressedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = CompressedLlamaMLP(config, layer_idx)
        self.mlp_skip = make_skip(config)
        self.mid_width = config.segment_width(2 * layer_idx + 1)
        self.out_width = config.segment_width(2 * layer_idx + 2)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        attn, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        skip = hidden_states if self.attn_skip is None else self.attn_skip(hidden_states)
        hidden_states = resize_stream(skip, self.mid_width) + attn
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        skip = hidden_states if self.mlp_skip is None else self.mlp_skip(hidden_states)
        return resize_stream(skip, self.out_width) + mlp


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------
class CompressedLlamaPreTrainedModel(PreTrainedModel):
    config_class = CompressedLlamaConfig
    config: CompressedLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CompressedLlamaDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": CompressedLlamaDecoderLayer, "attentions": CompressedLlamaAttention}

    @torch.no_grad()
    def _init_weights(self, module):
        """Random initialisation for ``from_config`` (converted checkpoints overwrite all of it): every
        structured matrix starts near N(0, initializer_range²) entries, skips at the identity."""
        if isinstance(module, (StructuredLinear, StructuredEmbedding, OrthogonalSkip)):
            module.init_weights(self.config.initializer_range)  # each structure knows its own
        elif isinstance(module, DenseSkip) or (
            isinstance(module, nn.Linear) and getattr(module, "_is_head_mix", False)
        ):
            init.eye_(module.weight)
        else:
            super()._init_weights(module)


class CompressedLlamaModel(CompressedLlamaPreTrainedModel):
    def __init__(self, config: CompressedLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = StructuredEmbedding(config.vocab_size, config.segment_width(0), config.embed_structure)
        self.layers = nn.ModuleList([CompressedLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = CompressedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

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
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
        # positional: the cache argument's keyword is `cache` from transformers 5.24, `past_key_values` before
        causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_FIELD: cache if use_cache else None})


class CompressedLlamaForCausalLM(CompressedLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    def __init__(self, config: CompressedLlamaConfig):
        super().__init__(config)
        self.model = CompressedLlamaModel(config)
        self.vocab_size = config.vocab_size
        d_last, d_embed = config.segment_width(2 * config.num_hidden_layers), config.segment_width(0)
        self.head_mix = None
        self.lm_head = None
        if config.lm_head == "tied_mixed":
            self.head_mix = nn.Linear(d_last, d_embed, bias=False)
            self.head_mix._is_head_mix = True
        elif config.lm_head == "separate":
            self.lm_head = structured_linear(d_last, config.vocab_size, {**config.lm_head_structure, "bias": False})
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
        if self.lm_head is not None:
            return self.lm_head(hidden_states)
        if self.head_mix is not None:
            hidden_states = self.head_mix(hidden_states)
        return self.model.embed_tokens.matrix(hidden_states)

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


# Checkpoint names, for converters (hf_symmetry's compress writes through these and spells no layer path)
#: layer ``i``'s modules are ``LAYER_PREFIX.format(i) + "self_attn.q_proj"`` etc.
LAYER_PREFIX = "model.layers.{}."
#: canonical QK-norm names (hf_symmetry's adapter) -> module inside a decoder layer
QK_NORM_MODULES = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
#: the embedding matrix, the separate head and the tied head's mix
EMBED_MODULE, LM_HEAD_MODULE, HEAD_MIX_MODULE = "model.embed_tokens.matrix", "lm_head", "head_mix"


CompressedLlamaModel.register_for_auto_class("AutoModel")
CompressedLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "CompressedLlamaForCausalLM",
    "CompressedLlamaModel",
    "CompressedLlamaPreTrainedModel",
    "KroneckerLinear",
    "GSLinear",
    "LowRankLinear",
    "DenseLinear",
    "cayley_decode",
]
