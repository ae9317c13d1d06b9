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
from hf_symmetry.symmetry import structured as S
from hf_symmetry.testing import input_ids, outputs, tiny_config, tiny_model, run_without_hf_symmetry


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
    for path in ("materialize", "factor"):     # the norm acts on each key factor: factor routes stay exact
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
    from test_compress_model import _exact_compression

    model = tiny_model("qwen3")
    compressed, cfg = _exact_compression(model, structure)   # random per-segment rotations, Cayley skips
    assert cfg["qk_norm"] and cfg["skip_connections"] == "orthogonal"
    assert _delta(model, compressed) <= 1e-9
    with torch.no_grad():
        compressed.model.layers[0].self_attn.q_norm.weight.fill_(1.0)
    assert _delta(model, compressed) > 1e-3


def test_full_width_slicegpt_of_qwen3_is_exact(exact_rmsnorm):
    model = tiny_model("qwen3")
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", q_mode="segment", ratio=0.25, calib_seq_len=40, tolerance=1.0)
    src = C.DictSource({k: v.detach() for k, v in model.state_dict().items()})
    plan = C.plan_for(src, config, options)[0]
    plan.residual = plan.hidden
    for m in plan.matrices:
        m.structure = S.Dense((m.structure.shape[0], plan.hidden))
    state, cfg, _ = C.compress_tensors(src, config, options, calib_ids=calib, dtype=torch.float64,
                                       progress=False, plan=plan, hf_config=model.config)
    compressed = C.build_model(state, cfg, torch.float64)[0]
    assert _delta(model, compressed) <= 1e-9
    # negative control: sliced for real (25 %), the function changes
    sliced, _ = C.compress_model(model, C.CompressOptions(structure="slice", ratio=0.25, calib_seq_len=40,
                                                          tolerance=1.0), calib_ids=calib)
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
    from test_compress_model import _exact_compression
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
        p.name for p in (out / "compressed").iterdir()}

    opt = tiny_model("opt")
    sliced, _ = C.compress_model(opt, C.CompressOptions(structure="slice", ratio=0.25, calib_seq_len=40, tolerance=1.0),
                                 calib_ids=input_ids(batch=1, length=120, seed=3)[0])
    sliced.save_pretrained(out / "sliced_opt")

    ids = input_ids(batch=1, length=16)
    expected = {"ids": ids, "tpa": outputs(model, ids).contiguous(), "compressed": outputs(compressed, ids).contiguous(),
                "sliced_opt": outputs(sliced, ids).contiguous()}
    with torch.no_grad():
        tokens = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    save_file(expected, str(out / "expected.safetensors"))
    result = run_remote(out, ["tpa", "compressed", "sliced_opt"], tmp_path)
    assert result["sliced_opt"][0] == "RMSDecoderForCausalLM" and result["sliced_opt"][1] <= 1e-9
    assert result["tpa"][0] == "TPAForCausalLM" and result["tpa"][1] <= 1e-9 and result["tpa"][2] == tokens
    assert result["compressed"][0] == "CompressedLlamaForCausalLM" and result["compressed"][1] <= 1e-9
    # and that is the original's function (to float32 round-off: Qwen3's own RMSNorms compute in float32 here)
    assert (outputs(compressed, ids) - outputs(model, ids)).abs().max().item() <= 1e-5
