"""LayerNorm decoders (OPT, GPT-2, GPT-NeoX) after residual-stream rotation: pre-norm blocks (sequential,
or parallel as GPT-NeoX) with learned absolute positions or rotary embeddings (GPT-NeoX's own, imported
from transformers), biases everywhere, and RMSNorms without weight (see ``configuration_rms_decoder``).

After ProcrustesGPT compression (``hf-symmetry compress --structure kron|gs|lowrank``) the linears that
read or write the stream, the token embedding and the head may be structured (Kronecker sums,
group-and-shuffle, low rank: factorised forward passes, the dense matrix is never formed), and with one
basis per residual segment every skip connection carries an orthogonal matrix; the config says which
(``layer_structures``, ``embed_structure``, ``lm_head_structure``, ``skip_connections``). Biases stay dense.

This file is copied next to saved checkpoints for ``trust_remote_code`` loading: it imports only
torch, transformers and its siblings ``configuration_rms_decoder`` and ``structured_linear`` (the structured
linears and orthogonal skips, shared with the compressed family).
"""

import dataclasses
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
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_rms_decoder import RMSDecoderConfig
from .structured_linear import (
    OrthogonalSkip,
    StructuredEmbedding,
    StructuredLinear,
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


# Copied from hf_symmetry.modeling.modeling_compressed_llama.renamed_cache_kwarg
def renamed_cache_kwarg(forward):
    """``forward`` taking the KV cache as ``cache`` or ``past_key_values``: where the installed transformers
    names it ``cache`` (5.24 and later) the old name is deprecated as in its own models (a warning), before
    that it is the name ``generate`` passes (no warning)."""
    if CACHE_FIELD != "cache":
        return forward
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)


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
def _linear(in_features: int, out_features: int, bias: bool, entry: dict | None) -> nn.Module:
    """``nn.Linear`` where the config gives no structure (or a dense one), else the structured module."""
    if entry is None or entry.get("type", "dense") == "dense":
        return nn.Linear(in_features, out_features, bias=bias)
    return structured_linear(in_features, out_features, {**entry, "bias": bias})


def _layer_entry(config: RMSDecoderConfig, layer_idx: int, name: str) -> dict | None:
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
        entry = lambda name: _layer_entry(config, layer_idx, name)  # noqa: E731
        self.q_proj = _linear(r, inner, config.attention_bias, entry("q_proj"))
        self.k_proj = _linear(r, inner, config.attention_bias, entry("k_proj"))
        self.v_proj = _linear(r, inner, config.attention_bias, entry("v_proj"))
        self.o_proj = _linear(inner, r, config.attention_bias, entry("o_proj"))

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
        self.up_proj = _linear(r, h, config.mlp_bias, _layer_entry(config, layer_idx, "up_proj"))
        self.down_proj = _linear(h, r, config.mlp_bias, _layer_entry(config, layer_idx, "down_proj"))
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
        if isinstance(module, (StructuredLinear, StructuredEmbedding, OrthogonalSkip)):
            module.init_weights(self.config.initializer_range)  # each structure knows its own
        else:
            super()._init_weights(module)


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
