"""Tiny models of every causal-LM family hf_symmetry ships, for tests/modeling/test_conformance.py: a stock
``LlamaForCausalLM`` (the control), TPA, compressed Llama (structured linears, a structured embedding,
orthogonal skips), FaRR (per-layer head dims, a NoPE layer) and the RMS decoder in an OPT-like (learned
positions counted over the mask, orthogonal skips, structured linears) and a GPT-NeoX-like (partial
rotary, parallel blocks) configuration. Hidden 48, 2 layers, vocabulary 96, float32, every parameter
non-trivial (O(1) logits, so that wrong outputs show)."""

from __future__ import annotations

import math

import torch

V = 96
PAD = 0
FAMILIES = ("llama", "tpa", "compressed", "farr", "rms-opt", "rms-neox")

_TOKENS = dict(pad_token_id=PAD, bos_token_id=1, eos_token_id=None)


def _layer_structures(n_layers: int) -> list[dict]:
    """One structure of each kind per layer (the compressed family's seven linears)."""
    kron = {"type": "kron", "rank": 2, "a_shape": [4, 4]}
    return [
        {
            "q_proj": kron,
            "k_proj": {"type": "lowrank", "rank": 6},
            "v_proj": {"type": "dense"},
            "o_proj": {"type": "gs", "rank": 4, "blocks": [2, 2]},
            "gate_proj": {"type": "lowrank", "rank": 8},
            "up_proj": {"type": "kron", "rank": 2, "a_shape": [4, 4]},
            "down_proj": {"type": "gs", "rank": 4, "blocks": [2, 2]},
        }
        for _ in range(n_layers)
    ]


def family_config(family: str, **overrides):
    """The tiny config of ``family`` (``overrides`` replace its fields)."""
    import transformers as T

    from hf_symmetry.modeling.configuration_compressed_llama import CompressedLlamaConfig
    from hf_symmetry.modeling.configuration_farr import FarrLlamaConfig
    from hf_symmetry.modeling.configuration_rms_decoder import RMSDecoderConfig
    from hf_symmetry.modeling.configuration_tpa import TPAConfig

    llama_like = dict(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_TOKENS,
    )
    if family == "llama":
        return T.LlamaConfig(**{**llama_like, "tie_word_embeddings": False, **overrides})
    if family == "tpa":
        kw = {k: v for k, v in llama_like.items() if k != "num_key_value_heads"}
        return TPAConfig(**{**kw, "q_rank": 4, "k_rank": 3, "v_rank": 2, **overrides})
    if family == "compressed":
        kw = dict(
            llama_like,
            layer_structures=_layer_structures(2),
            embed_structure={"type": "kron", "rank": 3, "a_shape": [8, 4]},
            skip_connections="orthogonal",
            lm_head="tied_mixed",
        )
        return CompressedLlamaConfig(**{**kw, **overrides})
    if family == "farr":  # layer 1 is NoPE with a narrower query/key head; narrower value heads
        kw = dict(llama_like, no_rope_layers=[1, 0], qk_head_dims=[8, 4], v_head_dims=[6, 4])
        return FarrLlamaConfig(**{**kw, **overrides})
    common = dict(
        vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, **_TOKENS
    )
    if family == "rms-opt":
        structures = [
            {"q_proj": {"type": "lowrank", "rank": 6}, "up_proj": {"type": "kron", "rank": 2, "a_shape": [4, 4]}},
            {},
        ]
        kw = dict(
            common,
            max_position_embeddings=128,
            position_offset=2,
            positions_from_mask=True,
            hidden_act="relu",
            skip_connections="orthogonal",
            layer_structures=structures,
            embed_structure={"type": "dense"},
        )
        return RMSDecoderConfig(**{**kw, **overrides})
    if family == "rms-neox":
        kw = dict(
            common,
            max_position_embeddings=128,
            rotary=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            parallel_block=True,
            hidden_act="gelu",
            lm_head_bias=False,
        )
        return RMSDecoderConfig(**{**kw, **overrides})
    raise ValueError(f"no conformance config for {family!r}")


def family_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """A tiny float32 model of ``family`` in eval mode, every parameter random and O(1)-scaled."""
    from transformers import AutoModelForCausalLM

    import hf_symmetry  # noqa: F401  (registers the families with the Auto classes)

    config = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("skip_k"):  # a Cayley parameter: any values give an orthogonal skip
                p.copy_(0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif name.endswith(("k_a", "v_a", "q_a")):
                p.copy_(noise)
            elif "embed" in name and p.dim() == 2 and "positions" not in name:
                p.copy_(0.6 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() >= 2 else 0.1 * noise)
    return model.eval()


def ids(batch: int = 2, length: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_pad(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of 1-D token sequences and its attention mask."""
    n = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, n - len(s) :], mask[i, n - len(s) :] = s, 1
    return batch, mask
