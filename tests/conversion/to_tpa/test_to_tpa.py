"""Conversion of stock Llama/Mistral/Qwen2 checkpoints into TPA models (``hf-symmetry to-tpa``):
exact at full rank (tiny GQA/MHA models with biases, and SmolLM2), approximate below it, with
negative controls (wrong head grouping, reduced rank) and the calibration refinement."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_symmetry  # noqa: F401
from hf_symmetry.conversion.to_tpa import convert_model_to_tpa
from hf_symmetry.modeling.modeling_tpa import TPACache, TPAForCausalLM


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    """One intra-op thread for these tests: on the shared 2-core machine two threads oversubscribe the
    cores as soon as anything else runs (measured 5-20x slower); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_source(family: str, n_kv: int = 2, heads: int = 6, dtype=torch.float32, vocab: int = 97, seed: int = 0):
    """A tiny random Llama/Mistral/Qwen2 (Qwen2 has q/k/v biases) with O(1) weights and γ ≠ 1."""
    import transformers as T

    cls, ccls = {
        "llama": (T.LlamaForCausalLM, T.LlamaConfig),
        "mistral": (T.MistralForCausalLM, T.MistralConfig),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config),
    }[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    cfg = ccls(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=n_kv,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=family == "llama",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        **extra,
    )
    torch.manual_seed(seed)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) * (3 if "embed" in name else 1))
    return model.to(dtype).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


IDS = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family,n_kv", [("llama", 2), ("llama", 6), ("mistral", 3), ("qwen2", 2), ("qwen2", 1)])
def test_full_rank_conversion_is_exact(family, n_kv):
    src = tiny_source(family, n_kv=n_kv, dtype=torch.float64)
    tpa, report = convert_model_to_tpa(src, progress=False)
    assert isinstance(tpa, TPAForCausalLM) and report.exact
    cfg = tpa.config
    assert cfg.q_rank is None and not cfg.contextual_a and cfg.k_rank == cfg.v_rank == n_kv
    assert cfg.attention_bias == (family == "qwen2")
    assert report.cache_elements_per_token_tpa == report.cache_elements_per_token_source
    ref = logits(src, IDS)
    assert ref.abs().max() > 1
    for path in ("materialize", "factor"):
        tpa.config.tpa_decode_path = path
        assert (logits(tpa, IDS) - ref).abs().max().item() < 1e-10, path
    # the A factors are the paper's GQA masks a_j = G·mask_j
    a = tpa.model.layers[0].self_attn.k_a
    g = 6 // n_kv
    expected = n_kv * torch.kron(torch.eye(n_kv, dtype=a.dtype), torch.ones(1, g, dtype=a.dtype))
    assert torch.equal(a.detach(), expected)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_full_rank_conversion_float32_logits_and_greedy_generation(family):
    src = tiny_source(family, n_kv=2)
    tpa, _ = convert_model_to_tpa(src, progress=False)
    assert (logits(tpa, IDS) - logits(src, IDS)).abs().max().item() <= 1e-4
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    with torch.no_grad():
        a = src.generate(IDS, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = tpa.generate(IDS, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        out = tpa(IDS, use_cache=True)
    assert torch.equal(a, b)
    assert isinstance(out.past_key_values, TPACache)


def test_negative_controls_wrong_grouping_and_reduced_rank_change_logits():
    src = tiny_source("llama", n_kv=3, dtype=torch.float64)
    ref = logits(src, IDS)
    wrong, _ = convert_model_to_tpa(src, group_of=lambda i: (i // 2 + 1) % 3, progress=False)
    assert (logits(wrong, IDS) - ref).abs().max().item() > 1e-1
    errors = {}
    for r in (1, 2, 3):
        tpa, report = convert_model_to_tpa(src, k_rank=r, v_rank=r, progress=False)
        errors[r] = (logits(tpa, IDS) - ref).abs().max().item()
        weight_err = max(max(e.k_weight_rel_err, e.v_weight_rel_err) for e in report.layers)
        assert (weight_err < 1e-12) == (r == 3)
        assert tpa.config.kv_cache_elements_per_token(per_layer=False) == 2 * 2 * r * 8
    assert errors[1] > 1e-1 and errors[2] > 1e-2 and errors[3] < 1e-10


def test_calibration_lowers_the_activation_error():
    src = tiny_source("qwen2", n_kv=3)
    calib = torch.randint(3, 97, (400,), generator=torch.Generator().manual_seed(1))
    _, plain = convert_model_to_tpa(src, k_rank=1, v_rank=2, calib_ids=calib, calibrate=False, progress=False)
    _, fitted = convert_model_to_tpa(src, k_rank=1, v_rank=2, calib_ids=calib, progress=False)
    assert fitted.calibrated and not plain.calibrated
    for p, f in zip(plain.layers, fitted.layers):
        assert f.k_activation_rel_err <= p.k_activation_rel_err + 1e-12
        assert f.v_activation_rel_err <= p.v_activation_rel_err + 1e-12
    assert sum(p.k_activation_rel_err - f.k_activation_rel_err for p, f in zip(plain.layers, fitted.layers)) > 1e-3


def test_bad_requests_are_refused():
    src = tiny_source("llama", n_kv=2)
    for bad in (dict(k_rank=0), dict(v_rank=3)):
        with pytest.raises(ValueError, match="rank"):
            convert_model_to_tpa(src, progress=False, **bad)
    import transformers as T

    qwen3 = T.Qwen3ForCausalLM(
        T.Qwen3Config(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    # QK-norm: full rank is exact (tests/architectures/test_families_qwen3.py); mixing key heads is refused with the
    # reason
    with pytest.raises(ValueError, match="to-tpa below full key rank: qwen3 applies QK-norm per head"):
        convert_model_to_tpa(qwen3, k_rank=1, progress=False)
    # NoPE layers: the TPA model applies RoPE everywhere, so converting SmolLM3 would be wrong
    from hf_symmetry.testing import tiny_model

    with pytest.raises(ValueError, match="to-tpa: smollm3 has layers without RoPE"):
        convert_model_to_tpa(tiny_model("smollm3", dtype=torch.float32), progress=False)


def test_cli_writes_a_loadable_folder_and_refuses_non_empty_out(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_symmetry.cli import main

    src = tiny_source("qwen2", n_kv=2)
    src.save_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    assert main(["to-tpa", str(tmp_path / "src"), str(out), "--no-verify", "--quiet"]) == 0
    assert "exact" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "hf_symmetry_tpa" and "auto_map" in cfg
    report = json.loads((out / "tpa_conversion.json").read_text())
    assert report["exact"] and report["k_rank"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (logits(loaded, IDS) - logits(src, IDS)).abs().max().item() <= 1e-4
    # a non-empty OUT is refused without --overwrite (one-line error, exit 2), replaced with it
    assert main(["to-tpa", str(tmp_path / "src"), str(out), "--no-verify", "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (
        main(["to-tpa", str(tmp_path / "src"), str(out), "--no-verify", "--quiet", "--overwrite", "--k-rank", "1"]) == 0
    )
    assert json.loads((out / "config.json").read_text())["k_rank"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind
    assert main(["to-tpa", str(tmp_path / "src"), str(tmp_path / "o2"), "--k-rank", "5", "--no-verify"]) == 2
    assert "k_rank" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M (real model)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.assets import smollm2_dir, text_path
    from hf_symmetry.text import read_text, tokenize_text

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tokenize_text(tok, read_text(text_path("britannica-eval")), max_tokens=512)
    calib = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=512)
    return {"dir": path, "model": model, "tok": tok, "ids": ids, "calib": calib}


@pytest.mark.slow
def test_smollm2_full_rank_via_cli_reproduces_logits_and_greedy_text(smol, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.cli import main

    out = tmp_path / "smol-tpa"
    assert main(["to-tpa", str(smol["dir"]), str(out), "--no-verify", "--quiet"]) == 0
    tpa = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(tpa) is TPAForCausalLM and tpa.config.k_rank == 3
    tok = AutoTokenizer.from_pretrained(out)  # the tokenizer was copied
    assert tok("Hello world")["input_ids"] == smol["tok"]("Hello world")["input_ids"]
    ids = smol["ids"].unsqueeze(0)
    with torch.no_grad():
        ref = smol["model"](ids).logits
        got = tpa(ids).logits
    assert (got - ref).abs().max().item() <= 1e-3
    prompt = smol["tok"]("The island of Britain is", return_tensors="pt")
    with torch.no_grad():
        a = smol["model"].generate(**prompt, max_new_tokens=16, do_sample=False)
        b = tpa.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert smol["tok"].decode(a[0]) == smol["tok"].decode(b[0])


@pytest.mark.slow
def test_smollm2_reduced_rank_is_approximate_and_calibration_helps(smol):
    from hf_symmetry.conversion.to_tpa import attention_input_grams

    model, ids = smol["model"], smol["ids"][:256].unsqueeze(0)

    def run(m):
        with torch.no_grad():
            lg = m(ids).logits[0].float()
        return lg, torch.nn.functional.cross_entropy(lg[:-1], ids[0, 1:]).exp().item()

    ref, ppl_ref = run(model)
    grams = attention_input_grams(model, smol["calib"][:256], progress=False)
    plain, rp = convert_model_to_tpa(model, k_rank=2, v_rank=2, calib_grams=grams, calibrate=False, progress=False)
    lg_plain, ppl_plain = run(plain)
    del plain
    fitted, rf = convert_model_to_tpa(model, k_rank=2, v_rank=2, calib_grams=grams, progress=False)
    lg_fit, ppl_fit = run(fitted)
    assert rp.cache_elements_per_token_tpa == 2 * 2 * 64 * 30 < rp.cache_elements_per_token_source
    assert (lg_plain - ref).abs().max().item() > 1e-1  # negative control: a reduced rank is not a symmetry
    assert ppl_ref < ppl_fit < 10 * ppl_ref and math.isfinite(ppl_plain)
    act_plain = sum(e.k_activation_rel_err + e.v_activation_rel_err for e in rp.layers)
    act_fit = sum(e.k_activation_rel_err + e.v_activation_rel_err for e in rf.layers)
    assert act_fit < act_plain


def test_fused_phi3_converts_exactly_through_the_adapter():
    """Phi-3 / Phi-4 (fused qkv_proj and gate_up_proj, partial rotary 0.75): the adapter splits the fused
    projections, so to-tpa needs no Phi-specific path; full rank is exact on every attention route, and a
    reduced key rank is not (negative control)."""
    from hf_symmetry.architectures.capabilities import allows
    from hf_symmetry.testing import input_ids, outputs, tiny_model

    model = tiny_model("phi3")
    assert allows(model.config, "to_tpa")
    tpa, report = convert_model_to_tpa(model, progress=False)
    assert report.exact and tpa.config.rotary_dim == 6
    ids = input_ids()
    for path in ("materialize", "factor"):
        tpa.config.tpa_decode_path = path
        assert (outputs(tpa, ids) - outputs(model, ids)).abs().max().item() <= 1e-9, path
    reduced, _ = convert_model_to_tpa(model, k_rank=1, progress=False)
    assert (outputs(reduced, ids) - outputs(model, ids)).abs().max().item() > 1e-3


def _whole_layer_reference(model, k_rank, v_rank, grams=None):
    """The conversion as it was before the checkpoint path read only k/v in float64: every layer
    whole, as float64 canonical tensors (the in-memory path), cast back to the model's dtype."""
    tpa, _ = convert_model_to_tpa(model, k_rank=k_rank, v_rank=v_rank, calib_grams=grams, progress=False)
    return tpa.state_dict()


def _written(folder):
    from safetensors.torch import load_file

    from hf_symmetry.conversion.layer_map import MAP_FILE

    return {k: v for f in sorted(folder.glob("*.safetensors")) if f.name != MAP_FILE for k, v in load_file(f).items()}


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16), ("phi3", torch.float32)])
def test_checkpoint_conversion_passes_unchanged_matrices_through_and_writes_the_same_tensors(tmp_path, family, dtype):
    """The streamed conversion reads only the key/value projections and the vectors in float64 and
    passes q, o and the FFN through in their own dtype, one at a time: it writes exactly the tensors
    of the whole-layer float64 conversion (float32, bfloat16, fused Phi-3 projections). Negative
    control: a different key rank changes them."""
    from hf_symmetry.conversion.to_tpa import ToTPAOptions, convert_checkpoint_to_tpa
    from hf_symmetry.testing import tiny_model

    model = (tiny_model("phi3") if family == "phi3" else tiny_source(family, n_kv=3)).to(dtype).eval()
    model.save_pretrained(tmp_path / "src")
    convert_checkpoint_to_tpa(
        tmp_path / "src", tmp_path / "tpa", ToTPAOptions(k_rank=1, v_rank=2), progress=False, max_shard_size=20_000
    )  # several shards
    got = _written(tmp_path / "tpa")
    want = _whole_layer_reference(model, 1, 2)
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    assert all(got[k].dtype == dtype and torch.equal(got[k], want[k]) for k in got)
    other = _whole_layer_reference(model, 2, 2)
    assert not all(torch.equal(got[k], other[k]) for k in got)


@pytest.mark.slow  # SmolLM2's tokenizer (the model is built once from its GGUF)
def test_calibrated_checkpoint_conversion_writes_the_tensors_fitted_to_the_same_grams(tmp_path):
    """Calibrated: the streamed conversion (the engine's Gram of layer i computed just before layer i
    is converted, the engine's layer let go first) writes exactly the tensors of the whole-layer
    conversion fitted to the same Grams; Grams of other text give other tensors (negative control)."""
    import shutil

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.calibration import CalibrationText, calibration_ids
    from hf_symmetry.conversion.to_tpa import ToTPAOptions, attention_input_grams, convert_checkpoint_to_tpa
    from transformers import AutoTokenizer

    model = tiny_source("llama", n_kv=3, vocab=49152)  # SmolLM2's tokenizer
    model.save_pretrained(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_dir() / name, tmp_path / "src" / name)
    report = convert_checkpoint_to_tpa(
        tmp_path / "src",
        tmp_path / "tpa",
        ToTPAOptions(k_rank=1, v_rank=1, calibration=CalibrationText("britannica-calib", 96)),
        progress=False,
    )
    assert report.calibrated and report.calib_tokens == 96
    ids = calibration_ids(AutoTokenizer.from_pretrained(tmp_path / "src"), "britannica-calib", 96)
    got = _written(tmp_path / "tpa")
    want = _whole_layer_reference(model, 1, 1, attention_input_grams(tmp_path / "src", ids, progress=False))
    assert all(torch.equal(got[k], want[k]) for k in got)
    other = _whole_layer_reference(model, 1, 1, attention_input_grams(tmp_path / "src", ids[:40], progress=False))
    assert not all(torch.equal(got[k], other[k]) for k in got)
