"""SliceGPT on LayerNorm decoders (OPT, GPT-2) through the RMS-decoder family: centre every writer, fold
each LayerNorm into its readers, rotate into the centred stream's principal directions and keep ``w`` of
them. Exact at full width (float64), a real loss below it that PCA keeps smaller than a random basis, what
SliceGPT cannot do there refused with the reason, and ``compress`` on an OPT folder writes a model that
loads as remote code without hf_symmetry. (The structured classes:
tests/conversion/compress/test_layernorm_structured.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hf_symmetry  # noqa: F401
from hf_symmetry.architectures import UnsupportedSymmetry
from hf_symmetry.architectures.capabilities import allows, reason
from hf_symmetry.conversion.compress import CompressOptions, compress_model
from hf_symmetry.conversion.compress.moments import collect_statistics
from hf_symmetry.conversion.compress.pca import global_rotation, pca, slice_into
from hf_symmetry.conversion.compress.layernorm_decoders import (
    RMSDecoderSlice,
    build,
)
from hf_symmetry.conversion.compress.routes import CompressRun
from hf_symmetry.conversion.stream import DictSink, DictSource
from hf_symmetry.modeling.modeling_rms_decoder import RMSDecoderForCausalLM
from hf_symmetry.symmetry.groups import haar_orthogonal, rng
from hf_symmetry.testing import SEQ40, input_ids, outputs, tiny_model

SLICE = CompressOptions(structure="slice", ratio=0.25, ratio_slack=1.0)


def _delta(a, b) -> float:
    ids = input_ids()
    return (outputs(a, ids) - outputs(b, ids)).abs().max().item()


def _calib():
    return input_ids(batch=1, length=120, seed=3)[0]


@pytest.mark.parametrize("family", ["opt", "gpt2", "gpt_neox", "gptj"])
def test_full_width_slicegpt_of_a_layernorm_decoder_is_exact(family, exact_rmsnorm):
    """At full width any basis is exact: OPT through the whole route (calibration, centred PCA); the others
    (learned positions with Conv1D weights, partial rotary with parallel blocks, interleaved rotary) with a
    random basis, skipping the calibration pass."""
    model = tiny_model(family)
    d = model.config.hidden_size
    if family == "opt":
        full, report = compress_model(model, SLICE, _calib(), width=d, calibration=SEQ40)
        acc = report.accounting
        assert acc.compressed_model_params_counted == acc.compressed_model_params
        # the whole accounting is at the width given (d), not the ratio's
        assert acc.ratio_over_model == pytest.approx(1 - acc.compressed_model_params / acc.dense_model_params)
        assert {m["structure"]["width"] for m in acc.per_matrix.values()} == {d}
    else:
        sink = DictSink()
        cfg, _ = slice_into(
            CompressRun(
                DictSource(dict(model.state_dict())),
                model.config.to_dict(),
                SLICE,
                calib_ids=None,
                sink=sink,
                progress=False,
                calibration=SEQ40,
            ),
            RMSDecoderSlice(),
            width=d,
            rotation=haar_orthogonal(d, rng(0, 2)),
        )
        full = build(dict(sink), cfg, torch.float64)[0]
    assert isinstance(full, RMSDecoderForCausalLM) and full.config.residual_size == d
    assert _delta(model, full) <= 1e-9


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_slicing_a_layernorm_decoder_keeps_the_ratio_and_pca_beats_a_random_basis(family):
    model = tiny_model(family)
    sliced, report = compress_model(
        model, SLICE, _calib(), calibration=SEQ40
    )  # the entry point dispatches on the family
    acc = report.accounting
    w = acc.residual
    assert isinstance(sliced, RMSDecoderForCausalLM) and sliced.config.residual_size == w < model.config.hidden_size
    assert abs(acc.ratio_over_compressed - 0.25) < 0.02
    assert acc.compressed_model_params_counted == acc.compressed_model_params
    err_pca = _delta(model, sliced)
    assert err_pca > 1e-3  # slicing is not free
    # negative control: the same width in a random basis loses more
    Q = haar_orthogonal(model.config.hidden_size, rng(0, 1))
    sink = DictSink()
    cfg, _ = slice_into(
        CompressRun(
            DictSource(dict(model.state_dict())),
            model.config.to_dict(),
            SLICE,
            calib_ids=None,
            sink=sink,
            progress=False,
            calibration=SEQ40,
        ),
        RMSDecoderSlice(),
        rotation=Q,
    )
    rand = build(dict(sink), cfg, torch.float64)[0]
    assert _delta(model, rand) > err_pca


def test_the_pca_is_taken_of_the_centred_stream():
    """The centred model's stream is ``P x``: the rotation is PCA of ``P C P``, which keeps at least as much
    of that stream's energy at every width as PCA of the raw ``C``, and puts the mean direction last."""
    model = tiny_model("opt")
    stats = collect_statistics(
        CompressRun(
            DictSource(dict(model.state_dict())),
            model.config.to_dict(),
            calib_ids=_calib(),
            calibration=SEQ40,
            progress=False,
        ),
        want_normed=False,
        want_stream=True,
    )
    d = model.config.hidden_size
    P = torch.eye(d, dtype=torch.float64) - 1.0 / d
    centred = sum(P @ C @ P / (P @ C @ P).trace() for C in stats.stream)
    Qc, Qr = global_rotation(stats, centred=True), pca(sum(C / C.trace() for C in stats.stream))
    ones = torch.ones(d, dtype=torch.float64) / d**0.5
    assert abs(float(Qc[:, -1] @ ones)) > 1 - 1e-9
    kept = lambda Q, w: float((Q[:, :w].T @ centred @ Q[:, :w]).trace())  # noqa: E731
    assert all(kept(Qc, w) >= kept(Qr, w) - 1e-12 for w in range(1, d))
    assert any(kept(Qc, w) > kept(Qr, w) + 1e-6 for w in range(1, d))


def test_per_segment_and_sequential_slicegpt_are_refused_with_the_reason():
    model = tiny_model("opt", dtype=torch.float32)
    assert allows(model.config, "slicegpt") and allows(model.config, "compress")
    with pytest.raises(ValueError, match="sequential SliceGPT on a LayerNorm decoder"):
        compress_model(model, CompressOptions(structure="slice", q_mode="segment", sequential=True), _calib())
    with pytest.raises(ValueError, match="--q-mode global"):
        compress_model(model, CompressOptions(structure="slice", q_mode="segment"), _calib())
    post_ln = tiny_model("opt", dtype=torch.float32, do_layer_norm_before=False)  # OPT-350m's layout
    assert "post-LN" in reason(post_ln.config, "slicegpt")
    with pytest.raises(UnsupportedSymmetry, match="SliceGPT: opt is post-LN"):
        compress_model(post_ln, SLICE, _calib(), calibration=SEQ40)


@pytest.mark.slow
def test_compress_cli_slices_an_opt_folder_and_refuses_per_segment_slicing(tmp_path, capsys):
    """``compress --structure slice`` on an OPT folder (with SmolLM2's tokenizer, so the embedded calibration
    text tokenises): the RMS-decoder family with a narrower stream, its card and report, loading with
    trust_remote_code where hf_symmetry is not importable; ``--q-mode segment`` is refused before any work."""
    from transformers import AutoModelForCausalLM

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.cli import main

    import transformers as T

    from hf_symmetry.testing import tiny_config

    src = tmp_path / "opt"
    config = tiny_config("opt")
    config.vocab_size = 49152  # SmolLM2's tokenizer
    torch.manual_seed(0)
    T.OPTForCausalLM(config).save_pretrained(src)
    for f in smollm2_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, src / f.name)
    out = tmp_path / "out"
    base = [
        "compress",
        str(src),
        "--calib",
        "britannica-calib",
        "--calib-tokens",
        "256",
        "--calib-seq-len",
        "64",
        "--no-verify",
        "--quiet",
    ]
    assert main([*base[:2], str(tmp_path / "seg"), *base[2:], "--structure", "slice", "--q-mode", "segment"]) == 2
    assert "no skip matrices: use --q-mode global" in capsys.readouterr().err
    assert not (tmp_path / "seg").exists()
    assert main([*base[:2], str(out), *base[2:], "--structure", "slice"]) == 0
    printed = capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "hf_symmetry_rms_decoder" and cfg["residual_size"] < cfg["hidden_size"]
    report = json.loads((out / "compression_report.json").read_text())
    assert report["accounting"]["residual"] == cfg["residual_size"] and "RMS-decoder" in report["method"]
    assert f"{report['accounting']['compressed_model_params']:,}" in printed
    assert (out / "README.md").exists() and (out / "modeling_rms_decoder.py").exists()
    native = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()  # registered by hf_symmetry
    assert native.config.residual_size == cfg["residual_size"]
    with torch.no_grad():
        assert native.generate(input_ids(batch=1, length=8), max_new_tokens=4, do_sample=False).shape[1] == 12
    # loading as remote code without hf_symmetry: tests/architectures/test_families_qwen3.py (one subprocess for
    # all new folders)
