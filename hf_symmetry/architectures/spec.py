"""Declarative descriptions of where things live in each supported checkpoint family.

A spec names tensors relative to a layer prefix; nothing here computes. The adapter
(:mod:`hf_symmetry.architectures.adapter`) combines a spec with a model config to read a
layer into the canonical form the symmetry engine works on, and to write it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

NormKind = Literal["rms", "layer"]
Placement = Literal["pre", "post"]
RopeLayout = Literal["rotate_half", "interleaved", "none"]


@dataclass(frozen=True)
class NormSpec:
    """A norm and the linear modules that read its output (the ones its γ folds into)."""
    name: str
    readers: tuple[str, ...]


@dataclass(frozen=True)
class AttentionSpec:
    q: str | None = None       # separate projections (nn.Linear, [out, in])
    k: str | None = None
    v: str | None = None
    qkv: str | None = None     # fused projection: rows (or Conv1D columns) are [q | k | v]
    o: str = ""
    qk_norm: tuple[str, str] | None = None  # per-head RMSNorms on q and k (Qwen3, OLMo2)


@dataclass(frozen=True)
class FFNSpec:
    up: str
    down: str
    gate: str | None = None    # gated (SwiGLU) FFNs: gate and up permute together


@dataclass(frozen=True)
class ArchSpec:
    """One checkpoint family. Tensor names are relative to ``layer_prefix`` (for layers)
    or absolute after the base prefix (for globals)."""
    family: str
    model_types: tuple[str, ...]
    layers: str                              # e.g. "model.layers"; layer i is f"{layers}.{i}."
    embed: str                               # token embedding module
    attention: AttentionSpec
    ffn: FFNSpec
    attn_norm: NormSpec                      # pre-LN: norm before attention; post-LN: after it
    ffn_norm: NormSpec
    norm_kind: NormKind
    placement: Placement
    final_norm: str | None                   # pre-LN families only
    lm_head: str | None                      # None: encoder without a head in the base model
    pos_embed: tuple[str, ...] = ()          # learned absolute position / token-type embeddings
    embed_norm: str | None = None            # BERT's embedding LayerNorm
    conv1d: bool = False                     # GPT-2 stores Linear weights as [in, out]
    base_prefixes: tuple[str, ...] = ("",)   # prefixes a task head wrapper adds (e.g. "bert.")
    sandwich_norms: bool = False             # norms on sublayer outputs (Gemma2/3)
    # config attribute names (first one present wins)
    n_layers_attr: tuple[str, ...] = ("num_hidden_layers",)
    hidden_attr: tuple[str, ...] = ("hidden_size",)
    heads_attr: tuple[str, ...] = ("num_attention_heads",)
    kv_heads_attr: tuple[str, ...] = ("num_key_value_heads",)
    eps_attr: tuple[str, ...] = ("rms_norm_eps",)
    rope: RopeLayout = "none"
    extra_refusals: dict[str, str] = field(default_factory=dict)

    @property
    def is_gated(self) -> bool:
        return self.ffn.gate is not None


_LLAMA_ATTN = AttentionSpec(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj")
_LLAMA_FFN = FFNSpec(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")


def _llama_like(family: str, model_types: tuple[str, ...], attention: AttentionSpec = _LLAMA_ATTN) -> ArchSpec:
    return ArchSpec(
        family=family, model_types=model_types, layers="model.layers", embed="model.embed_tokens",
        attention=attention, ffn=_LLAMA_FFN,
        attn_norm=NormSpec("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ffn_norm=NormSpec("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        norm_kind="rms", placement="pre", final_norm="model.norm", lm_head="lm_head", rope="rotate_half")


LLAMA = _llama_like("llama", ("llama", "mistral"))
# SmolLM3: Llama weights; every 4th layer is NoPE (``no_rope_layers``, see Adapter.layer_layout)
SMOLLM3 = _llama_like("smollm3", ("smollm3",))
QWEN2 = _llama_like("qwen2", ("qwen2",))  # q/k/v biases are found in the checkpoint itself
QWEN3 = _llama_like("qwen3", ("qwen3",), AttentionSpec(
    q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
    qk_norm=("self_attn.q_norm", "self_attn.k_norm")))

GPT2 = ArchSpec(
    family="gpt2", model_types=("gpt2",), layers="transformer.h", embed="transformer.wte",
    attention=AttentionSpec(qkv="attn.c_attn", o="attn.c_proj"),
    ffn=FFNSpec(up="mlp.c_fc", down="mlp.c_proj"),
    attn_norm=NormSpec("ln_1", ("attn.c_attn",)), ffn_norm=NormSpec("ln_2", ("mlp.c_fc",)),
    norm_kind="layer", placement="pre", final_norm="transformer.ln_f", lm_head="lm_head",
    pos_embed=("transformer.wpe",), conv1d=True,
    n_layers_attr=("n_layer", "num_hidden_layers"), hidden_attr=("n_embd", "hidden_size"),
    heads_attr=("n_head", "num_attention_heads"), kv_heads_attr=(), eps_attr=("layer_norm_epsilon",))

OPT = ArchSpec(
    family="opt", model_types=("opt",), layers="model.decoder.layers", embed="model.decoder.embed_tokens",
    attention=AttentionSpec(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.out_proj"),
    ffn=FFNSpec(up="fc1", down="fc2"),
    attn_norm=NormSpec("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ffn_norm=NormSpec("final_layer_norm", ("fc1",)),
    norm_kind="layer", placement="pre", final_norm="model.decoder.final_layer_norm", lm_head="lm_head",
    pos_embed=("model.decoder.embed_positions",), n_layers_attr=("num_hidden_layers",),
    kv_heads_attr=(), eps_attr=())

# GPT-J: parallel attention + FFN fed by one LayerNorm, and interleaved partial RoPE (the
# first ``rotary_dim`` dims of each head, pairs (2i, 2i+1)). Both canonical norms name ln_1;
# the adapter refuses to write them back if they ever differ.
GPTJ = ArchSpec(
    family="gptj", model_types=("gptj",), layers="transformer.h", embed="transformer.wte",
    attention=AttentionSpec(q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj"),
    ffn=FFNSpec(up="mlp.fc_in", down="mlp.fc_out"),
    attn_norm=NormSpec("ln_1", ("attn.q_proj", "attn.k_proj", "attn.v_proj")),
    ffn_norm=NormSpec("ln_1", ("mlp.fc_in",)),
    norm_kind="layer", placement="pre", final_norm="transformer.ln_f", lm_head="lm_head", rope="interleaved",
    n_layers_attr=("n_layer",), hidden_attr=("n_embd",), heads_attr=("n_head",), kv_heads_attr=(),
    eps_attr=("layer_norm_epsilon",))

BERT = ArchSpec(
    family="bert", model_types=("bert", "roberta"), layers="encoder.layer", embed="embeddings.word_embeddings",
    attention=AttentionSpec(q="attention.self.query", k="attention.self.key", v="attention.self.value",
                            o="attention.output.dense"),
    ffn=FFNSpec(up="intermediate.dense", down="output.dense"),
    attn_norm=NormSpec("attention.output.LayerNorm", ()), ffn_norm=NormSpec("output.LayerNorm", ()),
    norm_kind="layer", placement="post", final_norm=None, lm_head=None,
    pos_embed=("embeddings.position_embeddings", "embeddings.token_type_embeddings"),
    embed_norm="embeddings.LayerNorm", base_prefixes=("", "bert.", "roberta."),
    kv_heads_attr=(), eps_attr=("layer_norm_eps",))

SPECS: tuple[ArchSpec, ...] = (LLAMA, QWEN2, QWEN3, SMOLLM3, GPT2, OPT, GPTJ, BERT)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for s in SPECS for t in s.model_types)


def spec_for_model_type(model_type: str) -> ArchSpec:
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    raise ValueError(
        f"unsupported model_type {model_type!r}; hf_symmetry supports: {', '.join(SUPPORTED_MODEL_TYPES)}")
