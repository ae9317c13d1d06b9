"""LayerNorm decoders (OPT, GPT-2, GPT-NeoX) after residual-stream rotation: pre-norm blocks (sequential,
or parallel as GPT-NeoX) with learned absolute positions or rotary embeddings (GPT-NeoX's own, imported
from transformers), biases everywhere, and RMSNorms without weight (see ``configuration_rms_decoder``).

This file is copied next to saved checkpoints for ``trust_remote_code`` loading: it imports only
torch, transformers and its sibling ``configuration_rms_decoder``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

from .configuration_rms_decoder import RMSDecoderConfig


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
def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
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
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        r, inner = config.residual_size, config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(r, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(r, inner, bias=config.attention_bias)
        self.v_proj = nn.Linear(r, inner, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, r, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask=None, past_key_values: Cache | None = None,
                position_embeddings=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if position_embeddings is not None:   # rotary (partial: the first dims of each head)
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0,
                                           **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class RMSDecoderMLP(nn.Module):
    def __init__(self, config: RMSDecoderConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.residual_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.residual_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class RMSDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: RMSDecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = WeightlessRMSNorm(config.rms_norm_eps, config.hidden_size)
        self.self_attn = RMSDecoderAttention(config, layer_idx)
        self.post_attention_layernorm = WeightlessRMSNorm(config.rms_norm_eps, config.hidden_size)
        self.mlp = RMSDecoderMLP(config)

        self.parallel_block = config.parallel_block

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        normed = self.input_layernorm(hidden_states)
        attn, _ = self.self_attn(normed, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        if self.parallel_block:   # both read the layer input (its two weightless norms are the same map)
            return hidden_states + attn + self.mlp(normed)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class RMSDecoderPreTrainedModel(PreTrainedModel):
    config_class = RMSDecoderConfig
    config: RMSDecoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RMSDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True


class RMSDecoderModel(RMSDecoderPreTrainedModel):
    def __init__(self, config: RMSDecoderConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.residual_size)
        if config.rotary:
            self.rotary_emb = GPTNeoXRotaryEmbedding(config)
        else:
            self.embed_positions = nn.Embedding(config.max_position_embeddings + config.position_offset,
                                                config.residual_size)
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
            pos = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()   # OPT: padding-aware
            return pos[:, past_seen:past_seen + n]
        return (torch.arange(n, device=inputs_embeds.device) + past_seen).unsqueeze(0)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = self._positions(inputs_embeds, attention_mask, past_seen)
        if self.config.rotary:
            hidden_states = inputs_embeds
            kwargs["position_embeddings"] = self.rotary_emb(hidden_states, position_ids)
        else:
            hidden_states = inputs_embeds + self.embed_positions(position_ids + self.config.position_offset)
        mask_positions = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                         past_key_values=past_key_values, position_ids=mask_positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask, past_key_values=past_key_values, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)


class RMSDecoderForCausalLM(RMSDecoderPreTrainedModel, GenerationMixin):
    def __init__(self, config: RMSDecoderConfig):
        super().__init__(config)
        self.model = RMSDecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.residual_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


RMSDecoderModel.register_for_auto_class("AutoModel")
RMSDecoderForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["RMSDecoderForCausalLM", "RMSDecoderModel"]
