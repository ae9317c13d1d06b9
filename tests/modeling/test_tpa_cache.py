"""The TPA factor caches (hf_symmetry/modeling/cache_tpa.py) and the decode-memory fix: the static cache that
``generate(cache_implementation="static")`` gives a TPA model (preallocated factors, not K/V; equal to the
dynamic cache; compiled decoding), the quantized factor cache (codes, bytes per token as the formula says,
logits close to the unquantized cache, selectable from ``generate``), the in-place conversion of generic
caches, and the prefill attention that composes no K/V for grouped A (a converted GQA model) and at most
``R_K`` heads of K/V per call otherwise."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_symmetry.modeling import cache_tpa, modeling_tpa
from hf_symmetry.modeling.cache_tpa import (
    TPACacheLayer,
    TPAQuantizedCache,
    TPAQuantizedLayer,
    TPAStaticCache,
    TPAStaticLayer,
    dequantize_rows,
    quantize_rows,
)
from test_tpa_model import ids_batch, make_model

pytestmark = pytest.mark.usefixtures("_one_thread")


@pytest.fixture
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def greedy(model, ids, mask=None, **kw):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **kw,
    )
    return out.sequences, torch.stack(out.scores, 1), out.past_key_values


def decode_logits(model, ids, cache, prefill: int):
    """Logits of every position of ``ids``: a prefill of ``prefill`` tokens, then one token at a time through
    ``cache``."""
    with torch.no_grad():
        parts = [model(ids[:, :prefill], past_key_values=cache).logits]
        for t in range(prefill, ids.shape[1]):
            parts.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    return torch.cat(parts, 1)


# ---------------------------------------------------------------------------------------------
# Static factor cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["contextual", "kv_only_noncontextual"])
def test_generate_static_cache_preallocates_factors_and_equals_dynamic(variant):
    model = make_model(variant)
    cfg = model.config
    ids = ids_batch(b=2, t=7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        seq_d, scores_d, _ = greedy(model, ids, mask)
        seq_s, scores_s, cache = greedy(model, ids, mask, cache_implementation="static")
    assert torch.equal(seq_d, seq_s)
    assert (scores_d - scores_s).abs().max().item() <= 1e-4
    assert type(cache) is StaticCache and all(type(layer) is TPAStaticLayer for layer in cache.layers)
    layer, L = cache.layers[0], cache.layers[0].max_cache_len
    assert L >= 12 and int(layer.get_seq_length()) == 12  # 7 + 6 generated, the last one not fed back
    # the factors are preallocated (batch, factors, slots, width), never K/V (batch, heads, slots, head_dim)
    assert layer.keys.shape == (2, cfg.k_rank, L, cfg.head_dim) and layer.values.shape == (2, cfg.v_rank, L, 6)
    per_token = sum(t.numel() for t in layer.per_token_tensors()) // (2 * L)
    assert per_token == cfg.kv_cache_elements_per_token()
    if variant == "contextual":
        assert layer.key_a.shape == (2, cfg.k_rank, L, cfg.num_attention_heads)
    else:
        assert layer.key_a is model.model.layers[0].self_attn.k_a  # stored once: the parameter itself


def test_a_static_cache_passed_in_is_filled_in_place_and_can_be_reused():
    model = make_model("contextual")
    ids = ids_batch(b=2, t=9)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        ref = model(ids).logits
        a = model(ids[:, :6], past_key_values=cache)
        assert a.past_key_values is cache and isinstance(cache.layers[0], TPAStaticLayer)
        b = model(ids[:, 6:], past_key_values=cache)  # the same object again: it holds the first 6 tokens
    assert (torch.cat([a.logits, b.logits], 1) - ref).abs().max().item() <= 1e-4
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and cache.layers[0].keys.abs().max() == 0


def test_static_cache_crop_and_beam_reorder():
    model = make_model("kv_only_noncontextual")
    ids = ids_batch(b=3, t=8)
    cache = TPAStaticCache(model.config, max_cache_len=12)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        cache.crop(-3)
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        keys = cache.layers[0].keys
        nxt = model(ids[[2, 0, 0], 5:6], past_key_values=cache).logits[:, -1]
        ref = model(ids[[2, 0, 0], :6]).logits[:, -1]
    assert cache.layers[0].keys is keys  # reordered in place (static addresses for compiled graphs)
    assert (nxt - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["contextual", "grouped"])
def test_fullgraph_compiled_decoding_with_the_static_cache_matches_eager(variant):
    """A fullgraph-compiled decode step (what ``generate`` compiles with a static cache) gives the eager logits:
    factor-space decoding (contextual A) and GQA on the factors (grouped A, the route checked eagerly first)."""
    if variant == "grouped":
        kw = dict(num_attention_heads=6, head_dim=4, hidden_size=24, k_rank=3, v_rank=3, num_hidden_layers=1)
        model = _gqa_like(make_model("kv_only_noncontextual", **kw))
    else:
        model = make_model("contextual", num_hidden_layers=1)
    ids = ids_batch(b=2, t=6)
    cache = TPAStaticCache(model.config, max_cache_len=10)
    step = torch.compile(model.forward, fullgraph=True)
    seq = ids
    with torch.no_grad():
        nxt = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        assert model.model.layers[0].self_attn.factor_groups() == (variant == "grouped")
        for i in range(3):
            seq = torch.cat([seq, nxt], 1)
            out = step(input_ids=nxt, position_ids=torch.full((2, 1), 6 + i), past_key_values=cache)
            assert (out.logits[:, -1] - model(seq).logits[:, -1]).abs().max().item() <= 1e-4
            nxt = out.logits[:, -1:].argmax(-1)


# ---------------------------------------------------------------------------------------------
# Quantized factor cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbits", [2, 4, 8])
@pytest.mark.parametrize("n,group", [(64, 32), (9, 9), (6, 4)])
def test_quantize_rows_round_trip_within_half_a_step(nbits, n, group):
    group = group if n % group == 0 else n
    x = torch.randn(3, 5, 2, n, generator=torch.Generator().manual_seed(nbits))
    codes, scale, low = quantize_rows(x, nbits, group)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == -(-n * nbits // 8)  # packed, 8/nbits codes a byte
    assert scale.dtype == low.dtype == torch.float16 and scale.shape[-1] == n // group
    y = dequantize_rows(codes, scale, low, nbits, torch.float32, n)
    step = scale.float().repeat_interleave(group, -1)
    assert ((x - y).abs() <= 0.5 * step + 1e-3 * x.abs().max()).all()
    # every code is used in full: the extremes of each group come back (low exactly, high to half a step)
    assert torch.allclose(y.reshape(3, 5, 2, n // group, group).amin(-1), low.float(), atol=0, rtol=0)
    # negative control: the same bytes in another order do not come back
    wrong = dequantize_rows(codes.flip(-1), scale, low, nbits, torch.float32, n)
    assert (wrong - x).abs().max() > 0.5 * step.max()


@pytest.mark.parametrize("variant", ["contextual", "kv_only_noncontextual"])
def test_quantized_cache_holds_the_bytes_the_formula_says(variant):
    model = make_model(variant)
    cfg = model.config
    B, T, res = 2, 13, 4
    cache = TPAQuantizedCache(cfg, nbits=4, q_group_size=2, residual_length=res)
    decode_logits(model, ids_batch(B, T), cache, prefill=9)  # 9 flushed at once, then 4 more: one flush
    layer = cache.layers[0]
    assert layer.quantized_length() == 13 and layer.keys is None and cache.get_seq_length() == 13
    per_token = TPAQuantizedLayer.bytes_per_token(
        cfg.k_rank, cfg.v_rank, cfg.num_attention_heads, cfg.head_dim, cfg.contextual_a, 4, 2
    )
    # B rows of d_h=6 in groups of 2: 3 code bytes + 3 groups x 4 bytes; contextual A rows of h=3: 2 + 4
    rows = cfg.k_rank + cfg.v_rank
    assert per_token == rows * (3 + 12) + (rows * (2 + 4) if cfg.contextual_a else 0)
    constant = 0 if cfg.contextual_a else rows * cfg.num_attention_heads * 4  # A stored once, float32
    assert cache.cached_bytes() == cfg.num_hidden_layers * (B * T * per_token + constant)
    with torch.no_grad():
        assert cache.cached_bytes() < model(ids_batch(B, T)).past_key_values.cached_bytes()


def test_quantized_cache_logits_close_to_the_unquantized_cache_and_ordered_by_bits():
    """Decoding through the quantized factor cache stays close to the full-precision cache; the error grows as
    bits are removed (8 < 4 < 2), so the bound is not met by accident (a cache that dropped the quantized part,
    the negative control, is far off)."""
    model = make_model("contextual", dtype=torch.float64)
    ids = ids_batch(2, 24)
    ref = decode_logits(model, ids, modeling_tpa.TPACache(model.config), prefill=8)
    errs = {}
    for nbits in (8, 4, 2):
        cache = TPAQuantizedCache(model.config, nbits=nbits, q_group_size=2, residual_length=4)
        errs[nbits] = (decode_logits(model, ids, cache, prefill=8) - ref)[:, 8:].abs().max().item()
    assert errs[8] < errs[4] < errs[2]
    # measured on this model (float64): 8 bits 9.1e-3, 4 bits 0.157, 2 bits 0.675 (logits span ~18.5); ~3x
    assert errs[8] <= 0.03 and errs[4] <= 0.5 and errs[2] <= 2.0
    # negative control: a cache that lost its quantized past (only the last 4 tokens seen) is far off
    with torch.no_grad():
        tail = model(ids[:, 20:]).logits
    assert (tail[:, -1] - ref[:, -1]).abs().max().item() > 4 * errs[4]


def test_generate_quantized_cache_implementation_becomes_a_quantized_factor_cache():
    pytest.importorskip("hqq")
    model = make_model("contextual")
    ids = ids_batch(b=2, t=8)
    cfg = {"backend": "hqq", "nbits": 4, "q_group_size": 2, "residual_length": 3}
    with torch.no_grad():
        seq_q, scores_q, cache = greedy(model, ids, cache_implementation="quantized", cache_config=cfg)
        seq_d, scores_d, _ = greedy(model, ids)
    assert all(type(layer) is TPAQuantizedLayer for layer in cache.layers)
    assert cache.layers[0].nbits == 4 and cache.layers[0].residual_length == 3
    assert cache.layers[0].quantized_length() >= 8  # the prompt was quantized
    assert (scores_q - scores_d).abs().max().item() <= 1.0  # close (4 bits), not equal
    assert (scores_q - scores_d).abs().max().item() > 0


# ---------------------------------------------------------------------------------------------
# Generic caches become factor caches in place
# ---------------------------------------------------------------------------------------------
def test_an_empty_generic_cache_is_converted_in_place_and_a_filled_one_refused():
    model = make_model("contextual")
    for cache, kind in ((DynamicCache(), TPACacheLayer), (DynamicCache(config=model.config), TPACacheLayer)):
        with torch.no_grad():
            model(ids_batch(t=3), past_key_values=cache)
        assert len(cache.layers) == model.config.num_hidden_layers
        assert all(type(layer) is kind for layer in cache.layers)
    filled = StaticCache(config=model.config, max_cache_len=8)
    filled.update(torch.zeros(2, 1, 3, 6), torch.zeros(2, 1, 3, 6), 0)
    with pytest.raises(ValueError, match="already holds K/V"):
        model(ids_batch(t=1), past_key_values=filled)


# ---------------------------------------------------------------------------------------------
# Prefill attention: no whole-model K/V composed
# ---------------------------------------------------------------------------------------------
def _gqa_like(model, scale=None):
    """Set every layer's non-contextual A to a head grouping (head i -> factor i // (h/R)), as a converted GQA
    model has it; ``scale`` per head (default R: then K_i = B_K[g(i)])."""
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            h, r = att.num_heads, att.k_rank
            a = torch.zeros(r, h, dtype=att.k_a.dtype)
            heads = torch.arange(h)
            a[heads // (h // r), heads] = r if scale is None else scale.to(a.dtype)
            att.k_a.copy_(a)
            att.v_a.copy_(a * 0.5)
    return model


def _composed_heads(monkeypatch, model, ids):
    """The head counts of every K/V composed (``_compose`` calls on cached factors) during one forward."""
    seen = []
    original = modeling_tpa._compose

    def spy(a, b, rank):
        out = original(a, b, rank)
        seen.append(out.shape[1])
        return out

    monkeypatch.setattr(modeling_tpa, "_compose", spy)
    with torch.no_grad():
        logits = model(ids).logits
    monkeypatch.undo()
    return seen, logits


def test_grouped_factors_run_as_gqa_without_composing_k_or_v(monkeypatch):
    cfg = dict(num_attention_heads=6, head_dim=4, hidden_size=24, k_rank=3, v_rank=3)
    model = _gqa_like(make_model("kv_only_noncontextual", dtype=torch.float64, **cfg), scale=torch.arange(1.0, 7.0))
    ids = ids_batch(b=2, t=40)
    with torch.no_grad():
        assert all(layer.self_attn.factor_groups() for layer in model.model.layers)
    assert not model.model.layers[0].self_attn.factor_groups()  # gradients flowing into A: compose instead
    seen, grouped = _composed_heads(monkeypatch, model, ids)
    assert seen == []  # neither K nor V composed
    # the same model through the composing route (negative control for the route: it composes)
    monkeypatch.setattr(modeling_tpa.TPAAttention, "factor_groups", lambda self: False)
    seen, composed = _composed_heads(monkeypatch, model, ids)
    assert seen and (grouped - composed).abs().max().item() <= 1e-10
    # a nonzero outside the grouping turns the route off (A changed: the check is redone)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_a[0, 5] = 0.1
        assert not model.model.layers[0].self_attn.factor_groups()
        assert model.model.layers[1].self_attn.factor_groups()


def test_prefill_composes_at_most_k_rank_heads_of_k_and_v_per_call(monkeypatch):
    cfg = dict(num_attention_heads=6, head_dim=4, hidden_size=24, k_rank=2, v_rank=2)
    model = make_model("kv_only_noncontextual", **cfg)  # dense random A: not a grouping
    ids = ids_batch(b=2, t=60)
    for layer in model.model.layers:
        with torch.no_grad():
            assert not layer.self_attn.factor_groups()
        assert layer.self_attn.attention_plan(60, 60) == ("k", "v")  # prefill composes (the cheaper route)
    seen, logits = _composed_heads(monkeypatch, model, ids)
    assert seen and max(seen) <= 2
    monkeypatch.setattr(modeling_tpa.TPAAttention, "head_chunk", lambda self: self.num_heads)
    seen_all, logits_all = _composed_heads(monkeypatch, model, ids)
    assert max(seen_all) == 6 and (logits - logits_all).abs().max().item() <= 1e-4


def test_cache_module_is_standalone():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(cache_tpa.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module.split(".")[0] in ("torch", "transformers", "__future__")
        elif isinstance(node, ast.Import):
            assert {a.name.split(".")[0] for a in node.names} <= {"torch"}


def test_grouped_decoding_with_left_padding_equals_the_composing_route():
    """Decoding a grouped model (its queries packed per group against the cached factors) gives the scores of the
    same model forced to compose K/V (``tpa_decode_path="materialize"``), left padding included."""
    kw = dict(num_attention_heads=6, head_dim=4, hidden_size=24, k_rank=3, v_rank=3)
    model = _gqa_like(make_model("kv_only_noncontextual", dtype=torch.float64, **kw), scale=torch.arange(1.0, 7.0))
    ids = ids_batch(b=3, t=9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        assert model.model.layers[0].self_attn.factor_groups()
        seq_g, scores_g, _ = greedy(model, ids, mask)
        model.config.tpa_decode_path = "materialize"
        assert not model.model.layers[0].self_attn.factor_groups()
        seq_m, scores_m, _ = greedy(model, ids, mask)
    assert torch.equal(seq_g, seq_m) and (scores_g - scores_m).abs().max().item() <= 1e-9
