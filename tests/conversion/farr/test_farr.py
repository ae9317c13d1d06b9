"""FaRR (fuse and rank reduce) on tiny float64 models of every family it supports: fused-map math,
exact bias rewrites, rank selection, per-layer-dim models, layout checks with hooks, saving with
remote code, CLI refusals."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from hf_symmetry import cli
from hf_symmetry.architectures import Adapter
from hf_symmetry.conversion.farr import (
    FarrOptions,
    analyze,
    farr_checkpoint,
    farr_model,
    farr_state_dict,
    plan_ranks,
    prepare_layer,
)
from hf_symmetry.conversion.stream import DictSource, partition_keys
from hf_symmetry.conversion.farr.fused_check import check_fused_layout
from hf_symmetry.modeling.configuration_farr import qk_parameters, vo_parameters
from hf_symmetry.solvers import fused
from hf_symmetry.symmetry.actions import NotASymmetry
from hf_symmetry.symmetry.layout import HeadLayout
from hf_symmetry.testing import input_ids, outputs, tiny_model, run_without_hf_symmetry

DECODERS = ("llama", "mistral", "smollm3", "qwen2", "qwen3")
ENCODERS = ("bert", "roberta")


def _canonical_layer(model, i: int = 0):
    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    _, per_layer, _ = partition_keys(adapter, list(sd))
    return prepare_layer(adapter.read_layer(i, {k: sd[k] for k in per_layer[i]}), adapter), adapter


# ---------------------------------------------------------------------- math
def test_fused_svd_is_the_svd_of_the_product():
    gen = torch.Generator().manual_seed(0)
    A, B = (
        torch.randn(30, 6, generator=gen, dtype=torch.float64),
        torch.randn(6, 20, generator=gen, dtype=torch.float64),
    )
    svd = fused.fused_svd(fused.FusedPair(A, B, 3))
    assert torch.allclose(svd.S, torch.linalg.svdvals(A @ B)[:6], atol=1e-12)
    assert torch.allclose(svd.U * svd.S @ svd.Vh, A @ B, atol=1e-12)
    A_r, B_r = fused.balanced_split(svd, 6)
    assert torch.allclose(A_r @ B_r, A @ B, atol=1e-12)
    # balanced: both halves carry √Σ, so their column/row norms agree
    assert torch.allclose(A_r.norm(dim=0), B_r.norm(dim=1), atol=1e-12)


def test_energy_effective_and_stable_rank():
    S = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)  # energies 9, 4, 1, 0 of 14
    assert fused.effective_rank(S, 9 / 14) == 1
    assert fused.effective_rank(S, 0.9) == 2
    assert fused.effective_rank(S, 0.99) == 3
    assert fused.effective_rank(S, 1.0) == 3  # τ = 1 is the numerical rank, not the shape
    assert fused.kept_energy(S, 2) == pytest.approx(13 / 14)
    assert fused.stable_rank(S) == pytest.approx(14 / 9)
    assert fused.effective_rank(torch.zeros(4, dtype=torch.float64), 0.9) == 0


@pytest.mark.parametrize("tau", [0.0, -0.5, 1.0001, 2.0, float("nan")])
def test_tau_outside_unit_interval_is_refused(tau):
    with pytest.raises(ValueError, match="τ must be in"):
        fused.effective_rank(torch.ones(3), tau)
    with pytest.raises(ValueError, match="τ must be in"):
        FarrOptions(tau=tau).validate()


def test_alignment_is_one_for_aligned_factors_and_smaller_otherwise():
    gen = torch.Generator().manual_seed(1)
    Q1, _ = torch.linalg.qr(torch.randn(12, 4, generator=gen, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(10, 4, generator=gen, dtype=torch.float64))
    s = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    aligned = fused.FusedPair(Q1 * s, s[:, None] * Q2.T, 1)  # same inner basis, same order
    anti = fused.FusedPair(Q1 * s, s.flip(0)[:, None] * Q2.T, 1)  # largest meets smallest
    assert fused.alignment(aligned) == pytest.approx(1.0)
    assert fused.alignment(anti) == pytest.approx(float((s * s.flip(0)).pow(2).sum() / s.pow(4).sum()))
    assert fused.alignment(anti) < 0.5


@pytest.mark.parametrize("family,path", [("llama", "vo"), ("qwen2", "vo"), ("bert", "vo"), ("bert", "qk")])
@pytest.mark.parametrize("rank", [1, 3, 8])
def test_relative_error_of_each_truncated_map_is_one_minus_kept_energy(family, path, rank):
    layer, adapter = _canonical_layer(tiny_model(family))
    L = adapter.layout
    reduce = fused.reduce_vo if path == "vo" else fused.reduce_qk
    new, red = reduce(layer, L, rank)
    small = HeadLayout(L.n_heads, L.n_kv_heads, rank)
    for g in range(L.n_kv_heads):
        M = fused.group_pairs(layer, L, path)[g].fused()
        M_r = fused.group_pairs(new, small, path)[g].fused()
        rel = float((M - M_r).pow(2).sum() / M.pow(2).sum())
        assert rel == pytest.approx(1 - red.kept_energy[g], abs=1e-12)
        assert red.kept_energy[g] == pytest.approx(
            fused.kept_energy(fused.fused_svd(fused.group_pairs(layer, L, path)[g]).S, rank)
        )
    if rank == L.head_dim:
        assert all(k == pytest.approx(1.0) for k in red.kept_energy)


_KEYS = {
    "llama": ("model.layers.{}.self_attn.", {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}),
    "bert": (
        "encoder.layer.{}.attention.",
        {"q": "self.query", "k": "self.key", "v": "self.value", "o": "output.dense"},
    ),
}


def _reduced_layer(model, family: str, i: int) -> dict:
    """Canonical q/k/v/o tensors of layer ``i`` of a FaRR model, read straight from its state dict
    (no adapter: an independent reading of the written layout)."""
    prefix, names = _KEYS["bert" if family in ENCODERS else "llama"]
    sd = model.state_dict()
    out = {}
    for short, name in names.items():
        for kind in ("weight", "bias"):
            key = prefix.format(i) + f"{name}.{kind}"
            if key in sd:
                out[f"{short}.{kind}"] = sd[key]
    if family in DECODERS:  # data-free FaRR folds γ before truncating, so the FaRR model's norms are 1
        gamma = sd[f"model.layers.{i}.input_layernorm.weight"]
        assert torch.equal(gamma, torch.ones_like(gamma))
    return out


@pytest.mark.parametrize(
    "family,options",
    [
        ("llama", FarrOptions(tau=0.9)),
        ("qwen2", FarrOptions(params_fraction=0.7)),
        ("bert", FarrOptions(tau=0.9, qk=True)),
        ("roberta", FarrOptions(params_fraction=0.6, qk=True)),
        ("smollm3", FarrOptions(tau=0.9, qk=True)),
    ],
)
def test_reported_kept_energy_is_one_minus_the_written_models_relative_error(family, options):
    """End to end: the maps of the model FaRR wrote (read from its state dict) differ from the
    source's fused maps by exactly 1 − the kept energy the report states, group by group."""
    model = tiny_model(family)
    reduced, report = farr_model(model, options)
    adapter = Adapter.from_config(model.config.to_dict(), list(model.state_dict()))
    assert any(r < adapter.layout.head_dim for r in report.ranks["vo"])
    for path, per_layer in report.kept_energy.items():
        assert len(per_layer) == model.config.num_hidden_layers
        for i, kept in enumerate(per_layer):
            L = adapter.layer_layout(i)
            if path == "qk" and L.rotary_dim:  # RoPE layers keep the score path whole
                assert kept is None and report.ranks["qk"][i] == L.head_dim
                continue
            source, _ = _canonical_layer(model, i)
            small = HeadLayout(L.n_heads, L.n_kv_heads, report.ranks[path][i])
            written = _reduced_layer(reduced, family, i)
            assert written[{"vo": "v", "qk": "k"}[path] + ".weight"].shape[0] == small.n_kv_heads * small.head_dim
            assert len(kept) == L.n_kv_heads
            for g in range(L.n_kv_heads):
                M = fused.group_pairs(source, L, path)[g].fused()
                M_r = fused.group_pairs(written, small, path)[g].fused()
                rel = float((M - M_r).pow(2).sum() / M.pow(2).sum())
                assert rel == pytest.approx(1 - kept[g], abs=1e-10)
                if options.tau is not None:
                    assert kept[g] >= options.tau - 1e-12


def test_value_bias_folds_into_output_bias_and_key_bias_needs_no_rope():
    layer, adapter = _canonical_layer(tiny_model("qwen2"))  # q/k/v biases, RoPE
    folded = fused.fold_value_bias(layer, adapter.layout)
    assert "v.bias" not in folded and "o.bias" in folded
    with pytest.raises(NotASymmetry, match="RoPE"):
        fused.drop_key_bias(layer, adapter.layout)


def test_dropping_the_key_bias_is_exact_without_rope_but_not_with_it():
    ids = input_ids()
    bert = tiny_model("bert")
    ref = outputs(bert, ids)
    with torch.no_grad():
        for layer in bert.encoder.layer:
            layer.attention.self.key.bias.zero_()
    assert (outputs(bert, ids) - ref).abs().max() < 1e-12
    qwen = tiny_model("qwen2")  # negative control: under RoPE q·R(Δ)b_K depends on the key position
    ref = outputs(qwen, ids)
    with torch.no_grad():
        for layer in qwen.model.layers:
            layer.self_attn.k_proj.bias.zero_()
    assert (outputs(qwen, ids) - ref).abs().max() > 1e-3


# ---------------------------------------------------------------------- models
@pytest.mark.parametrize(
    "family,qk", [(f, False) for f in DECODERS + ENCODERS] + [(f, True) for f in ENCODERS + ("smollm3",)]
)
def test_full_rank_reproduces_the_original(family, qk, exact_rmsnorm):
    model, ids = tiny_model(family), input_ids()
    reduced, report = farr_model(model, FarrOptions(tau=1.0, qk=qk))
    assert all(r == 8 for ranks in report.ranks.values() for r in ranks)
    assert (outputs(model, ids) - outputs(reduced, ids)).abs().max() < 1e-10
    # negative control: one direction less in one layer is visible
    cut, _ = farr_model(model, FarrOptions(params_fraction=0.97, qk=qk))
    assert (outputs(model, ids) - outputs(cut, ids)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "family,qk", [("llama", False), ("qwen2", False), ("qwen3", False), ("bert", True), ("smollm3", True)]
)
def test_parameter_count_matches_formula_and_numel(family, qk):
    model = tiny_model(family)
    reduced, report = farr_model(model, FarrOptions(tau=0.95, qk=qk))
    cfg = reduced.config
    assert any(r < 8 for r in report.ranks["vo"])
    layers = reduced.model.layers if family in DECODERS else reduced.encoder.layer
    d, h = cfg.hidden_size, cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", h)
    for i, layer in enumerate(layers):
        mods = [layer.self_attn] if family in DECODERS else [layer.attention.self, layer.attention.output.dense]
        numel = sum(p.numel() for m in mods for p in m.parameters())
        assert numel == cfg.attention_parameters(i)
        q_bias = family in ("qwen2", "bert")
        qk_dim = report.ranks["qk"][i] if qk else 8
        expected = qk_parameters(
            d, h, kv, qk_dim, q_bias, q_bias and family not in ENCODERS, family == "qwen3"
        ) + vo_parameters(d, h, kv, report.ranks["vo"][i], o_bias=family in ("qwen2", "bert"))
        assert numel == expected
    total = sum(p.numel() for p in reduced.parameters())
    assert report.params_after == total
    assert report.params_before == sum(p.numel() for p in model.parameters())
    touched = sum(cfg.attention_parameters(i) for i in range(cfg.num_hidden_layers))
    nope = [i for i in range(len(layers)) if family in ENCODERS or not getattr(cfg, "uses_rope")(i)]
    untouched_qk = sum(
        qk_parameters(d, h, kv, 8, family in ("qwen2", "bert"), family in ("qwen2",), family == "qwen3")
        for i in range(len(layers))
        if not (qk and i in nope)
    )
    assert report.touchable_params_after == touched - untouched_qk


def test_budget_spends_the_fraction_and_shrinks_monotonically():
    model = tiny_model("bert")
    _, _, loose = farr_state_dict(model.state_dict(), model.config, FarrOptions(params_fraction=0.8, qk=True))
    _, _, tight = farr_state_dict(model.state_dict(), model.config, FarrOptions(params_fraction=0.5, qk=True))
    for rep, frac in ((loose, 0.8), (tight, 0.5)):
        assert rep.touchable_kept_fraction <= frac
        assert rep.touchable_kept_fraction > frac - 0.06  # within about one rank increment
    for p in ("vo", "qk"):
        assert all(a <= b for a, b in zip(tight.ranks[p], loose.ranks[p]))


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_params_fraction_outside_unit_interval_is_refused(fraction):
    with pytest.raises(ValueError, match="params_fraction must be in"):
        FarrOptions(params_fraction=fraction).validate()


def test_budget_that_removes_everything_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="removes everything"):
        farr_state_dict(model.state_dict(), model.config, FarrOptions(params_fraction=0.05))


@pytest.mark.parametrize("family,reason", [("llama", "RoPE"), ("qwen3", "QK-norm")])
def test_qk_reduction_is_refused_where_the_score_map_cannot_be_fused(family, reason):
    model = tiny_model(family)
    with pytest.raises(ValueError, match=reason):
        farr_state_dict(model.state_dict(), model.config, FarrOptions(tau=0.99, qk=True))


def test_unsupported_family_and_options_are_refused():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(ValueError, match="FaRR V/O: gpt2 uses LayerNorm"):  # the capability's reason
        farr_state_dict(gpt2.state_dict(), gpt2.config, FarrOptions(tau=0.99))
    with pytest.raises(ValueError, match="exactly one"):
        FarrOptions(tau=0.9, params_fraction=0.9).validate()
    with pytest.raises(ValueError, match="nothing to reduce"):
        FarrOptions(tau=0.9, vo=False).validate()


# ---------------------------------------------------------------------- layout check with hooks
class _InterleavedGroups(HeadLayout):
    """Wrong GQA grouping: heads g, g + n_kv, ... instead of the contiguous block HF uses."""

    def heads_of_group(self, group: int) -> range:
        return range(group, self.n_heads, self.n_kv_heads)


class _ShiftedHeads(HeadLayout):
    """Wrong head slicing: every head reads its neighbour's rows."""

    def rows(self, head: int) -> slice:
        h = (head + 1) % self.n_heads
        return slice(h * self.head_dim, (h + 1) * self.head_dim)


@pytest.mark.parametrize("family", ["llama", "qwen2", "smollm3", "bert", "gpt2", "opt"])
def test_fused_maps_reproduce_each_heads_contribution(family):
    model = tiny_model(family)
    # Llama-family eager attention takes its softmax in float32, so α carries ~1e-8 relative error
    check = check_fused_layout(model, input_ids(batch=1)[0], tolerance=1e-6)
    assert check.passed, check.as_dict()
    assert (check.qk_max_abs_error is not None) == (family in ("bert", "gpt2", "opt", "smollm3"))
    if family == "smollm3":  # the score path is checked on the NoPE layer only
        assert ["qk_max_abs_error" in e for e in check.per_layer] == [False, True]


@pytest.mark.parametrize("family,wrong", [("llama", _InterleavedGroups), ("bert", _ShiftedHeads)])
def test_layout_check_catches_a_wrong_head_layout(family, wrong):
    model = tiny_model(family)
    L = Adapter.from_config(model.config.to_dict(), list(model.state_dict())).layout
    bad = wrong(L.n_heads, L.n_kv_heads, L.head_dim, L.rotary_dim, L.rope_layout, L.qk_norm)
    check = check_fused_layout(model, input_ids(batch=1)[0], tolerance=1e-6, layout=bad)
    assert not check.passed
    assert check.vo_max_rel_error > 1e-2


# ---------------------------------------------------------------------- saving, remote code, CLI
_REMOTE_SCRIPT = textwrap.dedent("""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForCausalLM
    result = {}
    for name, auto in (("llama", AutoModelForCausalLM), ("smollm3", AutoModelForCausalLM), ("bert", AutoModel)):
        model = auto.from_pretrained(FOLDER + "/" + name, trust_remote_code=True).eval()
        ref = load_file(FOLDER + "/expected.safetensors")
        with torch.no_grad():
            out = model(input_ids=ref["ids"])
        got = out.last_hidden_state if name == "bert" else out.logits
        result[name] = [type(model).__name__, (got - ref[name]).abs().max().item()]
    print(json.dumps(result))
""")


def test_saved_models_reload_with_and_without_remote_code(tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM

    ids = input_ids(batch=1)
    expected = {"ids": ids}
    for family, auto, qk in (
        ("llama", AutoModelForCausalLM, False),
        ("smollm3", AutoModelForCausalLM, True),
        ("bert", AutoModel, True),
    ):
        src = tmp_path / f"src-{family}"
        tiny_model(family).save_pretrained(src)
        out = tmp_path / "farr" / family
        report = farr_checkpoint(src, out, FarrOptions(tau=0.9, qk=qk), progress=False)
        files = {p.name for p in out.iterdir()}
        assert {"config.json", "configuration_farr.py", "modeling_farr.py", "farr_report.json"} <= files
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"].startswith("hf_symmetry_farr_") and "AutoConfig" in config["auto_map"]
        assert config["v_head_dims"] == report.ranks["vo"]
        native = auto.from_pretrained(out).eval()  # registered by importing hf_symmetry
        remote = auto.from_pretrained(out, trust_remote_code=True).eval()
        assert (outputs(native, ids) - outputs(remote, ids)).abs().max() == 0
        # the reduced weights really are smaller, and no value bias came back through the stream
        assert native.state_dict()[_v_weight(family)].shape[0] < 8 * (2 if family in DECODERS else 6) or qk
        expected[family] = outputs(native, ids).contiguous()
    save_file(expected, str(tmp_path / "farr" / "expected.safetensors"))

    result = run_without_hf_symmetry(_REMOTE_SCRIPT, tmp_path, FOLDER=str(tmp_path / "farr"))
    assert result["llama"][0] == result["smollm3"][0] == "FarrLlamaForCausalLM"
    assert result["bert"][0] == "FarrBertModel"
    assert max(r[1] for r in result.values()) < 1e-12


@pytest.mark.parametrize(
    "family,options,auto",
    [
        ("llama", FarrOptions(tau=0.9), "AutoModelForCausalLM"),
        ("bert", FarrOptions(params_fraction=0.8, qk=True), "AutoModel"),
    ],
)
def test_model_card_carries_the_rank_heatmap(tmp_path, family, options, auto):
    from huggingface_hub import ModelCard

    src = tmp_path / "src"
    tiny_model(family).save_pretrained(src)
    out = tmp_path / "farr"
    report = farr_checkpoint(src, out, options, progress=False)
    png = out / "effective_rank.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    card = ModelCard.load(out / "README.md")  # the YAML header parses
    assert card.data.library_name == "transformers" and "hf_symmetry-farr" in card.data.tags
    assert "![" in card.text and "](effective_rank.png)" in card.text
    record = json.loads((out / "hf_symmetry_card.json").read_text())
    [plot] = record["data"]["plots"]
    assert plot["path"] == "effective_rank.png" and "Effective rank" in plot["caption"]
    assert ("τ = 0.9" in plot["caption"]) == (options.tau is not None)
    # the farr template: per-layer head dims, the right Auto class for the family, remote code
    assert ", ".join(map(str, report.ranks["vo"])) in card.text
    assert f"{auto}.from_pretrained(" in card.text and "trust_remote_code=True" in card.text
    if family in ENCODERS:
        assert "AutoModelForCausalLM" not in card.text and "query/key head dims" in card.text


def _v_weight(family: str) -> str:
    return (
        "model.layers.0.self_attn.v_proj.weight"
        if family in DECODERS
        else "encoder.layer.0.attention.self.value.weight"
    )


def test_cli_refuses_bad_input_before_writing_anything(tmp_path, capsys):
    src = tmp_path / "src"
    tiny_model("llama").save_pretrained(src)
    out = tmp_path / "out"
    for bad in (
        ["--tau", "0"],
        ["--tau", "1.5"],
        ["--params-fraction", "0"],
        ["--params-fraction", "0.01"],
        ["--tau", "0.9", "--qk"],
    ):
        assert cli.main(["farr", str(src), str(out), *bad, "--no-verify", "--quiet"]) == 2, bad
        assert not out.exists()
    err = capsys.readouterr().err
    assert "τ must be in (0, 1]" in err and "removes everything" in err and "RoPE" in err
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli.main(["farr", str(src), str(out), "--tau", "0.9", "--no-verify", "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["spectra", str(src), str(tmp_path / "spec"), "--tau", "1.2", "--quiet"]) == 2
    assert not (tmp_path / "spec").exists()


@pytest.mark.parametrize("family", ["bert", "smollm3"])
def test_cli_farr_and_spectra_end_to_end(tmp_path, capsys, family):
    src = tmp_path / "src"
    tiny_model(family).save_pretrained(src)
    out = tmp_path / "farr"
    assert cli.main(["farr", str(src), str(out), "--tau", "0.9", "--vo", "--qk", "--no-verify", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "vo head dims" in text and "qk head dims" in text
    spec = tmp_path / "spectra"
    assert cli.main(["spectra", str(src), str(spec), "--tau", "0.9", "0.99", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "layout check" in text and "passed" in text
    assert {p.name for p in spec.iterdir()} == {
        "report.json",
        "effective_rank.png",
        "vo_spectra.png",
        "qk_spectra.png",
        ".hf-symmetry-files",  # (what hf-symmetry wrote, which --overwrite may replace)
    }
    report = json.loads((spec / "report.json").read_text())
    assert report["qk"]["available"] and report["layout_check"]["passed"]
    group = report["layers"][0]["vo"][0]
    assert set(group["effective_rank"]) == {"0.9", "0.99"} and 0 < group["alignment"] <= 1 + 1e-9
    # the summary agrees with what farr did at the same τ
    farr_report = json.loads((out / "farr_report.json").read_text())
    assert report["summary"]["vo"]["0.9"]["layer_ranks"] == farr_report["ranks"]["vo"]
    if family == "smollm3":  # the RoPE layer 0 keeps its query/key heads; spectra says why it has none
        assert report["qk"]["layers"] == [1] and "NoPE layers [1] only" in text
        assert report["summary"]["qk"]["0.9"]["layer_ranks"][1] == farr_report["ranks"]["qk"][1]
        assert farr_report["ranks"]["qk"][0] == 8 and farr_report["kept_energy"]["qk"][0] is None
    # the report travels with the folder when it is pushed: no local paths in it
    assert str(tmp_path) not in (out / "farr_report.json").read_text()
    assert farr_report["source"] == "src" and farr_report["output"] == "farr"


def test_spectra_of_a_rope_model_reports_why_qk_is_not_fused(tmp_path, capsys):
    src = tmp_path / "src"
    tiny_model("llama").save_pretrained(src)
    assert cli.main(["spectra", str(src), str(tmp_path / "spec"), "--quiet"]) == 0
    assert "score path not fused" in capsys.readouterr().out
    report = json.loads((tmp_path / "spec" / "report.json").read_text())
    assert report["paths"] == ["vo"] and "RoPE" in report["qk"]["reason"]
    assert len(report["layers"][0]["vo"]) == 2 and len(report["layers"][0]["vo"][0]["head_effective_rank"]) == 3


def test_analysis_folds_pre_norm_gamma_but_not_post_ln(exact_rmsnorm):
    llama = tiny_model("llama")
    sd = llama.state_dict()
    adapter = Adapter.from_config(llama.config.to_dict(), list(sd))
    folded = analyze(DictSource(sd), adapter, ("vo",), progress=False)[0].spectra["vo"][0].S
    W_V = (
        sd["model.layers.0.self_attn.v_proj.weight"].double()[:8] * sd["model.layers.0.input_layernorm.weight"].double()
    )
    W_O = torch.cat([sd["model.layers.0.self_attn.o_proj.weight"].double()[:, h * 8 : (h + 1) * 8] for h in range(3)])
    assert torch.allclose(folded, torch.linalg.svdvals(W_O @ W_V)[:8], atol=1e-10)
    bert = tiny_model("bert")
    layer, _ = _canonical_layer(bert)
    assert torch.equal(layer["v.weight"], bert.state_dict()["encoder.layer.0.attention.self.value.weight"])


def test_plan_respects_tau_per_group_and_takes_the_layer_maximum():
    model = tiny_model("llama")
    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    analysis = analyze(DictSource(sd), adapter, ("vo",), progress=False)
    from hf_symmetry.conversion.farr import farr_target

    options = FarrOptions(tau=0.9)
    plan = plan_ranks(analysis, options, farr_target(adapter, model.config.to_dict(), list(sd), options))
    for a, r in zip(analysis, plan.ranks["vo"]):
        group_ranks = [fused.effective_rank(g.S, 0.9) for g in a.spectra["vo"]]
        assert r == max(group_ranks)
        assert all(fused.kept_energy(g.S, r) >= 0.9 - 1e-12 for g in a.spectra["vo"])


# ---------------------------------------------------------------------- activation-aware (calibrated) FaRR
def _moments(X: torch.Tensor):
    return X.T @ X / X.shape[0], X.mean(0)


@pytest.mark.parametrize("family,path", [("llama", "vo"), ("bert", "vo"), ("bert", "qk")])
def test_weighted_truncation_error_is_one_minus_kept_and_beats_data_free_on_the_data(family, path):
    layer, adapter = _canonical_layer(tiny_model(family))
    L = adapter.layout
    gen = torch.Generator().manual_seed(5)
    # anisotropic inputs, as real attention inputs are (a few channels dominate)
    X = torch.randn(400, 48, generator=gen, dtype=torch.float64) * torch.logspace(0, 1.5, 48, dtype=torch.float64)
    w = fused.InputWeights.from_moments(*_moments(X))
    X1 = torch.cat([X, torch.ones(400, 1, dtype=X.dtype)], 1)
    reduce = fused.reduce_vo if path == "vo" else fused.reduce_qk
    cal, red = reduce(layer, L, 3, weights=w)
    free, _ = reduce(layer, L, 3)
    small = HeadLayout(L.n_heads, L.n_kv_heads, 3)
    for g in range(L.n_kv_heads):
        pw = fused.weigh(fused.group_pairs(layer, L, path)[g], path, w)
        pw_r = fused.weigh(fused.group_pairs(cal, small, path)[g], path, w)
        rel = float((pw.fused() - pw_r.fused()).pow(2).sum() / pw.fused().pow(2).sum())
        assert rel == pytest.approx(1 - red.kept_energy[g], abs=1e-9)

        def data_error(new):  # error of the map on the actual inputs (both sides for scores)
            M = fused.group_pairs(layer, L, path)[g]
            N = fused.group_pairs(new, small, path)[g]
            m = M.A.shape[0] // M.blocks
            err = 0.0
            for j in range(M.blocks):
                D = M.block(j) @ M.B - N.block(j) @ N.B
                err += float(((X @ D.T) if path == "vo" else (X1[:, :m] @ D @ X.T)).pow(2).sum())
            return err

        assert data_error(cal) <= data_error(free) * (1 + 1e-9)


@pytest.mark.parametrize("family,qk", [("llama", False), ("qwen2", False), ("bert", True), ("smollm3", True)])
def test_calibrated_full_rank_reproduces_the_original(family, qk, exact_rmsnorm):
    model, ids = tiny_model(family), input_ids()
    reduced, report = farr_model(model, FarrOptions(tau=1.0, qk=qk), calib_ids=input_ids(batch=1, length=60, seed=3)[0])
    assert report.calibration == {"tokens": 60}
    assert all(r == 8 for ranks in report.ranks.values() for r in ranks)
    assert (outputs(model, ids) - outputs(reduced, ids)).abs().max() < 1e-8
    if family in DECODERS:  # γ is folded after the calibrated truncation: stock norm weights of 1
        assert torch.equal(
            reduced.model.layers[0].input_layernorm.weight,
            torch.ones_like(reduced.model.layers[0].input_layernorm.weight),
        )


def test_reduced_decoder_generates_with_cache_and_attention_backends_agree():
    model = tiny_model("llama")
    reduced, report = farr_model(model, FarrOptions(tau=0.8))
    assert min(report.ranks["vo"]) < 8  # value heads narrower than query/key heads
    ids = input_ids(batch=1, length=10)
    sdpa = outputs(reduced, ids)
    reduced.set_attn_implementation("eager")
    assert (outputs(reduced, ids) - sdpa).abs().max() < 1e-5  # eager softmax runs in float32
    reduced.set_attn_implementation("sdpa")
    with torch.no_grad():
        gen = reduced.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        # cached decoding equals recomputing the whole prefix each step
        full = reduced(gen[:, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1)
    assert torch.equal(full, gen[0, ids.shape[1] :])
    same, _ = farr_model(model, FarrOptions(tau=1.0))
    with torch.no_grad():
        assert torch.equal(
            same.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
            model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
        )


# ---------------------------------------------------------------------- NoPE layers (SmolLM3)
def test_qk_reduction_touches_only_nope_layers_and_the_model_stays_consistent(exact_rmsnorm):
    """SmolLM3-style model (layer 1 NoPE): --qk reduces the score path of layer 1 only; the RoPE
    layer keeps its full query/key heads; the reduced model decodes with its cache like the full
    forward, and the config refuses a reduced query/key head dim on a RoPE layer."""
    from hf_symmetry.modeling.configuration_farr import FarrLlamaConfig

    model = tiny_model("smollm3")
    reduced, report = farr_model(model, FarrOptions(tau=0.8, qk=True))
    cfg = reduced.config
    assert cfg.no_rope_layers == [1, 0] and cfg.qk_head_dims[0] == 8 and cfg.qk_head_dims[1] < 8
    assert report.ranks["qk"] == cfg.qk_head_dims
    assert any("NoPE layers [1]" in n for n in report.notes)
    attn = reduced.model.layers[1].self_attn
    assert not attn.use_rope and attn.q_proj.out_features == 6 * cfg.qk_head_dims[1]
    assert reduced.model.layers[0].self_attn.use_rope
    ids = input_ids(batch=1, length=10)
    with torch.no_grad():
        gen = reduced.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        full = reduced(gen[:, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1)
    assert torch.equal(full, gen[0, ids.shape[1] :])
    # negative control: the full-rank FaRR model is the original; RoPE on its NoPE layer is not
    same, _ = farr_model(model, FarrOptions(tau=1.0, qk=True))
    assert (outputs(same, ids) - outputs(model, ids)).abs().max() < 1e-10
    same.model.layers[1].self_attn.use_rope = True
    assert (outputs(same, ids) - outputs(model, ids)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="only NoPE"):
        FarrLlamaConfig(**{**cfg.to_dict(), "qk_head_dims": [4, 8]})


def test_spectra_of_a_nope_model_analyses_the_score_path_of_nope_layers_only():
    from hf_symmetry.conversion.farr import spectra_report

    model = tiny_model("smollm3")
    report = spectra_report(DictSource(model.state_dict()), model.config.to_dict(), [0.9, 0.99], progress=False)
    assert report["paths"] == ["vo", "qk"] and report["qk"]["available"] and report["qk"]["layers"] == [1]
    assert "qk" not in report["layers"][0] and len(report["layers"][1]["qk"]) == 2
    assert report["summary"]["qk"]["0.9"]["layer_ranks"][0] is None


def _whole_layer_farr(model, options: FarrOptions, ranks: dict, moments=None) -> dict:
    """Reference: FaRR's reduction pass as it was before it read the FFN one module at a time:
    every layer whole as float64 canonical tensors through ``reduce_layer``, cast back like the source."""
    from hf_symmetry.conversion.farr import farr_target, reduce_layer

    sd = model.state_dict()
    config = model.config.to_dict()
    adapter = Adapter.from_config(config, list(sd))
    target = farr_target(adapter, config, list(sd), options)
    global_keys, per_layer, rest = partition_keys(adapter, list(sd))
    out = {k: sd[k] for k in global_keys + rest}  # e.g. BERT's pooler passes through
    for i in range(adapter.n_layers):
        raw = {k: sd[k] for k in per_layer[i]}
        w = fused.InputWeights.from_moments(*moments[i], augmented=options.qk) if moments else None
        new, _ = reduce_layer(
            adapter.read_layer(i, raw),
            adapter,
            target,
            options,
            {p: ranks[p][i] for p in options.paths},
            w,
            adapter.layer_layout(i),
        )
        out.update(adapter.write_layer(i, new, raw))
    return out


@pytest.mark.parametrize(
    "family,dtype,calibrated",
    [
        ("llama", torch.float32, True),
        ("qwen2", torch.bfloat16, False),
        ("qwen2", torch.float32, True),
        ("bert", torch.float32, False),
    ],
)
def test_reduction_pass_reads_the_ffn_one_module_at_a_time_and_writes_the_same_tensors(
    tmp_path, family, dtype, calibrated
):
    """The reduction pass reads the attention and norms in float64 and the FFN one module at a time in
    its own dtype (gate/up get the pre-norm's γ folded a block of rows at a time): exactly the tensors of
    the whole-layer float64 pass, from a checkpoint or in memory. Negative controls: the γ fold is there
    (gate/up differ from the source, down does not) and the other metric gives other tensors."""
    from hf_symmetry.conversion.farr import attention_input_moments
    from safetensors.torch import load_file

    model = tiny_model(family).to(dtype).eval()
    options = FarrOptions(params_fraction=0.6)
    moments = None
    if calibrated:
        sd = model.state_dict()
        got, _, report = farr_state_dict(
            sd,
            model.config,
            options,
            moments=(moments := attention_input_moments(model, input_ids(batch=1, length=60, seed=3)[0])),
        )
    else:
        model.save_pretrained(tmp_path / "src")
        report = farr_checkpoint(tmp_path / "src", tmp_path / "out", options, progress=False, max_shard_size=20_000)
        from hf_symmetry.conversion.layer_map import MAP_FILE  # heal's layer map, not weights

        got = {
            k: v
            for f in sorted((tmp_path / "out").glob("*.safetensors"))
            if f.name != MAP_FILE
            for k, v in load_file(f).items()
        }
    want = _whole_layer_farr(model, options, report.ranks, moments)
    assert set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    if family != "bert":  # pre-norm: γ folded into gate/up, down passed through
        sd = model.state_dict()
        assert not torch.equal(got["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.gate_proj.weight"])
        assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], sd["model.layers.0.mlp.down_proj.weight"])
    # the other metric (data-free <-> calibrated) at the same ranks: other tensors
    other = _whole_layer_farr(
        model,
        options,
        report.ranks,
        None if calibrated else attention_input_moments(model, input_ids(batch=1, length=60)[0]),
    )
    assert not all(torch.equal(got[k], other[k]) for k in want)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_spectra_layout_check_never_loads_the_whole_model(tmp_path, capsys, monkeypatch, family):
    """`spectra`'s layout check runs one decoder layer at a time through the calibration engine: with
    transformers' whole-model loading made to fail it still checks every layer, and finds what the
    hooks on the whole model find; a wrong head layout fails it (negative control)."""
    import transformers

    from hf_symmetry.conversion.farr.fused_check import check_fused_layout_layerwise

    model = tiny_model(family, dtype=torch.float32)
    model.save_pretrained(tmp_path / "src")
    ids = input_ids(batch=1)[0]
    whole = check_fused_layout(model, ids)

    def no_model(*args, **kwargs):
        raise AssertionError("the layout check loaded the whole model")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_model))
    assert cli.main(["spectra", str(tmp_path / "src"), str(tmp_path / "spec"), "--quiet"]) == 0
    check = json.loads((tmp_path / "spec" / "report.json").read_text())["layout_check"]
    assert check["passed"] and [e["layer"] for e in check["per_layer"]] == [0, 1]
    layerwise = check_fused_layout_layerwise(tmp_path / "src", ids)
    assert layerwise.passed and whole.passed
    for mine, ref in zip(layerwise.per_layer, whole.per_layer):
        assert mine.keys() == ref.keys() and all(abs(mine[k] - ref[k]) < 1e-4 for k in mine if k != "layer")
    L = Adapter.from_config(model.config.to_dict(), list(model.state_dict())).layout
    wrong = {"llama": _InterleavedGroups, "bert": _ShiftedHeads}[family]
    bad = wrong(L.n_heads, L.n_kv_heads, L.head_dim, L.rotary_dim, L.rope_layout, L.qk_norm)
    assert check_fused_layout_layerwise(tmp_path / "src", ids, layout=bad).vo_max_rel_error > 1e-2
