"""Stock SliceGPT (issue 29, item 1): one global PCA and one width written as the source's own stock
family with ``hidden_size = d′`` (``hf_symmetry.conversion.compress.stock``). It must load without
hf_symmetry and without remote code, and give the compressed family's logits from the same slice; left
out, the normalisation constant √(d/d′) (and ε d/d′) changes them."""

from __future__ import annotations

import json
import math

from dataclasses import replace
import pytest
import torch

import hf_symmetry  # noqa: F401
from hf_symmetry.cli import main
from hf_symmetry.conversion import compress as C
from hf_symmetry.conversion.compress import stock as S
from hf_symmetry.conversion.compress.moments import one_pass_statistics
from hf_symmetry.conversion.compress.pca import pca_rotations
from hf_symmetry.conversion.compress.plan import accounting, plan_for
from hf_symmetry.solvers import structures as st
from hf_symmetry.testing import SEQ40, input_ids, outputs, run_without_hf_symmetry, tiny_model

OPTIONS = C.CompressOptions(structure="slice", ratio=0.25, ratio_slack=1.0)
FULL_ROTARY = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


def compressed_plan_at(source, config: dict, options, width: int):
    """The compressed family's SliceGPT plan (one global PCA) at residual width ``width`` instead of the
    ratio's: the stock route's slice in the remote-code family, for comparisons."""
    plan, _ = plan_for(source, config, options.with_(ratio_slack=1.0))
    plan.residual = int(width)
    plan.matrices = [replace(m, structure=st.Dense((m.shape[0], int(width)))) for m in plan.matrices]
    acc = plan.accounting
    plan.accounting = accounting(
        plan, acc.dense_model_params, acc.dense_params_of_compressed_matrices, acc.target_params, options
    )
    return plan


@pytest.fixture
def exact_norms(exact_rmsnorm, monkeypatch):
    """float64-exact RMSNorms, Phi-3's too."""
    from transformers.models.phi3 import modeling_phi3

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_phi3.Phi3RMSNorm, "forward", forward)


def _untied_view(model):
    """The same model as an untied source (its head a copy of the embedding): the compressed family's
    ``separate`` head, which is what a stock untied head computes."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    if config.get("tie_word_embeddings", True):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        config = {**config, "tie_word_embeddings": False}
    return C.DictSource(state), config


def _same_slice(model, width, calib, placement=None, **controls):
    """(stock model, its report, compressed-family model) at ``width`` from one measured rotation."""
    source, config = C.DictSource({k: v.detach() for k, v in model.state_dict().items()}), model.config.to_dict()
    stats = one_pass_statistics(
        C.CompressRun(source, config, OPTIONS, calib, placement, progress=False, calibration=SEQ40)
    )
    Q = pca_rotations(stats, 2 * config["num_hidden_layers"] + 1, "global")[0]
    stock, report = S.stock_slice_model(
        model, OPTIONS, calib, S.StockSlice(untie=True, round_to=1, **controls), width=width, rotation=Q
    )
    usource, uconfig = _untied_view(model)
    plan = compressed_plan_at(usource, uconfig, OPTIONS, width)
    dtype = next(model.parameters()).dtype
    state, new_config, _ = C.compress_tensors(
        C.CompressRun(
            usource,
            uconfig,
            OPTIONS,
            calib_ids=calib,
            plan=plan,
            stats=stats,
            dtype=dtype,
            progress=False,
            calibration=SEQ40,
        )
    )
    compressed, _ = C.build_model(state, new_config, dtype)
    return stock, report, compressed


def _float64():
    from hf_symmetry.devices import resolve

    return resolve("cpu", "float64")


@pytest.mark.parametrize(
    "family,width,cls",
    [
        ("llama", 36, "LlamaForCausalLM"),
        ("llama", 32, "MistralForCausalLM"),
        ("qwen2", 32, "Qwen2ForCausalLM"),
        ("qwen3", 30, "Qwen3ForCausalLM"),
        ("mistral", 40, "MistralForCausalLM"),
        ("phi3", 32, "Phi3ForCausalLM"),
    ],
)
def test_stock_slice_gives_the_compressed_familys_logits(family, width, cls, exact_norms):
    """Tied (llama, qwen3: untied here) and untied sources, biases (qwen2), QK-norm (qwen3: q and k carry
    c²), fused projections (phi3); a Llama width that is not a multiple of its heads is a Mistral."""
    model = tiny_model(family, **(FULL_ROTARY if family == "phi3" else {}))
    calib = input_ids(batch=1, length=120, seed=3)[0]
    stock, report, compressed = _same_slice(model, width, calib, _float64())
    assert type(stock).__name__ == cls and stock.config.hidden_size == width
    d = model.config.hidden_size
    assert report.accounting.norm_constant == pytest.approx(math.sqrt(d / width))
    assert stock.config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps * d / width)
    assert all(
        torch.equal(p, torch.ones_like(p))
        for n, p in stock.named_parameters()
        if n.endswith("layernorm.weight") or n == "model.norm.weight"
    )
    ids = input_ids()
    ref = outputs(compressed, ids)
    assert (outputs(stock, ids) - ref).abs().max() < 1e-10
    assert sum(p.numel() for p in stock.parameters()) == report.accounting.compressed_model_params
    # the whole accounting is at the width given, not the ratio's
    assert {m["structure"]["width"] for m in report.accounting.per_matrix.values()} == {width}
    assert report.accounting.residual == width and report.accounting.round_to is None
    # negative controls: the constant left out changes the logits clearly; ε not rescaled, slightly
    without, _, _ = _same_slice(model, width, calib, _float64(), constant=False, rescale_eps=False)
    assert (outputs(without, ids) - ref).abs().max() > 0.1
    eps_only, _, _ = _same_slice(model, width, calib, _float64(), rescale_eps=False)
    assert 1e-8 < (outputs(eps_only, ids) - ref).abs().max() < 1e-2


def test_stock_slice_refuses_what_needs_the_compressed_family():
    tied = tiny_model("llama").config.to_dict()
    untied = tiny_model("qwen2").config.to_dict()
    assert S.why_not_stock(untied, OPTIONS) is None and S.why_not_stock(tied, OPTIONS, untie=True) is None
    assert "--untie" in S.why_not_stock(tied, OPTIONS)
    assert "skip" in S.why_not_stock(untied, OPTIONS.with_(q_mode="segment"))
    assert "widths" in S.why_not_stock(untied, OPTIONS.with_(allocation="sensitivity"))
    assert "SliceGPT" in S.why_not_stock(untied, C.CompressOptions(structure="kron"))
    assert "opt" in S.why_not_stock(tiny_model("opt").config.to_dict(), OPTIONS)


def _calib(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    return path


def _folder(tmp_path, family, **overrides):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / family
    tiny_model(family, dtype=torch.float32, **overrides).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    return folder


_LOAD = """
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor(IDS)).logits
print(json.dumps({"cls": type(model).__name__, "logits": logits.tolist(),
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def test_cli_writes_the_stock_class_that_loads_without_remote_code(tmp_path, capsys):
    """``compress --structure slice`` on an untied Qwen2 folder: a stock Qwen2 (no auto_map, no code files)
    loaded by a Python without hf_symmetry; its logits are the compressed family's at the same width
    from the same calibration."""
    from hf_symmetry.evaluation.compare import load_tokenizer
    from hf_symmetry.text import read_text, tokenize_text

    src, calib = _folder(tmp_path, "qwen2", hidden_size=96), _calib(tmp_path)
    out = tmp_path / "out"
    assert (
        main(
            [
                "compress",
                str(src),
                str(out),
                "--structure",
                "slice",
                "--calib",
                str(calib),
                "--calib-seq-len",
                "64",
                "--round-to",
                "8",
                "--no-verify",
                "--quiet",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "output: stock Qwen2ForCausalLM (no remote code)" in text and "multiple of 8" in text
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == ["Qwen2ForCausalLM"]
    assert not list(out.glob("*.py"))
    acc = json.loads((out / "compression_report.json").read_text())["accounting"]
    w = acc["residual"]
    assert config["hidden_size"] == w and w % 8 == 0 and acc["untied_head_params"] == 0
    assert "loads without `trust_remote_code`" in (out / "README.md").read_text()
    ids = input_ids(batch=1, length=16)
    got = run_without_hf_symmetry(_LOAD, tmp_path, OUT=str(out), IDS=ids.tolist())
    assert got["cls"] == "Qwen2ForCausalLM" and got["params"] == acc["compressed_model_params"]
    assert acc["compressed_model_params"] == acc["compressed_model_params_counted"]
    # the compressed family from the same calibration (the CLI's own: CPU, float32 statistics)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    calibration = replace(C.CALIBRATION, seq_len=64)
    calib_ids = tokenize_text(load_tokenizer(src), read_text(calib), max_tokens=calibration.tokens)
    options = OPTIONS
    source, cfg = _untied_view(model)
    stats = one_pass_statistics(C.CompressRun(source, cfg, options, calib_ids, progress=False, calibration=calibration))
    state, new_config, _ = C.compress_tensors(
        C.CompressRun(
            source,
            cfg,
            options,
            calib_ids=calib_ids,
            stats=stats,
            plan=compressed_plan_at(source, cfg, options, w),
            progress=False,
            calibration=calibration,
        )
    )
    compressed, _ = C.build_model(state, new_config)
    ref = outputs(compressed, ids)
    assert (torch.tensor(got["logits"]) - ref).abs().max() < 1e-4 * ref.abs().max()


def test_round_to_and_the_untie_cost_are_reported(tmp_path, capsys):
    """A tied Llama: without --untie the output stays in the compressed family and the report says what
    untying would cost; with --untie the head's vocab × width is in the budget and in the report; widths
    are rounded (--round-to), an impossible rounding fails before any output."""
    src, calib = _folder(tmp_path, "llama", hidden_size=96), _calib(tmp_path)
    common = ["--structure", "slice", "--calib", str(calib), "--calib-seq-len", "64", "--no-verify", "--quiet"]
    assert main(["compress", str(src), str(tmp_path / "tied"), *common]) == 0
    text = capsys.readouterr().out
    assert "output: compressed family" in text and "--untie would cost vocab × width" in text
    assert "auto_map" in json.loads((tmp_path / "tied" / "config.json").read_text())

    for n in (8, 16):
        out = tmp_path / f"untied{n}"
        assert main(["compress", str(src), str(out), *common, "--untie", "--round-to", str(n)]) == 0
        text = capsys.readouterr().out
        acc = json.loads((out / "compression_report.json").read_text())["accounting"]
        w = acc["residual"]
        assert w % n == 0 and acc["round_to"] == n and abs(w - acc["width_unrounded"]) <= n
        assert f"width {acc['width_unrounded']} rounded to a multiple of {n}" in text
        assert acc["untied_head_params"] == 97 * w and f"vocab × width = {97 * w:,}" in text
        assert acc["compressed_model_params"] == acc["compressed_model_params_counted"]
        assert "auto_map" not in json.loads((out / "config.json").read_text())
    # the untied head is paid for: at the same ratio the stock width is narrower than the tied, mixed one's
    tied_mix = json.loads((tmp_path / "tied" / "compression_report.json").read_text())["accounting"]["head_mix_params"]
    assert json.loads((tmp_path / "untied8" / "compression_report.json").read_text())["accounting"][
        "residual"
    ] < math.isqrt(tied_mix)
    assert main(["compress", str(src), str(tmp_path / "bad"), *common, "--untie", "--round-to", "128"]) == 2
    assert "--round-to 128 exceeds the hidden size 96" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main(["compress", str(src), str(tmp_path / "bad"), "--structure", "lowrank", "--untie"]) == 2
    assert "--structure slice" in capsys.readouterr().err
    assert main(["compress", str(src), str(tmp_path / "bad"), *common, "--untie", "--remote-code"]) == 2
    assert "--remote-code writes the compressed family" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_stock_slice_equals_the_compressed_family(smollm2, smollm2_tokenizer, eval_ids):
    """SmolLM2 (tied, 9 heads, d = 576) at d′ = 384 (25 % of the width off, a multiple of 64): a
    MistralForCausalLM (384 is not a multiple of 9 heads) equal to the compressed family in float32."""
    from hf_symmetry.assets import text_path
    from hf_symmetry.text import read_text, tokenize_text

    calib = tokenize_text(smollm2_tokenizer, read_text(text_path("britannica-calib")), max_tokens=1024)
    stock, report, compressed = _same_slice(smollm2, 384, calib)
    assert type(stock).__name__ == "MistralForCausalLM" and report.accounting.untied_head_params == 49152 * 384
    ids = eval_ids[:256][None]
    ref = outputs(compressed, ids)
    assert (outputs(stock, ids) - ref).abs().max() < 1e-3
