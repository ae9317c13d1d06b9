"""GQA decoding with the queries packed per KV head (``grouped_decode_attention`` in the compressed Llama and
FaRR families): one new token against a static cache runs SDPA on ``[B, KV, groups, d]`` queries instead of
repeating K and V, compiled or not (transformers' SDPA function repeats them under ``torch.compile``, which made
compiled decoding slower than eager). The logits must be the attention function's to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

import hf_symmetry  # noqa: F401  (registers the families with the Auto classes)
from hf_symmetry.modeling import modeling_compressed_llama, modeling_farr
from hf_symmetry.modeling.configuration_compressed_llama import CompressedLlamaConfig
from hf_symmetry.modeling.configuration_farr import FarrLlamaConfig

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 6, 2, 8, 48
CACHE = modeling_compressed_llama.CACHE_FIELD  # the cache argument's name in the installed transformers
FAMILIES = {"compressed": modeling_compressed_llama, "farr": modeling_farr}


def _config(family: str):
    llama = dict(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=None,
    )
    if family == "farr":  # value/output heads narrower than query/key heads in one layer
        return FarrLlamaConfig(**llama, v_head_dims=[6, HEAD_DIM])
    q, kv, f = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, 48
    shapes = dict(q_proj=(q, HIDDEN), k_proj=(kv, HIDDEN), v_proj=(kv, HIDDEN), o_proj=(HIDDEN, q))
    shapes.update(gate_proj=(f, HIDDEN), up_proj=(f, HIDDEN), down_proj=(HIDDEN, f))
    spec = {m: {"type": "lowrank", "rank": min(o, i) // 2} for m, (o, i) in shapes.items()}
    return CompressedLlamaConfig(**llama, layer_structures=[dict(spec) for _ in range(LAYERS)])


def _decode_logits(family: str, steps: int = 3) -> torch.Tensor:
    """Logits of ``steps`` greedy single-token steps after a 5-token prompt, through a static cache (a mask)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    out = []
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=16)
        logits = model(ids, **{CACHE: cache}).logits[:, -1:]
        for step in range(steps):
            nxt = logits.argmax(-1)
            position = torch.full((1, 1), ids.shape[1] + step)
            logits = model(input_ids=nxt, position_ids=position, **{CACHE: cache}).logits
            out.append(logits)
    return torch.cat(out, 1)


def _counting(monkeypatch, module, route):
    calls = []

    def counted(*args):
        out = route(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(module, "grouped_decode_attention", counted)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_decoding_gives_the_attention_functions_logits(monkeypatch, family):
    module = FAMILIES[family]
    calls = _counting(monkeypatch, module, module.grouped_decode_attention)
    packed = _decode_logits(family)
    assert calls and sum(calls) == 3 * LAYERS, "every decode step of every layer takes the packed route"
    monkeypatch.setattr(module, "grouped_decode_attention", lambda *args: None)
    reference = _decode_logits(family)  # transformers' SDPA function on the same cache
    torch.testing.assert_close(packed, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wrong_head_grouping_is_caught(monkeypatch, family):
    """Negative control: the queries handed to the route with their heads interleaved (head i to KV head
    i mod KV, not i // groups) change the logits far above float32 rounding."""
    module, route = FAMILIES[family], FAMILIES[family].grouped_decode_attention

    def interleaved(mod, query, *rest):
        B, h, T, d = query.shape
        if T == 1:
            query = query.reshape(B, h // KV_HEADS, KV_HEADS, T, d).transpose(1, 2).reshape(B, h, T, d)
        return route(mod, query, *rest)

    monkeypatch.setattr(module, "grouped_decode_attention", interleaved)
    wrong = _decode_logits(family, steps=1)
    monkeypatch.setattr(module, "grouped_decode_attention", lambda *args: None)
    reference = _decode_logits(family, steps=1)
    assert (wrong - reference).abs().max() > 1e-3
