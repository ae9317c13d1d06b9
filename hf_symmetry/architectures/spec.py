"""Declarative descriptions of each supported checkpoint family: where its tensors live, and
its structural facts, each stated once.

A spec names tensors relative to a layer prefix; nothing here computes. The adapter
(:mod:`hf_symmetry.architectures.adapter`) combines a spec with a model config to read a
layer into the canonical form the symmetry engine works on, and to write it back;
:mod:`hf_symmetry.architectures.capabilities` derives from the facts which symmetries and
conversions a family allows, and why not where it does not.

Facts that vary between checkpoints of one family (sliding windows, NoPE layers, soft-capping,
tied embeddings, partial rotary) are read from the config by the capabilities module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# rms: x/rms(x)·γ; rms_1p: x/rms(x)·(1+w) (Gemma stores w = γ-1); layer: LayerNorm (γ, β)
NormKind = Literal["rms", "rms_1p", "layer"]
# pre: a norm on each sublayer's input only; sandwich: also one on its output, before the
# residual add (Gemma2/3); output: only on its output (OLMo2); post: on the residual stream
# after the add (BERT's post-LN)
NormPosition = Literal["pre", "sandwich", "output", "post"]
RopeLayout = Literal["rotate_half", "interleaved", "none"]


@dataclass(frozen=True)
class NormSpec:
    """A norm and the linear modules that read its output (the ones its γ folds into)."""

    name: str
    readers: tuple[str, ...]


@dataclass(frozen=True)
class AttentionSpec:
    q: str | None = None  # separate projections (nn.Linear, [out, in])
    k: str | None = None
    v: str | None = None
    qkv: str | None = None  # fused projection (rows, or Conv1D columns), see qkv_layout
    o: str = ""
    qk_norm: tuple[str, str] | None = None  # RMSNorms on q and k (Qwen3, Gemma3, OLMo2)
    qk_norm_scope: Literal["head", "all"] = "head"  # one γ per head dim, or over all heads (OLMo2)
    # blocks: [q | k | v]; per_head: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (GPT-NeoX)
    qkv_layout: Literal["blocks", "per_head"] = "blocks"


@dataclass(frozen=True)
class FFNSpec:
    up: str | None
    down: str
    gate: str | None = None  # gated (SwiGLU) FFNs: gate and up permute together
    gate_up: str | None = None  # fused gated projection, rows [gate | up] (Phi-3)


@dataclass(frozen=True)
class ArchSpec:
    """One checkpoint family. Tensor names are relative to ``layer_prefix`` (for layers)
    or absolute after the base prefix (for globals)."""

    family: str
    model_types: tuple[str, ...]
    layers: str  # e.g. "model.layers"; layer i is f"{layers}.{i}."
    embed: str  # token embedding module
    attention: AttentionSpec
    ffn: FFNSpec
    attn_norm: NormSpec  # pre-LN/sandwich: on the attention input; post/output: after it
    ffn_norm: NormSpec
    norm_kind: NormKind
    norm_position: NormPosition
    final_norm: str | None  # pre-LN families only
    lm_head: str | None  # None: encoder without a head in the base model
    lm_head_aliases: tuple[str, ...] = ()  # the head's name in checkpoints, where it differs (GPT-NeoX: embed_out)
    pos_embed: tuple[str, ...] = ()  # learned absolute position / token-type embeddings
    embed_norm: str | None = None  # BERT's embedding LayerNorm
    conv1d: bool = False  # GPT-2 stores Linear weights as [in, out]
    base_prefixes: tuple[str, ...] = ("",)  # prefixes a task head wrapper adds (e.g. "bert.")
    output_norms: tuple[str, str] | None = None  # sandwich: the norms on attention/FFN outputs
    embed_scale: Literal["none", "sqrt_hidden"] = "none"  # Gemma multiplies embeddings by √hidden
    parallel_block: bool = False  # attention and FFN both read the layer input (GPT-J)
    parallel_attr: str | None = None  # config flag that switches the parallel block (GPT-NeoX)
    rope_attr: str | None = None  # config flag that switches ``rope`` on (else no RoPE, e.g. learned positions)
    positions_from_mask: bool = False  # learned positions counted over the attention mask (OPT)
    # config attribute names (first one present wins)
    n_layers_attr: tuple[str, ...] = ("num_hidden_layers",)
    hidden_attr: tuple[str, ...] = ("hidden_size",)
    heads_attr: tuple[str, ...] = ("num_attention_heads",)
    kv_heads_attr: tuple[str, ...] = ("num_key_value_heads",)
    eps_attr: tuple[str, ...] = ("rms_norm_eps",)
    rope: RopeLayout = "none"
    # Stock outputs (conversion.compress.stock, conversion.gguf_export). stock_slice: the stock RMSNorm is
    # γ·x·rsqrt(mean(x²) + rms_norm_eps) and the config takes an explicit head_dim (the sliced hidden size
    # no longer fixes it), so stock SliceGPT writes the family's own class.
    stock_slice: bool = False
    # the stock model_type written where the sliced width is not a multiple of the heads (the family's
    # config refuses that width), with ``narrow_stock_drop`` and ``bias_attrs`` left out and no sliding
    # window; a source already of that type stays as it is (Llama -> Mistral)
    narrow_stock_type: str | None = None
    narrow_stock_drop: tuple[str, ...] = ()  # config keys the narrow stock type does not take
    bias_attrs: tuple[str, ...] = ()  # config flags that switch on attention / MLP biases (Llama), which
    # neither the narrow stock type nor the GGUF architecture holds
    window_attr: str | None = None  # config key of one sliding window over every layer (Mistral), which
    # the GGUF architecture does not hold
    gguf_arch: str | None = None  # GGUF (llama.cpp) architecture name; None: export-gguf refuses
    gguf_permute_qk: bool = False  # q/k rows reordered from rotate-half to GGML's interleaved RoPE

    @property
    def is_gated(self) -> bool:
        return self.ffn.gate is not None or self.ffn.gate_up is not None

    @property
    def is_decoder(self) -> bool:
        return self.lm_head is not None

    def rope_in(self, config) -> str:
        """The RoPE layout of a checkpoint with ``config`` (dict or object): ``rope``, unless the
        family switches it with ``rope_attr`` and this config does not."""
        if self.rope == "none" or self.rope_attr is None:
            return self.rope
        on = config.get(self.rope_attr) if isinstance(config, dict) else getattr(config, self.rope_attr, None)
        return self.rope if on else "none"

    @property
    def sandwich_norms(self) -> bool:
        """A norm sits on each sublayer's output, before the residual add."""
        return self.norm_position in ("sandwich", "output")


_LLAMA_ATTN = AttentionSpec(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj")
_LLAMA_FFN = FFNSpec(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")


def _llama_like(family: str, model_types: tuple[str, ...], attention: AttentionSpec = _LLAMA_ATTN, **facts) -> ArchSpec:
    return ArchSpec(
        family=family,
        model_types=model_types,
        layers="model.layers",
        embed="model.embed_tokens",
        attention=attention,
        ffn=_LLAMA_FFN,
        attn_norm=NormSpec("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ffn_norm=NormSpec("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        norm_kind="rms",
        norm_position="pre",
        final_norm="model.norm",
        lm_head="lm_head",
        rope="rotate_half",
        **facts,
    )


# Mistral is GGUF ``llama`` (as llama.cpp's converter writes it), q/k rows permuted
LLAMA = _llama_like(
    "llama",
    ("llama", "mistral"),
    stock_slice=True,
    narrow_stock_type="mistral",
    narrow_stock_drop=("pretraining_tp",),
    bias_attrs=("attention_bias", "mlp_bias"),
    window_attr="sliding_window",
    gguf_arch="llama",
    gguf_permute_qk=True,
)
# SmolLM3: Llama weights; every 4th layer is NoPE (``no_rope_layers``, see Adapter.layer_layout)
SMOLLM3 = _llama_like("smollm3", ("smollm3",))
QWEN2 = _llama_like("qwen2", ("qwen2",), stock_slice=True, gguf_arch="qwen2")  # q/k/v biases: found in the checkpoint
QWEN3 = _llama_like(
    "qwen3",
    ("qwen3",),
    AttentionSpec(
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.o_proj",
        qk_norm=("self_attn.q_norm", "self_attn.k_norm"),
    ),
    stock_slice=True,
    gguf_arch="qwen3",
)

GPT2 = ArchSpec(
    family="gpt2",
    model_types=("gpt2",),
    layers="transformer.h",
    embed="transformer.wte",
    attention=AttentionSpec(qkv="attn.c_attn", o="attn.c_proj"),
    ffn=FFNSpec(up="mlp.c_fc", down="mlp.c_proj"),
    attn_norm=NormSpec("ln_1", ("attn.c_attn",)),
    ffn_norm=NormSpec("ln_2", ("mlp.c_fc",)),
    norm_kind="layer",
    norm_position="pre",
    final_norm="transformer.ln_f",
    lm_head="lm_head",
    pos_embed=("transformer.wpe",),
    conv1d=True,
    n_layers_attr=("n_layer", "num_hidden_layers"),
    hidden_attr=("n_embd", "hidden_size"),
    heads_attr=("n_head", "num_attention_heads"),
    kv_heads_attr=(),
    eps_attr=("layer_norm_epsilon",),
)

OPT = ArchSpec(
    family="opt",
    model_types=("opt",),
    layers="model.decoder.layers",
    embed="model.decoder.embed_tokens",
    attention=AttentionSpec(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.out_proj"),
    ffn=FFNSpec(up="fc1", down="fc2"),
    attn_norm=NormSpec("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ffn_norm=NormSpec("final_layer_norm", ("fc1",)),
    norm_kind="layer",
    norm_position="pre",
    final_norm="model.decoder.final_layer_norm",
    lm_head="lm_head",
    pos_embed=("model.decoder.embed_positions",),
    n_layers_attr=("num_hidden_layers",),
    kv_heads_attr=(),
    eps_attr=(),
    positions_from_mask=True,
)

# GPT-J: parallel attention + FFN fed by one LayerNorm, and interleaved partial RoPE (the
# first ``rotary_dim`` dims of each head, pairs (2i, 2i+1)). Both canonical norms name ln_1;
# the adapter refuses to write them back if they ever differ.
GPTJ = ArchSpec(
    family="gptj",
    model_types=("gptj",),
    layers="transformer.h",
    embed="transformer.wte",
    attention=AttentionSpec(q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj"),
    ffn=FFNSpec(up="mlp.fc_in", down="mlp.fc_out"),
    attn_norm=NormSpec("ln_1", ("attn.q_proj", "attn.k_proj", "attn.v_proj")),
    ffn_norm=NormSpec("ln_1", ("mlp.fc_in",)),
    norm_kind="layer",
    norm_position="pre",
    final_norm="transformer.ln_f",
    lm_head="lm_head",
    rope="interleaved",
    parallel_block=True,
    n_layers_attr=("n_layer",),
    hidden_attr=("n_embd",),
    heads_attr=("n_head",),
    kv_heads_attr=(),
    eps_attr=("layer_norm_epsilon",),
)

# Gemma 2: RMSNorm with (1+w), sandwich norms, embeddings × √hidden, attention and final
# logit soft-capping, alternating sliding-window/global layers (``layer_types``).
_GEMMA_NORMS = dict(
    attn_norm=NormSpec("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ffn_norm=NormSpec("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    norm_kind="rms_1p",
    norm_position="sandwich",
    embed_scale="sqrt_hidden",
)
GEMMA2 = ArchSpec(
    family="gemma2",
    model_types=("gemma2",),
    layers="model.layers",
    embed="model.embed_tokens",
    attention=_LLAMA_ATTN,
    ffn=_LLAMA_FFN,
    final_norm="model.norm",
    lm_head="lm_head",
    rope="rotate_half",
    **_GEMMA_NORMS,
)
# Gemma 3 (text): Gemma 2 plus per-head QK-norm (also (1+w)).
GEMMA3 = ArchSpec(
    family="gemma3",
    model_types=("gemma3_text",),
    layers="model.layers",
    embed="model.embed_tokens",
    attention=AttentionSpec(
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.o_proj",
        qk_norm=("self_attn.q_norm", "self_attn.k_norm"),
    ),
    ffn=_LLAMA_FFN,
    final_norm="model.norm",
    lm_head="lm_head",
    rope="rotate_half",
    **_GEMMA_NORMS,
)

# Phi-3 and Phi-4 (model_type phi3): Llama with fused qkv_proj [q | k | v] and gate_up_proj [gate | up].
PHI3 = ArchSpec(
    family="phi3",
    model_types=("phi3",),
    layers="model.layers",
    embed="model.embed_tokens",
    attention=AttentionSpec(qkv="self_attn.qkv_proj", o="self_attn.o_proj"),
    ffn=FFNSpec(up=None, gate_up="mlp.gate_up_proj", down="mlp.down_proj"),
    attn_norm=NormSpec("input_layernorm", ("self_attn.qkv_proj",)),
    ffn_norm=NormSpec("post_attention_layernorm", ("mlp.gate_up_proj",)),
    norm_kind="rms",
    norm_position="pre",
    final_norm="model.norm",
    lm_head="lm_head",
    rope="rotate_half",
    stock_slice=True,
)

# OLMo 2: no input norms; each sublayer's output is normalised before the residual add, and
# QK-norm spans all heads at once (one γ over num_heads·head_dim).
OLMO2 = ArchSpec(
    family="olmo2",
    model_types=("olmo2",),
    layers="model.layers",
    embed="model.embed_tokens",
    attention=AttentionSpec(
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.o_proj",
        qk_norm=("self_attn.q_norm", "self_attn.k_norm"),
        qk_norm_scope="all",
    ),
    ffn=_LLAMA_FFN,
    attn_norm=NormSpec("post_attention_layernorm", ()),
    ffn_norm=NormSpec("post_feedforward_layernorm", ()),
    norm_kind="rms",
    norm_position="output",
    final_norm="model.norm",
    lm_head="lm_head",
    rope="rotate_half",
)

# GPT-NeoX / Pythia: LayerNorm, fused query_key_value laid out per head, partial rotary
# (rotate_half on the first rotary dims of each head), parallel block by default.
GPT_NEOX = ArchSpec(
    family="gpt_neox",
    model_types=("gpt_neox",),
    layers="gpt_neox.layers",
    embed="gpt_neox.embed_in",
    attention=AttentionSpec(qkv="attention.query_key_value", o="attention.dense", qkv_layout="per_head"),
    ffn=FFNSpec(up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h"),
    attn_norm=NormSpec("input_layernorm", ("attention.query_key_value",)),
    ffn_norm=NormSpec("post_attention_layernorm", ("mlp.dense_h_to_4h",)),
    norm_kind="layer",
    norm_position="pre",
    final_norm="gpt_neox.final_layer_norm",
    lm_head="lm_head",
    rope="rotate_half",
    parallel_attr="use_parallel_residual",
    kv_heads_attr=(),
    eps_attr=("layer_norm_eps",),
    lm_head_aliases=("embed_out",),
)

BERT = ArchSpec(
    family="bert",
    model_types=("bert", "roberta"),
    layers="encoder.layer",
    embed="embeddings.word_embeddings",
    attention=AttentionSpec(
        q="attention.self.query", k="attention.self.key", v="attention.self.value", o="attention.output.dense"
    ),
    ffn=FFNSpec(up="intermediate.dense", down="output.dense"),
    attn_norm=NormSpec("attention.output.LayerNorm", ()),
    ffn_norm=NormSpec("output.LayerNorm", ()),
    norm_kind="layer",
    norm_position="post",
    final_norm=None,
    lm_head=None,
    pos_embed=("embeddings.position_embeddings", "embeddings.token_type_embeddings"),
    embed_norm="embeddings.LayerNorm",
    base_prefixes=("", "bert.", "roberta."),
    kv_heads_attr=(),
    eps_attr=("layer_norm_eps",),
)

# A LayerNorm decoder (OPT, GPT-2, GPT-NeoX) after mean-centring and residual rotation
# (hf_symmetry.modeling.modeling_rms_decoder): its RMSNorms have no weight, so no norm tensors. Its
# residual stream is ``residual_size`` wide (narrower than hidden_size after SliceGPT); ``rotary``
# switches GPT-NeoX's rotary embeddings on (instead of learned positions), ``parallel_block`` its block.
RMS_DECODER = ArchSpec(
    family="rms_decoder",
    model_types=("hf_symmetry_rms_decoder",),
    layers="model.layers",
    embed="model.embed_tokens",
    attention=_LLAMA_ATTN,
    ffn=FFNSpec(up="mlp.up_proj", down="mlp.down_proj"),
    attn_norm=NormSpec("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ffn_norm=NormSpec("post_attention_layernorm", ("mlp.up_proj",)),
    norm_kind="rms",
    norm_position="pre",
    final_norm="model.norm",
    lm_head="lm_head",
    pos_embed=("model.embed_positions",),
    kv_heads_attr=(),
    positions_from_mask=True,
    hidden_attr=("residual_size", "hidden_size"),
    rope="rotate_half",
    rope_attr="rotary",
    parallel_attr="parallel_block",
)

SPECS: tuple[ArchSpec, ...] = (
    LLAMA,
    QWEN2,
    QWEN3,
    SMOLLM3,
    GEMMA2,
    GEMMA3,
    PHI3,
    OLMO2,
    GPT2,
    OPT,
    GPTJ,
    GPT_NEOX,
    BERT,
    RMS_DECODER,
)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for s in SPECS for t in s.model_types)


def find_spec(model_type) -> ArchSpec | None:
    """The spec of ``model_type``, or None where no spec reads it (e.g. a remote-code family)."""
    return next((s for s in SPECS if model_type in s.model_types), None)


def spec_for_model_type(model_type: str) -> ArchSpec:
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    raise ValueError(f"unsupported model_type {model_type!r}; hf_symmetry supports: {', '.join(SUPPORTED_MODEL_TYPES)}")
