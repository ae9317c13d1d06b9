"""FaRR (fuse and rank reduce) models: stock Llama / BERT / RoBERTa whose attention head dims differ
per layer.

Only the attention modules change; embeddings, norms, MLPs, masks, caches, generation and every
forward are the stock transformers ones (inherited). Layer i's query/key heads have
``qk_head_dims[i]`` (decoders: only NoPE layers may differ from ``head_dim``, RoPE needs all of it),
its value/output heads ``v_head_dims[i]``; the attention scale is always ``1/√(original head dim)``. Eager and SDPA
attention both accept a value head dim different from the query/key one.

This file is copied next to saved checkpoints for ``trust_remote_code`` loading: it imports only
torch, transformers and its sibling ``configuration_farr``.
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import (
    BertEmbeddings,
    BertEncoder,
    BertLayer,
    BertModel,
    BertPooler,
    BertPreTrainedModel,
    BertSelfAttention,
)
from transformers.models.bert.modeling_bert import eager_attention_forward as bert_eager_attention_forward
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention_forward
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model
from transformers.models.roberta.modeling_roberta import (
    RobertaEmbeddings,
    RobertaEncoder,
    RobertaLayer,
    RobertaModel,
    RobertaPooler,
    RobertaPreTrainedModel,
)

from .configuration_farr import FarrBertConfig, FarrLlamaConfig, FarrRobertaConfig


# ----------------------------------------------------------------------------------------------
# Decoder (Llama family)
# ----------------------------------------------------------------------------------------------
# Copied from hf_symmetry.modeling.modeling_compressed_llama.grouped_decode_attention
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


class FarrLlamaAttention(nn.Module):
    """Llama attention with per-layer query/key and value/output head dims, Qwen3's optional QK-norm
    and SmolLM3's NoPE layers (no rotary embedding)."""

    def __init__(self, config: FarrLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.qk_head_dim(layer_idx)
        self.v_head_dim = config.v_head_dim(layer_idx)
        self.use_rope = config.uses_rope(layer_idx)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.head_dim**-0.5  # the original head dim's scale, whatever v_head_dim is
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, kv * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, d, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs
    ):
        # transformers' decoder layer hands the KV cache over as `cache` from 5.24, `past_key_values` before
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        if self.config.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.v_head_dim).transpose(1, 2)

        if self.use_rope:
            cos, sin = position_embeddings
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        # decoding one token with SDPA: the queries packed per KV head (no K/V repeated, compiled or not)
        attn_weights = None
        attn_output = grouped_decode_attention(self, query, key, value, attention_mask, self.scaling)
        if attn_output is None:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, llama_eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self,
                query,
                key,
                value,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                **kwargs,
            )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class FarrLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: FarrLlamaConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = FarrLlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class FarrLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = FarrLlamaConfig
    config: FarrLlamaConfig
    _no_split_modules = ["FarrLlamaDecoderLayer"]
    _supports_flash_attn = False  # flash kernels need equal query/key and value head dims
    _supports_flex_attn = False
    _can_compile_fullgraph = True  # Llama's forward, static cache and masks; only the head dims differ
    _can_record_outputs = {"hidden_states": FarrLlamaDecoderLayer, "attentions": FarrLlamaAttention}


class FarrLlamaModel(FarrLlamaPreTrainedModel, LlamaModel):
    def __init__(self, config: FarrLlamaConfig):
        FarrLlamaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([FarrLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.post_init()

    # Copied from transformers.models.qwen2.modeling_qwen2.Qwen2Model.forward: one causal mask per
    # layer type (full or sliding-window attention), Llama's otherwise
    forward = Qwen2Model.forward


class FarrLlamaForCausalLM(FarrLlamaPreTrainedModel, LlamaForCausalLM, GenerationMixin):  # mixin named, as required
    def __init__(self, config: FarrLlamaConfig):
        FarrLlamaPreTrainedModel.__init__(self, config)
        self.model = FarrLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


# ----------------------------------------------------------------------------------------------
# Encoders (BERT, RoBERTa)
# ----------------------------------------------------------------------------------------------
class FarrBertSelfAttention(BertSelfAttention):
    """BERT self-attention with per-layer query/key and value head dims; query bias only (the key
    and value biases of the original were removed exactly, see ``configuration_farr``)."""

    def __init__(self, config, layer_idx: int):
        nn.Module.__init__(self)
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.qk_head_dim(layer_idx)
        self.value_head_size = config.v_head_dim(layer_idx)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = config.head_dim**-0.5  # the original head dim's scale
        d, h = config.hidden_size, self.num_attention_heads
        self.query = nn.Linear(d, h * self.attention_head_size)
        self.key = nn.Linear(d, h * self.attention_head_size, bias=False)
        self.value = nn.Linear(d, h * self.value_head_size, bias=False)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.is_decoder = False
        self.is_causal = False
        self.layer_idx = layer_idx

    def forward(self, hidden_states, attention_mask=None, cache=None, past_key_values=None, **kwargs):
        # an encoder keeps no KV cache: the cache arguments (`cache` from transformers 5.24) are ignored
        input_shape = hidden_states.shape[:-1]
        query = self.query(hidden_states).view(*input_shape, -1, self.attention_head_size).transpose(1, 2)
        key = self.key(hidden_states).view(*input_shape, -1, self.attention_head_size).transpose(1, 2)
        value = self.value(hidden_states).view(*input_shape, -1, self.value_head_size).transpose(1, 2)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, bert_eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout.p,
            scaling=self.scaling,
            **kwargs,
        )
        return attn_output.reshape(*input_shape, -1).contiguous(), attn_weights


def _install_farr_attention(encoder: nn.Module, config) -> None:
    """Swap each layer's self-attention and output projection for the per-layer-dim ones."""
    for i, layer in enumerate(encoder.layer):
        layer.attention.self = FarrBertSelfAttention(config, layer_idx=i)
        layer.attention.output.dense = nn.Linear(config.num_attention_heads * config.v_head_dim(i), config.hidden_size)


class FarrBertModel(BertModel):
    config_class = FarrBertConfig
    config: FarrBertConfig
    _can_record_outputs = {"hidden_states": BertLayer, "attentions": FarrBertSelfAttention}

    def __init__(self, config: FarrBertConfig, add_pooling_layer: bool = True):
        BertPreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        _install_farr_attention(self.encoder, config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()


class FarrRobertaModel(RobertaModel):
    config_class = FarrRobertaConfig
    config: FarrRobertaConfig
    _can_record_outputs = {"hidden_states": RobertaLayer, "attentions": FarrBertSelfAttention}

    def __init__(self, config: FarrRobertaConfig, add_pooling_layer: bool = True):
        RobertaPreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = RobertaEmbeddings(config)
        self.encoder = RobertaEncoder(config)
        _install_farr_attention(self.encoder, config)
        self.pooler = RobertaPooler(config) if add_pooling_layer else None
        self.post_init()


FarrLlamaModel.register_for_auto_class("AutoModel")
FarrLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
FarrBertModel.register_for_auto_class("AutoModel")
FarrRobertaModel.register_for_auto_class("AutoModel")

__all__ = ["FarrBertModel", "FarrLlamaForCausalLM", "FarrLlamaModel", "FarrRobertaModel"]
