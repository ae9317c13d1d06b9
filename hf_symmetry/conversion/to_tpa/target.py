"""The TPA family as the target of a conversion: what it can express (the refusals made before any
work), the ranks, the :class:`TPAConfig` of a source and the config and remote code written with it."""

from __future__ import annotations

import copy


from ...architectures import Adapter
from ...architectures.capabilities import require
from ...modeling.configuration_tpa import TPAConfig
from ...modeling.modeling_tpa import TPAForCausalLM


def check_supported(model) -> None:
    """Refuse (ValueError, with the structural reason) anything the TPA family cannot express."""
    require(model.config, "to_tpa")


def check_ranks(adapter: Adapter, k_rank: int | None, v_rank: int | None) -> tuple[int, int]:
    """The ranks to use (default: full, exact), after refusing impossible or inexpressible ones."""
    n_kv = adapter.layout.n_kv_heads
    for name, r in (("k_rank", k_rank), ("v_rank", v_rank)):
        if r is not None and not 1 <= r <= n_kv:
            raise ValueError(
                f"{name} must be in [1, num_key_value_heads={n_kv}] (rank {n_kv} is already exact), got {r}"
            )
    k_rank = n_kv if k_rank is None else int(k_rank)
    v_rank = n_kv if v_rank is None else int(v_rank)
    if k_rank < n_kv:
        require(adapter, "to_tpa_key_rank")
    return k_rank, v_rank


def heads(adapter: Adapter) -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, head_dim)``, refusing heads that do not group."""
    L = adapter.layout
    if L.n_heads % L.n_kv_heads:
        raise ValueError(f"num_attention_heads ({L.n_heads}) is not a multiple of num_key_value_heads ({L.n_kv_heads})")
    return L.n_heads, L.n_kv_heads, L.head_dim


def tpa_config_from(
    source_config,
    k_rank: int,
    v_rank: int,
    attention_bias: bool,
    attention_out_bias: bool,
    mlp_bias: bool,
    qk_norm: bool = False,
) -> TPAConfig:
    h, _, dh = heads(Adapter.from_config(source_config))
    c = source_config
    return TPAConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=h,
        head_dim=dh,
        q_rank=None,
        k_rank=k_rank,
        v_rank=v_rank,
        contextual_a=False,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=float(getattr(c, "initializer_range", 0.02)),
        rms_norm_eps=float(c.rms_norm_eps),
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        rope_parameters=copy.deepcopy(dict(c.rope_parameters)),
        attention_bias=attention_bias,
        attention_out_bias=attention_out_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
    )


def source_biases(canon0: dict) -> dict:
    """The TPA config flags that follow from the source's first layer (canonical tensors)."""
    return {
        "attention_bias": "q.bias" in canon0 or "k.bias" in canon0 or "v.bias" in canon0,
        "attention_out_bias": "o.bias" in canon0,
        "mlp_bias": "gate.bias" in canon0 or "up.bias" in canon0,
        "qk_norm": "q_norm.weight" in canon0,
    }


def empty_model(config: TPAConfig) -> TPAForCausalLM:
    """A TPA model whose weights are about to be overwritten: skip the (slow) random initialisation."""
    try:
        from transformers.initialization import no_init_weights  # optional dependency
    except ImportError:  # older transformers: just initialise
        return TPAForCausalLM(config)
    with no_init_weights():
        return TPAForCausalLM(config)
