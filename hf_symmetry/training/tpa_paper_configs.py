"""Equal-parameter configurations of T6 (TPA), Llama MHA, Llama GQA and MLA, as in the TPA paper.

Zhang et al. ("Tensor Product Attention Is All You Need", §4.1 and Appendix B.1) compare attention
mechanisms at equal size: every model has the same depth, width and SwiGLU FFN; ``d_h = 64``
everywhere; GQA keeps 2 KV heads, MLA a 32-dim RoPE key, TPA ranks ``R_Q = 6, R_K = R_V = 2``; and
*the number of heads* of each mechanism is chosen so that its attention has the parameters of MHA
(``4 d_model²`` per layer). :func:`equal_size_configs` does exactly that from a target size
(parameters without embeddings):

* width and depth: ``d_model`` a multiple of 64 near ``(16 N / 3)^(1/3)`` (the paper's small model has
  ``d_model / layers = 64``), then the depth that brings the MHA model closest to ``N``;
* MHA: ``h = d_model / 64``; GQA: ``h = 2 d_model / 64 - 2`` query heads, 2 KV heads (exactly equal);
  T6: ``h = (4 d_model - 64 R) / (R + 64)`` with ``R = R_Q + R_K + R_V``, rounded; MLA (transformers'
  DeepSeek-V3 attention with the MoE switched off: every layer dense, no multi-token-prediction head;
  query latent ``d_c' = d_model``, KV latent ``d_c = d_model / 2``, the paper's medium/large ratios):
  heads rounded likewise, then the KV latent re-solved for the rounded heads (needed at small widths);
* GQA is a ``LlamaConfig`` where the head count divides ``d_model``, otherwise a ``MistralConfig``
  without sliding window (the same network; ``LlamaConfig`` refuses such head counts);
* everything else is shared: FFN width ``64 ⌈8 d_model / 3 / 64⌉``, RMSNorm, RoPE θ, no biases, tied
  embeddings.

Parameter counts are measured on the instantiated models (on the meta device, so nothing is
allocated) and must agree within ``tolerance`` (1 %); :func:`equal_size_configs` raises otherwise.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, MistralConfig

from ..modeling.configuration_tpa import TPAConfig
from ..modeling.modeling_tpa import TPAForCausalLM

ARCHS = ("t6", "mha", "gqa", "mla")
HEAD_DIM = 64
GQA_KV_HEADS = 2
TPA_RANKS = (6, 2, 2)
MLA_ROPE_DIM = 32

__all__ = [
    "ARCHS",
    "ArchConfigs",
    "equal_size_configs",
    "parse_parameter_count",
    "count_non_embedding_parameters",
    "kv_cache_elements",
    "build_model",
]


def parse_parameter_count(text: str | int | float) -> int:
    """``"20M"``, ``"1.5B"``, ``"800k"`` or a plain number -> an integer parameter count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBgG]?)\s*", str(text))
        if not m:
            raise ValueError(f"size {text!r} is not a number with an optional k/M/B suffix (e.g. 20M)")
        value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}[m.group(2).lower()]
    if value < 1e5:
        raise ValueError(f"size {text!r} is too small: at least 100k parameters without embeddings")
    return int(round(value))


def ffn_width(hidden: int) -> int:
    return 64 * math.ceil(8 * hidden / 3 / 64)


def _mlp_params(d: int) -> int:
    return 3 * d * ffn_width(d)


def _mha_layer(d: int) -> int:
    return 4 * d * d + _mlp_params(d) + 2 * d


def _shape_for(target: int) -> tuple[int, int]:
    """(d_model, layers) with d_model a multiple of 64 and the MHA count closest to ``target``, keeping
    d_model / layers near 64 (the paper's small model)."""
    best = None
    for d in range(192, 8193, 64):
        layers = max(1, round((target - d) / _mha_layer(d)))
        err = abs(layers * _mha_layer(d) + d - target) / target
        aspect = abs(math.log((d / layers) / 64.0))
        score = err + 0.2 * aspect
        if best is None or score < best[0]:
            best = (score, d, layers)
    return best[1], best[2]


def _tpa_heads(d: int) -> int:
    r = sum(TPA_RANKS)
    return max(1, round((4 * d - HEAD_DIM * r) / (r + HEAD_DIM)))


def _mla_attention_params(d: int, h: int, q_latent: int, kv_latent: int) -> int:
    qk = HEAD_DIM + MLA_ROPE_DIM
    return (
        d * q_latent
        + q_latent
        + q_latent * h * qk
        + d * (kv_latent + MLA_ROPE_DIM)
        + kv_latent
        + kv_latent * h * 2 * HEAD_DIM
        + h * HEAD_DIM * d
    )


def _mla_shape(d: int) -> tuple[int, int, int]:
    """(heads, query latent, KV latent): heads for ``4 d²`` with latents ``d`` and ``d/2``, then the KV
    latent re-solved for the rounded head count (at small widths one head is several percent of the
    attention, so rounding the heads alone would miss the 1 % target)."""
    q_latent, kv_latent = d, d // 2
    fixed = _mla_attention_params(d, 0, q_latent, kv_latent)
    per_head = _mla_attention_params(d, 1, q_latent, kv_latent) - fixed
    h = max(1, round((4 * d * d - fixed) / per_head))
    base = _mla_attention_params(d, h, q_latent, 0)
    per_kv = _mla_attention_params(d, h, q_latent, 1) - base
    kv_latent = max(16, round((4 * d * d - base) / per_kv))
    return h, q_latent, kv_latent


@dataclass
class ArchConfigs:
    """The four configurations and their measured sizes."""

    hidden_size: int
    num_hidden_layers: int
    configs: dict  # arch -> PreTrainedConfig
    parameters: dict  # arch -> parameters without embeddings
    target: int

    def table(self) -> str:
        """A printable comparison: heads, parameters (and deviation from MHA), KV-cache elements/token."""
        ref = self.parameters["mha"]
        rows = [
            f"d_model {self.hidden_size}, {self.num_hidden_layers} layers, FFN {ffn_width(self.hidden_size)}, "
            f"target {self.target / 1e6:.2f} M parameters without embeddings"
        ]
        for arch in self.configs:
            cfg = self.configs[arch]
            n = self.parameters[arch]
            rows.append(
                f"  {arch:4s} heads {cfg.num_attention_heads:3d}  params {n / 1e6:8.3f} M "
                f"({100 * (n - ref) / ref:+.2f} % vs MHA)  KV cache {kv_cache_elements(cfg)} elements/token"
            )
        return "\n".join(rows)


def _common(d: int, layers: int, vocab_size: int, max_position_embeddings: int, rope_theta: float, extra: dict):
    return dict(
        vocab_size=vocab_size,
        hidden_size=d,
        intermediate_size=ffn_width(d),
        num_hidden_layers=layers,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        **extra,
    )


def make_config(
    arch: str,
    hidden_size: int,
    num_hidden_layers: int,
    vocab_size: int,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    **token_ids,
):
    """One architecture's configuration at the given width and depth (heads chosen for equal size)."""
    d = hidden_size
    if d % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {d}")
    common = _common(d, num_hidden_layers, vocab_size, max_position_embeddings, rope_theta, token_ids)
    if arch == "mha":
        h = d // HEAD_DIM
        return LlamaConfig(
            num_attention_heads=h,
            num_key_value_heads=h,
            head_dim=HEAD_DIM,
            attention_bias=False,
            mlp_bias=False,
            **common,
        )
    if arch == "gqa":
        h = 2 * d // HEAD_DIM - GQA_KV_HEADS
        if d % h == 0:
            return LlamaConfig(
                num_attention_heads=h,
                num_key_value_heads=GQA_KV_HEADS,
                head_dim=HEAD_DIM,
                attention_bias=False,
                mlp_bias=False,
                **common,
            )
        # LlamaConfig refuses a hidden size that the head count does not divide, even with head_dim set.
        # Mistral without a sliding window is the same network (RMSNorm, SwiGLU, RoPE, no biases).

        return MistralConfig(
            num_attention_heads=h, num_key_value_heads=GQA_KV_HEADS, head_dim=HEAD_DIM, sliding_window=None, **common
        )
    if arch == "t6":
        rq, rk, rv = TPA_RANKS
        if 4 * d <= HEAD_DIM * sum(TPA_RANKS) + HEAD_DIM:
            raise ValueError(
                f"hidden_size {d} is too small for a T6 attention of the size of MHA "
                f"(needs at least {HEAD_DIM * (sum(TPA_RANKS) + 1) // 4 + 1})"
            )
        return TPAConfig(
            num_attention_heads=_tpa_heads(d), head_dim=HEAD_DIM, q_rank=rq, k_rank=rk, v_rank=rv, **common
        )
    if arch == "mla":
        h, q_latent, kv_latent = _mla_shape(d)
        return DeepseekV3Config(
            num_attention_heads=h,
            num_key_value_heads=None,
            q_lora_rank=q_latent,
            kv_lora_rank=kv_latent,
            qk_rope_head_dim=MLA_ROPE_DIM,
            qk_nope_head_dim=HEAD_DIM,
            v_head_dim=HEAD_DIM,
            rope_interleave=False,
            attention_bias=False,
            first_k_dense_replace=num_hidden_layers,
            num_mtp_layers=0,
            n_routed_experts=1,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=ffn_width(d),
            **common,
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def build_model(config, attn_implementation: str | None = None):
    """A freshly initialised causal LM for any of the four configurations (T6 through hf_symmetry)."""
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if isinstance(config, TPAConfig):
        return TPAForCausalLM._from_config(config, **kw)
    return AutoModelForCausalLM.from_config(config, **kw)


def count_non_embedding_parameters(config) -> int:
    """Parameters without embeddings (input embedding and a tied/untied output head excluded), counted
    on the instantiated model on the meta device."""
    with torch.device("meta"):
        model = build_model(config)
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def kv_cache_elements(config, per_layer: bool = False) -> int:
    """Elements cached per token (all layers unless ``per_layer``): MHA/GQA ``2 · kv_heads · d_h``,
    MLA its KV latent plus RoPE key ``d_c + d_h^R``, T6 ``(R_K + R_V)(h + d_h)``."""
    mt = config.model_type
    if isinstance(config, TPAConfig):
        per = config.kv_cache_elements_per_token(per_layer=True)
    elif mt == "deepseek_v3":
        per = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per = 2 * config.num_key_value_heads * head_dim
    return per if per_layer else per * config.num_hidden_layers


def equal_size_configs(
    params,
    vocab_size: int,
    *,
    archs=ARCHS,
    hidden_size: int | None = None,
    num_hidden_layers: int | None = None,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    tolerance: float = 0.01,
    **token_ids,
) -> ArchConfigs:
    """The T6, MHA, GQA and MLA configurations of one size (see the module docstring).

    Args:
        params: target parameters without embeddings (``int`` or ``"20M"``).
        vocab_size: the tokenizer's vocabulary.
        archs: which of ``ARCHS`` to build (all are always counted against MHA).
        hidden_size, num_hidden_layers: override the derived width / depth.
        tolerance: the largest relative deviation of any architecture's count from MHA's.
        token_ids: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` for every config.
    Raises ``ValueError`` when an architecture cannot be built at this size or misses the tolerance.
    """
    target = parse_parameter_count(params)
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise ValueError(f"unknown architecture(s) {bad}; choose from {', '.join(ARCHS)}")
    d, layers = _shape_for(target)
    d = hidden_size or d
    if num_hidden_layers:
        layers = num_hidden_layers
    elif hidden_size:
        layers = max(1, round((target - d) / _mha_layer(d)))
    configs, counts = {}, {}
    for arch in dict.fromkeys(("mha", *archs)):
        cfg = make_config(arch, d, layers, vocab_size, max_position_embeddings, rope_theta, **token_ids)
        configs[arch], counts[arch] = cfg, count_non_embedding_parameters(cfg)
    for arch, n in counts.items():
        dev = abs(n - counts["mha"]) / counts["mha"]
        if dev > tolerance:
            raise ValueError(
                f"{arch}: {n} parameters is {100 * dev:.2f} % away from MHA's {counts['mha']} at "
                f"d_model {d} (tolerance {100 * tolerance:.1f} %); choose another size"
            )
    keep = {a: configs[a] for a in archs}
    return ArchConfigs(d, layers, keep, {a: counts[a] for a in archs} | {"mha": counts["mha"]}, target)
