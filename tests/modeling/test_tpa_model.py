"""Tensor Product Attention (T6) as a Hugging Face model family: config validation, the factorised
cache, factor-space attention, RoPE on the B factors, generate(), save/load (also as remote code in
an environment without hf_symmetry), gradient checkpointing and training."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch

import hf_symmetry
from hf_symmetry import TPAConfig, TPAForCausalLM, TPAModel
from hf_symmetry.testing import run_without_hf_symmetry
from hf_symmetry.modeling.modeling_tpa import (
    TPACache,
    TPACacheLayer,
    TPAFactorLinear,
    _compose,
    apply_rotary,
    eager_attention_forward,
)

V = 61
BASE = dict(
    vocab_size=V,
    hidden_size=30,
    num_attention_heads=3,
    head_dim=6,
    num_hidden_layers=2,
    q_rank=5,
    k_rank=5,
    v_rank=4,
    intermediate_size=40,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VARIANTS = {
    "contextual": {},
    "noncontextual": dict(contextual_a=False),
    "kv_only": dict(q_rank=None),
    "kv_only_noncontextual": dict(q_rank=None, contextual_a=False, k_rank=2, v_rank=3),
    "bias_partial_rope": dict(
        attention_bias=True,
        attention_out_bias=True,
        head_dim=8,
        q_rank=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    """One intra-op thread for these tests: on the shared 2-core machine two threads oversubscribe the
    cores as soon as anything else runs (measured 5-20x slower); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(variant: str = "contextual", dtype=torch.float32, attn: str = "sdpa", seed: int = 0, **kw):
    """A tiny TPA model with O(1) random weights (so logit differences are meaningful)."""
    cfg = TPAConfig(**{**BASE, **VARIANTS[variant], **kw})
    torch.manual_seed(seed)
    model = TPAForCausalLM._from_config(cfg, attn_implementation=attn)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(("k_a", "v_a", "q_a")):
                p.copy_(noise)
            elif "embed" in name:
                p.copy_(0.6 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.1 * noise)
    return model.to(dtype).eval()


def ids_batch(b=2, t=12, seed=0):
    return torch.randint(3, V, (b, t), generator=torch.Generator().manual_seed(seed))


def set_path(model, path):
    model.config.tpa_decode_path = path
    return model


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(k_rank=0), "k_rank"),
        (dict(v_rank=-2), "v_rank"),
        (dict(q_rank=0), "q_rank"),
        (dict(hidden_size=30, num_attention_heads=4, head_dim=None), "not divisible"),
        (dict(head_dim=7), "RoPE dimension must be even"),
        (
            dict(
                head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.375}
            ),
            "RoPE dimension must be even",
        ),
        (dict(tpa_decode_path="fast"), "tpa_decode_path"),
        (dict(num_attention_heads=0), "num_attention_heads"),
    ],
)
def test_bad_config_is_refused_at_construction(bad, match):
    with pytest.raises(ValueError, match=match):
        TPAConfig(**{**BASE, **bad})
    # loading a saved config goes through the same validation
    good = TPAConfig(**BASE).to_dict()
    with pytest.raises(ValueError, match=match):
        TPAConfig.from_dict({**good, **bad})


def test_config_defaults_and_derived_sizes():
    cfg = TPAConfig(vocab_size=100, hidden_size=64, num_attention_heads=4)
    assert cfg.head_dim == 16 and cfg.intermediate_size == 192  # 8/3·64 rounded up to a multiple of 64
    assert cfg.model_type == "hf_symmetry_tpa" and not cfg.tpa_kv_only
    assert cfg.kv_cache_elements_per_token() == (2 + 2) * (4 + 16)
    assert TPAConfig(**BASE, contextual_a=False).kv_cache_elements_per_token() == (5 + 4) * 6
    # head_dim given explicitly: hidden size need not be heads x head_dim
    assert TPAConfig(**{**BASE, "hidden_size": 31}).head_dim == 6


def test_auto_classes_registered():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.for_model("hf_symmetry_tpa", **BASE)
    assert isinstance(cfg, TPAConfig)
    assert type(AutoModelForCausalLM.from_config(cfg)) is TPAForCausalLM
    assert type(AutoModel.from_config(cfg)) is TPAModel


def test_init_follows_paper_xavier_per_rank():
    cfg = TPAConfig(
        vocab_size=50, hidden_size=96, num_attention_heads=4, q_rank=6, k_rank=2, v_rank=2, num_hidden_layers=1
    )
    torch.manual_seed(0)
    attn = TPAForCausalLM(cfg).model.layers[0].self_attn
    for lin, width in ((attn.q_a_proj, 4), (attn.k_a_proj, 4), (attn.q_b_proj, 24), (attn.v_b_proj, 24)):
        assert isinstance(lin, TPAFactorLinear)
        bound = math.sqrt(6 / (96 + width))
        w = lin.weight
        assert w.abs().max() <= bound and abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.1


# ---------------------------------------------------------------------------------------------
# Cache: incremental decoding equals the full forward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("path", ["auto", "factor", "materialize"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_equals_full_forward(variant, path, attn):
    model = set_path(make_model(variant, attn=attn), path)
    ids = ids_batch()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = TPACache(model.config)
        parts = [model(ids[:, :5], past_key_values=cache, use_cache=True).logits]
        for t in range(5, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            parts.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-4
    assert full.abs().max() > 1  # the comparison is not trivially small


@pytest.mark.parametrize("variant", ["contextual", "kv_only_noncontextual"])
def test_chunked_prefill_equals_full_forward(variant):
    model = make_model(variant)
    ids = ids_batch(t=14)
    with torch.no_grad():
        full = model(ids).logits
        cache, parts, start = TPACache(model.config), [], 0
        for size in (4, 3, 1, 6):
            parts.append(model(ids[:, start : start + size], past_key_values=cache).logits)
            start += size
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-4


def test_factor_path_equals_materialized_path_whole_model():
    for variant in VARIANTS:
        ref = set_path(make_model(variant, attn="eager"), "materialize")
        fac = set_path(make_model(variant, attn="eager"), "factor")
        ids = ids_batch(b=3, t=9)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        mask[2, :1] = 0
        with torch.no_grad():
            a = ref(ids, attention_mask=mask).logits
            b = fac(ids, attention_mask=mask).logits
        keep = mask.bool()
        assert (a - b)[keep].abs().max().item() <= 1e-4, variant


def _pad_left(seqs, pad=0):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    return ids, mask


@pytest.mark.parametrize("attn,path", [("sdpa", "auto"), ("eager", "factor"), ("sdpa", "materialize")])
def test_left_padded_batch_prefill_and_decode_match_single_sequences(attn, path):
    model = set_path(make_model("contextual", attn=attn), path)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, V, (n,), generator=g) for n in (9, 5, 7)]
    ids, mask = _pad_left(seqs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = 4
    with torch.no_grad():
        cache = TPACache(model.config)
        out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        batched = [out.logits[:, -1]]
        for _ in range(steps):
            nxt = batched[-1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            pos = pos[:, -1:] + 1
            batched.append(model(nxt, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1])
        for i, s in enumerate(seqs):
            single = model(ids[i : i + 1, -(len(s) + steps) :]).logits[0]
            real = model(ids[i : i + 1, ids.shape[1] - len(s) - steps : ids.shape[1] - steps]).logits[0]
            # prefill: every real position of the padded row matches the unpadded sequence
            assert (out.logits[i, -len(s) :] - real).abs().max().item() <= 1e-4
            # decoding steps match the unpadded full forward
            dec = torch.stack([b[i] for b in batched])
            assert (dec - single[len(s) - 1 :]).abs().max().item() <= 1e-4


def test_generate_with_and_without_cache_greedy_beam_sampling():
    model = make_model("contextual")
    g = torch.Generator().manual_seed(5)
    ids, mask = _pad_left([torch.randint(3, V, (n,), generator=g) for n in (6, 4, 5)])
    common = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        greedy_c = model.generate(ids, do_sample=False, use_cache=True, **common)
        greedy_n = model.generate(ids, do_sample=False, use_cache=False, **common)
        assert torch.equal(greedy_c, greedy_n)
        # each row equals generating it alone, without padding
        for i in range(3):
            n = int(mask[i].sum())
            alone = model.generate(
                ids[i : i + 1, -n:], do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None
            )
            assert torch.equal(alone[0, n:], greedy_c[i, ids.shape[1] :])
        beam_c = model.generate(ids, num_beams=3, do_sample=False, use_cache=True, **common)
        beam_n = model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **common)
        assert torch.equal(beam_c, beam_n)
        torch.manual_seed(11)
        samp_c = model.generate(ids, do_sample=True, top_k=8, use_cache=True, num_return_sequences=2, **common)
        torch.manual_seed(11)
        samp_n = model.generate(ids, do_sample=True, top_k=8, use_cache=False, num_return_sequences=2, **common)
        assert torch.equal(samp_c, samp_n) and samp_c.shape == (6, ids.shape[1] + 6)


def test_generate_uses_the_factorised_cache():
    model = make_model("kv_only_noncontextual")
    out = model.generate(
        ids_batch(b=1, t=5), max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=0
    )
    # generate's DynamicCache, its layers turned into factor layers in place (the object generate holds fills)
    assert all(isinstance(layer, TPACacheLayer) for layer in out.past_key_values.layers)
    layer = out.past_key_values.layers[0]
    assert layer.keys.shape == (1, 2, 7, 6) and layer.values.shape == (1, 3, 7, 6)  # factor-major: [B, R, S, d_h]
    assert layer.key_a.shape == (2, 3) and layer.value_a.shape == (3, 3)  # stored once


@pytest.mark.parametrize("contextual", [True, False])
def test_cache_holds_exactly_the_factor_elements(contextual):
    model = make_model("contextual", contextual_a=contextual)
    cfg = model.config
    B, T, L, h, dh, rk, rv = 2, 11, cfg.num_hidden_layers, 3, 6, cfg.k_rank, cfg.v_rank
    with torch.no_grad():
        cache = model(ids_batch(B, T)).past_key_values
    counts = cache.cached_elements()
    if contextual:
        assert counts == {"per_token": B * T * L * (rk + rv) * (h + dh), "constant": 0}
    else:
        assert counts == {"per_token": B * T * L * (rk + rv) * dh, "constant": L * (rk + rv) * h}
    assert counts["per_token"] == B * T * cfg.kv_cache_elements_per_token(per_layer=False)
    assert cache.cached_bytes() == 4 * (counts["per_token"] + counts["constant"])


def test_cache_crop_reorder_select():
    model = make_model("contextual")
    ids = ids_batch(b=3, t=8)
    with torch.no_grad():
        cache = model(ids).past_key_values
        cache.crop(-3)
        assert cache.get_seq_length() == 5
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        nxt = model(ids[[2, 0, 0], 5:6], past_key_values=cache).logits[:, -1]
        ref = model(ids[[2, 0, 0], :6]).logits[:, -1]
        assert (nxt - ref).abs().max().item() <= 1e-4
        cache.batch_select_indices(torch.tensor([1]))
        cache.batch_repeat_interleave(2)
        assert cache.layers[0].keys.shape[0] == 2 and cache.layers[1].key_a.shape[0] == 2
        cache.reset()
        assert cache.get_seq_length() == 0


def test_a_non_factorised_cache_is_refused_once_filled():
    from transformers import DynamicCache

    model = make_model("contextual")
    ids = ids_batch(t=5)
    empty = DynamicCache()
    with torch.no_grad():
        out = model(ids[:, :4], past_key_values=empty)  # empty: its layers become factor layers in place
        assert out.past_key_values is empty and all(isinstance(x, TPACacheLayer) for x in empty.layers)
        # the caller's object is the cache that filled: reusing it continues the sequence
        nxt = model(ids[:, 4:], past_key_values=empty).logits[:, -1]
        assert (nxt - model(ids).logits[:, -1]).abs().max().item() <= 1e-4
    filled = DynamicCache()
    filled.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), 0)
    with pytest.raises(ValueError, match="already holds K/V"):
        model(ids_batch(t=1), past_key_values=filled)


# ---------------------------------------------------------------------------------------------
# Factor-space attention
# ---------------------------------------------------------------------------------------------
def _attn_module(q_rank, contextual, h=3, dh=6, rk=5, rv=5):
    cfg = TPAConfig(
        **{
            **BASE,
            "num_attention_heads": h,
            "head_dim": dh,
            "q_rank": q_rank,
            "k_rank": rk,
            "v_rank": rv,
            "contextual_a": contextual,
        }
    )
    return TPAForCausalLM(cfg).model.layers[0].self_attn.double()


@pytest.mark.parametrize("q_rank", [5, None])
@pytest.mark.parametrize("contextual", [True, False])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "float"])
@pytest.mark.parametrize("T", [1, 4])
def test_factor_space_attention_equals_materialized(q_rank, contextual, mask_kind, T):
    """Odd sizes (h=3, R=5, d_h=6, S=7), every score route, every mask kind."""
    attn = _attn_module(q_rank, contextual)
    h, dh, rq, rk, rv = 3, 6, 5, 5, 5
    B, S = 2, 7
    g = torch.Generator().manual_seed(T + 10 * (q_rank or 0) + contextual)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    f = (
        {"q": r(B, h, T, dh)}
        if q_rank is None
        else {"a_q": r(B, rq, T, h) if contextual else r(rq, h), "b_q": r(B, rq, T, dh)}
    )
    a_k = r(B, rk, S, h) if contextual else r(rk, h)
    a_v = r(B, rv, S, h) if contextual else r(rv, h)
    b_k, b_v = r(B, rk, S, dh), r(B, rv, S, dh)
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T).expand(B, 1, T, S)
    if mask_kind == "causal":
        mask, float_mask = None, torch.zeros(B, 1, T, S, dtype=torch.float64).masked_fill(~causal, -1e300)
    else:
        keep = causal & (torch.rand(B, 1, T, S, generator=g) > 0.3)
        keep[..., -1] = True
        float_mask = torch.zeros(B, 1, T, S, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
        mask = keep if mask_kind == "bool" else float_mask
    q = f["q"] if q_rank is None else _compose(f["a_q"], f["b_q"], rq)
    ref, ref_w = eager_attention_forward(
        attn, q, _compose(a_k, b_k, rk), _compose(a_v, b_v, rv), float_mask, scaling=dh**-0.5
    )
    routes = ["q"] if q_rank is None else ["q", "p"]
    for route in routes:
        out, w = attn.factor_attention(f, a_k, b_k, a_v, b_v, mask, output_attentions=True, route=route)
        assert (out - ref).abs().max().item() < 1e-12, route
        assert (w - ref_w).abs().max().item() < 1e-12, route


def test_auto_path_picks_factor_space_for_decoding_only():
    attn = (
        TPAForCausalLM(
            TPAConfig(
                **{
                    **BASE,
                    "num_attention_heads": 8,
                    "head_dim": 64,
                    "hidden_size": 64,
                    "q_rank": 6,
                    "k_rank": 2,
                    "v_rank": 2,
                }
            )
        )
        .model.layers[0]
        .self_attn
    )
    assert attn.use_factor_path(1, 4096) and not attn.use_factor_path(512, 512)
    attn.config.tpa_decode_path = "materialize"
    assert not attn.use_factor_path(1, 4096)


# ---------------------------------------------------------------------------------------------
# RoPE on the B factors
# ---------------------------------------------------------------------------------------------
def test_rotating_b_then_forming_k_equals_forming_k_then_rotating():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = make_model("contextual", dtype=torch.float64)
    B, T, R, h, dh = 2, 9, 5, 3, 6
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(B, R, T, h, generator=g, dtype=torch.float64),
        torch.randn(B, R, T, dh, generator=g, dtype=torch.float64),
    )
    pos = torch.arange(T).unsqueeze(0) + 17
    cos, sin = model.model.rotary_emb(b, pos)
    k_then_rot = apply_rotary(_compose(a, b, R), cos, sin)  # [B,h,T,dh]
    rot_then_k = _compose(a, apply_rotary(b, cos, sin), R)
    assert (k_then_rot - rot_then_k).abs().max().item() < 1e-12
    # and the rotation is HF's rotate_half convention with HF's sign
    k = _compose(a, b, R)  # [B,h,T,dh]
    hf_k, _ = apply_rotary_pos_emb(k, k, cos, sin)
    assert (hf_k - k_then_rot).abs().max().item() < 1e-12


@pytest.mark.parametrize("variant", ["contextual", "kv_only_noncontextual", "bias_partial_rope"])
def test_shifting_all_positions_leaves_logits_unchanged(variant):
    model = make_model(variant)
    ids = ids_batch(t=10)
    with torch.no_grad():
        base = model(ids).logits
        shifted = model(ids, position_ids=torch.arange(10).unsqueeze(0) + 23).logits
        cache = TPACache(model.config)  # also through the cache, starting at an offset
        pre = model(ids[:, :6], position_ids=torch.arange(6).unsqueeze(0) + 41, past_key_values=cache).logits
        step = model(ids[:, 6:], position_ids=torch.arange(6, 10).unsqueeze(0) + 41, past_key_values=cache).logits
    assert (base - shifted).abs().max().item() <= 1e-4
    assert (torch.cat([pre, step], 1) - base).abs().max().item() <= 1e-4
    # a position shift applied to the keys only is not a symmetry (negative control)
    with torch.no_grad():
        cache = TPACache(model.config)
        model(ids[:, :6], position_ids=torch.arange(6).unsqueeze(0) + 5, past_key_values=cache)
        wrong = model(ids[:, 6:], position_ids=torch.arange(6, 10).unsqueeze(0), past_key_values=cache).logits
    assert (wrong - base[:, 6:]).abs().max().item() > 1e-2


# ---------------------------------------------------------------------------------------------
# Save / load, remote code
# ---------------------------------------------------------------------------------------------
ISOLATED_LOADER = textwrap.dedent("""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        cache = model(ids).past_key_values
    print(json.dumps({"module": type(model).__module__, "cache": type(cache).__name__, "logits": logits.tolist(),
                      "gen": gen.tolist()}))
""")


def test_save_load_roundtrip_and_remote_code_without_hf_symmetry(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model = make_model("kv_only_noncontextual", attention_bias=True)
    folder = tmp_path / "tpa"
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "hf_symmetry_tpa"
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_tpa.TPAConfig",
        "AutoModelForCausalLM": "modeling_tpa.TPAForCausalLM",
    }
    for name in ("configuration_tpa.py", "modeling_tpa.py", "cache_tpa.py"):  # the sibling the model imports too
        assert (folder / name).is_file(), name
    ids = ids_batch(b=1, t=7)
    with torch.no_grad():
        ref = model(ids).logits
        ref_gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)

    # without trust_remote_code: the registered local classes
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is TPAForCausalLM and isinstance(AutoConfig.from_pretrained(folder), TPAConfig)
    assert type(AutoModel.from_pretrained(folder)) is TPAModel
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)

    # with trust_remote_code, in a Python where hf_symmetry cannot be imported
    got = run_without_hf_symmetry(ISOLATED_LOADER, tmp_path, FOLDER=str(folder), IDS=ids.tolist())
    assert got["module"].startswith("transformers_modules.") and got["cache"] == "TPACache"
    assert (torch.tensor(got["logits"]) - ref).abs().max().item() <= 1e-5  # float32, another process
    assert got["gen"] == ref_gen.tolist()
    assert (tmp_path / "hf_modules" / "transformers_modules").is_dir()


def test_modeling_files_only_import_torch_and_transformers():
    import ast
    from pathlib import Path

    folder = Path(hf_symmetry.__file__).parent / "modeling"
    allowed = {"torch", "transformers", "huggingface_hub", "__future__", "dataclasses", "math", "typing"}
    for name in ("modeling_tpa.py", "configuration_tpa.py", "cache_tpa.py"):
        tree = ast.parse((folder / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert {a.name.split(".")[0] for a in node.names} <= allowed, name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level == 1 and node.module in ("configuration_tpa", "cache_tpa"), name
                else:
                    assert node.module.split(".")[0] in allowed, name


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_gradients():
    model = make_model("contextual").train()
    ids = ids_batch(t=10)

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    ckpt = grads()
    assert plain.keys() == ckpt.keys() and len(plain) > 10
    assert max((plain[k] - ckpt[k]).abs().max().item() for k in plain) < 1e-5


def test_tiny_t6_trains_with_the_hf_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    cfg = TPAConfig(
        vocab_size=32,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        q_rank=4,
        k_rank=2,
        v_rank=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = TPAForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 32, (64, 1), generator=g)
    data = (starts + 3 * torch.arange(16)) % 32  # learnable arithmetic sequences

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    def loss():
        model.eval()
        with torch.no_grad():
            return model(data, labels=data).loss.item()

    before = loss()
    import dataclasses

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **{ckpt: True},
    )
    Trainer(model=model, args=args, train_dataset=DS()).train()
    after = loss()
    assert after < 0.7 * before, (before, after)


def test_attentions_asked_for_in_the_config_are_returned():
    """``config.output_attentions = True`` (no argument) returns one attention map per layer, as in Llama."""
    model = make_model("contextual", attn="eager")
    model.config.output_attentions = True
    with torch.no_grad():
        out = model(ids_batch(b=1, t=5))
    assert len(out.attentions) == model.config.num_hidden_layers and out.attentions[0].shape == (1, 3, 5, 5)
    model.config.output_attentions = False
    with torch.no_grad():
        assert model(ids_batch(b=1, t=5)).attentions is None
