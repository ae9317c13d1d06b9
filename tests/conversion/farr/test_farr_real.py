"""FaRR on real checkpoints in float32: SmolLM2-135M (Llama, full RoPE, GQA 9/3) and
all-MiniLM-L6-v2 (BERT, q/k/v biases), on real text."""

import pytest
import torch

from hf_symmetry.conversion.farr import FarrOptions, farr_model
from hf_symmetry.evaluation.compare import model_output
from hf_symmetry.conversion.farr.fused_check import check_fused_layout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(minilm_dir).eval()


@pytest.fixture(scope="module")
def minilm_ids(minilm_dir):
    from transformers import AutoTokenizer

    from hf_symmetry.assets import text_path

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    return tok(text_path("britannica-eval").read_text()[:4000], return_tensors="pt", truncation=True, max_length=256)[
        "input_ids"
    ][0]


def test_smollm2_full_rank_reproduces_logits_and_truncation_changes_them(smollm2, eval_ids):
    ref = model_output(smollm2, eval_ids)
    full, report = farr_model(smollm2, FarrOptions(tau=1.0))
    assert report.ranks["vo"] == [64] * 30
    delta = (ref - model_output(full, eval_ids)).abs().max().item()
    print(f"SmolLM2 FaRR at full rank: max |Δlogit| = {delta:.2e} over {eval_ids.numel()} tokens")
    assert delta <= 1e-3
    # negative control: dropping the weakest fused direction of one KV group in one layer is visible
    o_proj = full.model.layers[5].self_attn.o_proj
    with torch.no_grad():
        o_proj.weight[:, 63] = 0.0  # column 63 of head 0 = the group's 64th singular direction
    assert (ref[:, :128] - model_output(full, eval_ids[:128])).abs().max().item() > 1e-2


def test_smollm2_layout_check_and_qk_refusal(smollm2, eval_ids):
    check = check_fused_layout(smollm2, eval_ids[:64], tolerance=1e-4)
    print(f"SmolLM2 layout check: per head {check.vo_max_rel_error:.1e}, total {check.total_max_rel_error:.1e}")
    assert check.passed and check.qk_max_abs_error is None  # full RoPE: no score map to check
    with pytest.raises(ValueError, match="RoPE"):
        farr_model(smollm2, FarrOptions(tau=0.999, qk=True))


def test_minilm_full_rank_qk_and_vo_reproduces_hidden_states(minilm, minilm_ids):
    ref = model_output(minilm, minilm_ids)
    full, report = farr_model(minilm, FarrOptions(tau=1.0, qk=True))
    assert report.ranks == {"vo": [32] * 6, "qk": [32] * 6}
    delta = (ref - model_output(full, minilm_ids)).abs().max().item()
    print(f"MiniLM FaRR (QK+VO) at full rank: max |Δhidden| = {delta:.2e} over {minilm_ids.numel()} tokens")
    assert delta <= 1e-3
    cut, _ = farr_model(minilm, FarrOptions(params_fraction=0.9, qk=True))  # negative control
    assert (ref - model_output(cut, minilm_ids)).abs().max().item() > 1e-2


def test_minilm_layout_check_covers_value_and_score_paths(minilm, minilm_ids):
    check = check_fused_layout(minilm, minilm_ids[:64], tolerance=1e-4)
    print(f"MiniLM layout check: per head {check.vo_max_rel_error:.1e}, attention probs {check.qk_max_abs_error:.1e}")
    assert check.passed and check.qk_max_abs_error is not None


def test_minilm_calibrated_cli_writes_a_remote_code_encoder(tmp_path, capsys, minilm, minilm_ids):
    from transformers import AutoModel

    from hf_symmetry import cli

    out = tmp_path / "minilm-farr"
    assert (
        cli.main(
            [
                "farr",
                "minilm",
                str(out),
                "--params-fraction",
                "0.9",
                "--qk",
                "--calibrate",
                "britannica-calib",
                "--calib-tokens",
                "512",
                "--tokens",
                "128",
                "--quiet",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "calibrated on 512 tokens" in text and "mean cosine of last hidden states" in text
    reduced = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(reduced).__name__ == "FarrBertModel"
    assert reduced.config.v_head_dims != [32] * 6 or reduced.config.qk_head_dims != [32] * 6
    with torch.no_grad():
        a = minilm(input_ids=minilm_ids[None]).last_hidden_state[0]
        b = reduced(input_ids=minilm_ids[None]).last_hidden_state[0]
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    print(f"MiniLM FaRR (QK+VO, 90% of their parameters, calibrated): mean cosine {cosine:.4f}")
    assert 0.9 < cosine < 1.0
