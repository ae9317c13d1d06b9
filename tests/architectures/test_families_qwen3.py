"""Qwen3 (per-head QK-norm) in to-tpa and compress: QK-norm acts on the heads, not on the residual stream,
so every conversion that rotates or slices only the stream, or keeps the key heads apart, stays exact once the
output family has the norm. The TPA and compressed families gain it (a ``qk_norm`` config field, which the
capability table reads). Exact on a tiny float64 Qwen3, a negative control each, refusals with the reason
where the math does not hold, and the written folders load with ``trust_remote_code`` without hf_symmetry."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import hf_symmetry  # noqa: F401  (registers the families)
from hf_symmetry.architectures import UnsupportedSymmetry
from hf_symmetry.architectures.capabilities import allows, reason
from hf_symmetry.conversion import compress as C
from hf_symmetry.conversion.to_tpa import convert_checkpoint_to_tpa, convert_model_to_tpa
from hf_symmetry.testing import SEQ40, full_width, input_ids, outputs, run_without_hf_symmetry, tiny_config, tiny_model


def _delta(a, b, ids=None) -> float:
    ids = input_ids() if ids is None else ids
    return (outputs(a, ids) - outputs(b, ids)).abs().max().item()


def test_qwen3_capabilities_follow_the_output_families_qk_norm_field():
    cfg = tiny_config("qwen3")
    for what in ("compress", "slicegpt", "to_tpa", "residual_rotation", "vo_rotation"):
        assert allows(cfg, what), (what, reason(cfg, what))
    assert "qwen3 applies QK-norm per head" in reason(cfg, "to_tpa_key_rank")
    assert "qwen3 applies QK-norm per head" in reason(cfg, "qk_rotation")
    assert reason(tiny_config("llama"), "to_tpa_key_rank") is None
    # OLMo 2's QK-norm spans all heads at once: neither output family implements that (and its output norms
    # are refused first)
    assert not allows(tiny_config("olmo2"), "to_tpa") and not allows(tiny_config("olmo2"), "compress")


# --------------------------------------------------------------------------- to-tpa
def test_to_tpa_full_rank_is_exact_on_qwen3_and_the_qk_norm_matters():
    model = tiny_model("qwen3")
    tpa, report = convert_model_to_tpa(model, progress=False)
    assert report.exact and tpa.config.qk_norm and tpa.config.k_rank == model.config.num_key_value_heads
    assert outputs(model, input_ids()).abs().max() > 1
    for path in ("materialize", "factor"):  # the norm acts on each key factor: factor routes stay exact
        tpa.config.tpa_decode_path = path
        assert _delta(model, tpa) <= 1e-9, path
    # negative control: the converted model without the learned QK-norm γ is another function
    with torch.no_grad():
        tpa.model.layers[1].self_attn.k_norm.weight.fill_(1.0)
    assert _delta(model, tpa) > 1e-3


def test_to_tpa_on_qwen3_reduces_values_but_refuses_to_mix_key_heads():
    model = tiny_model("qwen3")
    tpa, report = convert_model_to_tpa(model, v_rank=1, progress=False)
    assert not report.exact and tpa.config.v_rank == 1 and _delta(model, tpa) > 1e-3
    with pytest.raises(UnsupportedSymmetry, match="to-tpa below full key rank: qwen3 applies QK-norm per head"):
        convert_model_to_tpa(model, k_rank=1, progress=False)


def test_to_tpa_reads_fused_and_per_head_sources_through_the_adapter_only_where_allowed():
    # partial rotary (tiny phi3) and GPT-NeoX: refused with the structural reason, before any work
    with pytest.raises(UnsupportedSymmetry, match="to-tpa: gpt_neox uses LayerNorm"):
        convert_model_to_tpa(tiny_model("gpt_neox", dtype=torch.float32), progress=False)


# --------------------------------------------------------------------------- compress
@pytest.mark.parametrize("structure", ["kron", "gs"])
def test_full_rank_compression_of_qwen3_is_exact_and_the_qk_norm_matters(structure, exact_rmsnorm):
    from test_compressed_llama import _exact_compression

    model = tiny_model("qwen3")
    compressed, cfg = _exact_compression(model, structure)  # random per-segment rotations, Cayley skips
    assert cfg["qk_norm"] and cfg["skip_connections"] == "orthogonal"
    assert _delta(model, compressed) <= 1e-9
    with torch.no_grad():
        compressed.model.layers[0].self_attn.q_norm.weight.fill_(1.0)
    assert _delta(model, compressed) > 1e-3


def test_full_width_slicegpt_of_qwen3_is_exact(exact_rmsnorm):
    model = tiny_model("qwen3")
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", q_mode="segment", ratio=0.25, ratio_slack=1.0)
    src = C.DictSource({k: v.detach() for k, v in model.state_dict().items()})
    plan = C.plan_for(src, config, options)[0]
    full_width(plan)
    state, cfg, _ = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            calib_ids=calib,
            hf_config=model.config,
            plan=plan,
            dtype=torch.float64,
            progress=False,
            calibration=SEQ40,
        )
    )
    compressed = C.build_model(state, cfg, torch.float64)[0]
    assert _delta(model, compressed) <= 1e-9
    # negative control: sliced for real (25 %), the function changes
    sliced, _ = C.compress_model(
        model, C.CompressOptions(structure="slice", ratio=0.25, ratio_slack=1.0), calib_ids=calib, calibration=SEQ40
    )
    assert sliced.config.residual_size < model.config.hidden_size and _delta(model, sliced) > 1e-3


# --------------------------------------------------------------------------- remote code
_REMOTE_SCRIPT = textwrap.dedent("""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    ref = load_file(FOLDER + "/expected.safetensors")
    result = {}
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(FOLDER + "/" + name, trust_remote_code=True, dtype=torch.float64)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ref["ids"]).logits
        generated = model.generate(ref["ids"][:, :8], max_new_tokens=6, do_sample=False)
        result[name] = [type(model).__name__, (logits - ref[name]).abs().max().item(), generated[0, 8:].tolist()]
    print(json.dumps(result))
""")


def run_remote(folder, names: list[str], tmp_path) -> dict:
    """Load each ``folder/name`` with trust_remote_code in a Python where hf_symmetry is not importable."""
    return run_without_hf_symmetry(_REMOTE_SCRIPT, tmp_path, FOLDER=str(folder), NAMES=names)


def test_new_output_folders_load_as_remote_code_without_hf_symmetry(tmp_path):
    """to-tpa streams a Qwen3 checkpoint (read through the adapter, one layer at a time); compress's
    full-rank Kronecker model of it is saved as compress saves it; and an OPT sliced by SliceGPT (the
    RMS-decoder family with a narrower stream). All load with trust_remote_code where hf_symmetry is not
    importable (one subprocess), reproduce the logits they had here and generate (the TPA model: the
    original's greedy tokens)."""
    from test_compressed_llama import _exact_compression
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen3")
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "out"
    report = convert_checkpoint_to_tpa(src, out / "tpa", progress=False)
    assert report.exact and json.loads((out / "tpa" / "config.json").read_text())["qk_norm"] is True
    native = AutoModelForCausalLM.from_pretrained(out / "tpa", dtype=torch.float64).eval()
    assert _delta(model, native) <= 1e-9
    compressed, _ = _exact_compression(model, "kron")
    compressed.save_pretrained(out / "compressed")
    assert {"modeling_compressed_llama.py", "configuration_compressed_llama.py"} <= {
        p.name for p in (out / "compressed").iterdir()
    }

    opt = tiny_model("opt")
    sliced, _ = C.compress_model(
        opt,
        C.CompressOptions(structure="slice", ratio=0.25, ratio_slack=1.0),
        calib_ids=input_ids(batch=1, length=120, seed=3)[0],
        calibration=SEQ40,
    )
    sliced.save_pretrained(out / "sliced_opt")

    ids = input_ids(batch=1, length=16)
    expected = {
        "ids": ids,
        "tpa": outputs(model, ids).contiguous(),
        "compressed": outputs(compressed, ids).contiguous(),
        "sliced_opt": outputs(sliced, ids).contiguous(),
    }
    with torch.no_grad():
        tokens = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    save_file(expected, str(out / "expected.safetensors"))
    result = run_remote(out, ["tpa", "compressed", "sliced_opt"], tmp_path)
    assert result["sliced_opt"][0] == "RMSDecoderForCausalLM" and result["sliced_opt"][1] <= 1e-9
    assert result["tpa"][0] == "TPAForCausalLM" and result["tpa"][1] <= 1e-9 and result["tpa"][2] == tokens
    assert result["compressed"][0] == "CompressedLlamaForCausalLM" and result["compressed"][1] <= 1e-9
    # and that is the original's function (to float32 round-off: Qwen3's own RMSNorms compute in float32 here)
    assert (outputs(compressed, ids) - outputs(model, ids)).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- sequential calibration, allocation
def test_sequential_walk_of_qwen3_measures_the_one_pass_statistics(exact_rmsnorm):
    """The calibration engine's sequential mode runs each Qwen3 layer as transformers' own module, QK-norm
    included: with nothing replaced its statistics are those of one pass of the original model."""
    from test_compressed_llama import _assert_targets_are_own_outputs, _rel, _walk

    model = tiny_model("qwen3")
    calib = input_ids(batch=1, length=110, seed=3)[0]
    visited = []
    seq, ref = _walk(model, calib, lambda k, stats: visited.append(k) or [])
    assert visited == list(range(2 * model.config.num_hidden_layers + 1)) and seq.tokens == ref.tokens == 110
    for name in ("normed", "attn_out", "mlp_hidden"):
        for a, b in zip(getattr(seq, name), getattr(ref, name)):
            assert _rel(a, b) < 1e-10, name
    assert all(_rel(a, b) < 1e-10 for a, b in zip(seq.normed_cross, ref.normed))
    _assert_targets_are_own_outputs(model, seq)
    # negative control: the same walk over the model without its QK-norm γ measures other attention outputs
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.mul_(3.0)
    changed, _ = _walk(model, calib)
    assert max(_rel(a, b) for a, b in zip(changed.attn_out, ref.attn_out)) > 1e-3


@pytest.mark.parametrize("structure", ["gs", "lowrank"])
def test_full_rank_sequential_stage_w_of_qwen3_reproduces_the_model(structure, exact_rmsnorm):
    """--sequential on Qwen3: full-rank structures at random per-segment rotations, each segment solved on
    the statistics of the partly converted model, give back the original function."""
    from test_compressed_llama import _full_rank, _placement64, _source
    from hf_symmetry.symmetry.groups import haar_orthogonal, rng

    model = tiny_model("qwen3")
    config = model.config.to_dict()
    options = C.CompressOptions(
        structure=structure,
        ratio=0.25,
        stage="w",
        sequential=True,
        match_original=True,
        f_iters=1,
        w_iters=2,
        als_iters=2,
        wopp_iters=10,
        ratio_slack=1.0,
    )
    src = _source(model)
    plan = _full_rank(C.plan_for(src, config, options)[0])
    Qs = [haar_orthogonal(plan.hidden, rng(0, k)) for k in range(2 * plan.n_layers + 1)]
    state, cfg, report = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            calib_ids=input_ids(batch=1, length=120, seed=3)[0],
            hf_config=model.config,
            plan=plan,
            rotations=Qs if structure == "gs" else None,
            dtype=torch.float64,
            progress=False,
            placement=_placement64(),
            calibration=SEQ40,
        )
    )
    assert report.options["sequential"] and cfg["qk_norm"]
    compressed = C.build_model(state, cfg, torch.float64)[0]
    ref = outputs(model, input_ids())
    assert ((outputs(compressed, input_ids()) - ref).abs().max() / ref.abs().max()).item() <= 1e-9
    with torch.no_grad():  # negative control: the compressed model needs Qwen3's per-head norm
        compressed.model.layers[1].self_attn.k_norm.weight.fill_(1.0)
    assert _delta(model, compressed) > 1e-3


@pytest.mark.slow
def test_qwen3_compress_cli_with_sequential_and_sensitivity_allocation(tmp_path):
    """The command on a Qwen3 folder: --sequential and --allocation sensitivity (structured and SliceGPT
    widths) run, meet the parameter budget the report counts, keep the QK-norm, and load as written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.cli import main

    model = tiny_model("qwen3", dtype=torch.float32, vocab_size=49152)
    src = tmp_path / "src"
    model.save_pretrained(src)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(src)
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    common = [
        "--calib",
        str(calib),
        "--calib-seq-len",
        "64",
        "--f-iters",
        "1",
        "--w-iters",
        "2",
        "--quiet",
        "--no-verify",
    ]
    runs = {
        "seq": ["--structure", "lowrank", "--sequential", "--ratio", "0.2"],
        "alloc": ["--structure", "lowrank", "--allocation", "sensitivity", "--ratio", "0.2"],
        "widths": ["--structure", "slice", "--allocation", "sensitivity", "--ratio", "0.2"],
    }
    ids = input_ids(batch=1, length=12)
    for name, flags in runs.items():
        out = tmp_path / name
        assert main(["compress", str(src), str(out), *flags, *common]) == 0, name
        cfg = json.loads((out / "config.json").read_text())
        acc = json.loads((out / "compression_report.json").read_text())["accounting"]
        assert cfg["qk_norm"] is True, name
        assert acc["compressed_model_params"] == acc["compressed_model_params_counted"], name
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert sum(p.numel() for p in loaded.parameters()) == acc["compressed_model_params"], name
        logits = outputs(loaded, ids)
        assert torch.isfinite(logits).all() and _delta(model.float(), loaded, ids) > 1e-4, name
    assert len(set(json.loads((tmp_path / "widths" / "config.json").read_text())["residual_sizes"])) > 1
