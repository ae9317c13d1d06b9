"""Rotation-symmetry matching (Zhang et al. 2025): closed-form solvers, planted recovery on every family,
optimality, identities on self-matches, exact Gram transport, and refusals (tiny float64 models)."""

import json

import pytest
import torch

from hf_symmetry.architectures import Adapter, UnsupportedSymmetry
from hf_symmetry.cli import main
from hf_symmetry.conversion.merge.statistics import gram_matrices
from hf_symmetry.conversion.match import MatchOptions, fold_state_dict, match_state_dict, squared_distances
from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
from hf_symmetry.evaluation.compare import model_from_state_dict
from hf_symmetry.symmetry import HeadLayout, actions, groups
from hf_symmetry.symmetry.procrustes import (
    commutant_procrustes,
    match_permutation,
    orthogonal_procrustes,
    quartic_scale,
)
from hf_symmetry.testing import input_ids, outputs, tiny_model

ALL = MatchOptions(scaling=True)
ALL_RESIDUAL = MatchOptions(scaling=True, residual=True)


def _sd(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _model(config: dict, sd: dict):
    return model_from_state_dict(config, sd, dtype=torch.float64)


def _average(a: dict, b: dict) -> dict:
    return {k: (a[k] + b[k]) / 2 for k in a}


def _relative(a: dict, b: dict) -> float:
    keys = a.keys() & b.keys()
    return (sum((a[k] - b[k]).pow(2).sum() for k in keys) / sum(a[k].pow(2).sum() for k in keys)).sqrt().item()


# --------------------------------------------------------------------------- solvers


def _skew(n: int, gen) -> torch.Tensor:
    A = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return A - A.T


def test_orthogonal_procrustes_is_the_global_optimum():
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(7, 7, generator=gen, dtype=torch.float64)
    R = orthogonal_procrustes(M)
    assert torch.allclose(R.T @ R, torch.eye(7, dtype=torch.float64), atol=1e-12)
    best = torch.trace(R.T @ M)
    assert abs(best - torch.linalg.svdvals(M).sum()) < 1e-10  # tr(RᵀM) reaches Σσ
    for _ in range(20):  # random orthogonals, including reflections, never do better
        Q = groups.haar_orthogonal(7, groups.rng(0, _))
        assert torch.trace(Q.T @ M) <= best + 1e-12


@pytest.mark.parametrize(
    "layout",
    [
        HeadLayout(4, 2, 8, rotary_dim=8, rope_layout="rotate_half"),
        HeadLayout(4, 2, 8, rotary_dim=8, rope_layout="interleaved"),
        HeadLayout(4, 4, 12, rotary_dim=8, rope_layout="rotate_half"),  # partial rotary: 4 free dims
        HeadLayout(4, 4, 6),  # no RoPE: all of O(6)
    ],
    ids=["rotate_half", "interleaved", "partial", "nope"],
)
def test_commutant_procrustes_recovers_a_planted_element_and_stays_in_the_group(layout):
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(layout.head_dim, 40, generator=gen, dtype=torch.float64)
    R0 = groups.random_rope_commutant(layout, groups.rng(3))
    R = commutant_procrustes((R0.T @ W) @ W.T, layout)  # source = R0ᵀ W, anchor = W
    assert groups.rope_commutant_violation(R, layout) < 1e-12
    assert (R.T @ R0.T @ W - W).abs().max() < 1e-12  # recovers R = R0ᵀ exactly
    # a generic M: the solution beats nearby group elements (expm of the group's Lie algebra)
    M = torch.randn(layout.head_dim, layout.head_dim, generator=gen, dtype=torch.float64)
    R = commutant_procrustes(M, layout)
    for _ in range(10):
        E = torch.linalg.matrix_exp(1e-3 * _algebra_element(layout, gen))
        assert groups.rope_commutant_violation(R @ E, layout) < 1e-10
        assert torch.trace((R @ E).T @ M) <= torch.trace(R.T @ M) + 1e-12


def _algebra_element(layout: HeadLayout, gen) -> torch.Tensor:
    """A random element of the Lie algebra of the RoPE commutant: one 2x2 generator per pair,
    any skew matrix on the non-rotary dims."""
    S = torch.zeros(layout.head_dim, layout.head_dim, dtype=torch.float64)
    for i, j in layout.rope_pairs():
        t = torch.randn(1, generator=gen, dtype=torch.float64).item()
        S[i, j], S[j, i] = -t, t
    nope = layout.nope_dims()
    if len(nope):
        S[nope.unsqueeze(1), nope.unsqueeze(0)] = _skew(len(nope), gen)
    return S


def test_quartic_scale_recovers_planted_scale_and_is_the_minimum():
    gen = torch.Generator().manual_seed(2)
    X, Y = torch.randn(30, generator=gen, dtype=torch.float64), torch.randn(20, generator=gen, dtype=torch.float64)
    for a0 in (0.3, 1.0, 2.7, -1.5):
        Xs, Ys = X / a0, Y * a0  # source = anchor moved by 1/a0: the best a is a0
        a = quartic_scale(Xs @ Xs, Xs @ X, Ys @ Ys, Ys @ Y)
        assert abs(a - a0) < 1e-12
    Xs, Ys = X + 0.5 * torch.randn(30, generator=gen, dtype=torch.float64), 2 * Y
    a = quartic_scale(Xs @ Xs, Xs @ X, Ys @ Ys, Ys @ Y)

    def f(t):
        return ((t * Xs - X).pow(2).sum() + (Ys / t - Y).pow(2).sum()).item()

    grid = torch.linspace(-4, 4, 8001, dtype=torch.float64)
    assert f(a) <= min(f(t.item()) for t in grid if abs(t) > 1e-3) + 1e-12


def test_match_permutation_recovers_planted_permutation():
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(50, 30, generator=gen, dtype=torch.float64)
    perm0 = torch.randperm(50, generator=gen)
    S = A[torch.argsort(perm0)]  # source neuron perm0[j] is anchor neuron j
    perm = match_permutation(A @ S.T)
    assert torch.equal(S[perm], A) and torch.equal(perm, perm0)


# --------------------------------------------------------------------------- planted recovery


PLANTED = [
    ("llama", RotateOptions(residual="random", heads="random", ffn=True, scaling=True, seed=7), ALL_RESIDUAL),
    ("qwen2", RotateOptions(residual="random", heads="random", ffn=True, scaling=True, seed=7), ALL_RESIDUAL),
    ("llama", RotateOptions(residual="none", heads="random", ffn=True, scaling=True, seed=8), ALL),
    ("gpt2", RotateOptions(residual="none", heads="random", ffn=True, scaling=True, seed=7), ALL),
    ("bert", RotateOptions(residual="none", heads="random", ffn=True, scaling=True, seed=7), ALL),
]


@pytest.mark.parametrize(
    "family,planted,options", PLANTED, ids=["llama-residual", "qwen2-residual", "llama-heads", "gpt2", "bert"]
)
def test_planted_transform_is_recovered_and_the_average_is_the_anchor(family, planted, options, exact_rmsnorm):
    model = tiny_model(family)
    anchor = _sd(model)
    source, source_cfg = rotate_state_dict(anchor, model.config, planted)
    result = match_state_dict(anchor, source, source_cfg, options, anchor_config=model.config)
    # the anchor in the frame the match compares in (norms folded when the residual is matched)
    frame = fold_state_dict(anchor, model.config) if options.residual else None
    reference, ref_cfg = (frame.state_dict, frame.config) if frame else (anchor, model.config.to_dict())
    assert _relative(reference, result.state_dict) <= 1e-8
    assert result.distances.summary()["total"]["relative_after"] <= 1e-8

    ids = input_ids(model.config.vocab_size)
    target = outputs(model, ids)
    matched_avg = _model(result.config, _average(reference, result.state_dict))
    assert (outputs(matched_avg, ids) - target).abs().max() < 1e-9
    plain_avg = _model(source_cfg, _average(anchor, source))
    assert (outputs(plain_avg, ids) - target).abs().max() > 0.1  # without matching: measurably worse
    # and the matched source still computes the source's function
    assert (outputs(_model(result.config, result.state_dict), ids) - target).abs().max() < 1e-9


def test_matched_source_keeps_its_function_for_an_independent_model(exact_rmsnorm):
    anchor, source = tiny_model("llama", seed=0), tiny_model("llama", seed=11)
    ids = input_ids()
    for options in (ALL, MatchOptions(scaling=True, residual=True, residual_iters=2)):
        r = match_state_dict(_sd(anchor), _sd(source), source.config, options)
        assert (outputs(_model(r.config, r.state_dict), ids) - outputs(source, ids)).abs().max() < 1e-10


# --------------------------------------------------------------------------- optimality


OPTIONS = {
    "heads": MatchOptions(ffn=False),
    "heads+ffn": MatchOptions(),
    "scaling": ALL,
    "residual": ALL_RESIDUAL,
    "residual-refined": MatchOptions(scaling=True, residual=True, residual_iters=2),
    "qk-only": MatchOptions(heads="qk", ffn=False),
    "vo-only": MatchOptions(heads="vo", ffn=False),
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
def test_matching_never_increases_distance(family):
    anchor, source = tiny_model(family, seed=0), tiny_model(family, seed=21)
    for name, options in OPTIONS.items():
        if options.residual and family in ("gpt2", "bert"):
            continue
        summary = match_state_dict(_sd(anchor), _sd(source), source.config, options).distances.summary()
        for comp, d in summary.items():
            assert d["after"] <= d["before"] * (1 + 1e-12) + 1e-12, (name, comp, d)
        assert summary["total"]["after"] < summary["total"]["before"], name


def _layers(sd: dict, config) -> tuple[Adapter, list[dict], dict]:
    ad = Adapter.from_config(config, list(sd))
    return ad, [ad.read_layer(i, sd) for i in range(ad.n_layers)], ad.read_globals(sd)


def test_small_perturbations_of_the_solution_never_improve_the_objective():
    gen = torch.Generator().manual_seed(5)
    a_model, s_model = tiny_model("llama", seed=0), tiny_model("llama", seed=31)
    r = match_state_dict(_sd(a_model), _sd(s_model), s_model.config, MatchOptions())
    ad, a_layers, _ = _layers(_sd(a_model), a_model.config)
    _, m_layers, _ = _layers(r.state_dict, r.config)
    L = ad.layout
    for a, m in zip(a_layers, m_layers):
        base = squared_distances(a, m)
        for eps in (1e-2, 1e-4):
            qk = [torch.linalg.matrix_exp(eps * _algebra_element(L, gen)) for _ in range(L.n_kv_heads)]
            vo = [torch.linalg.matrix_exp(eps * _skew(L.head_dim, gen)) for _ in range(L.n_kv_heads)]
            assert squared_distances(a, actions.rotate_qk(m, L, qk))["qk"] >= base["qk"] - 1e-12
            assert squared_distances(a, actions.rotate_vo(m, L, vo))["vo"] >= base["vo"] - 1e-12
        n = a["up.weight"].shape[0]
        for i, j in [(0, 1), (3, n - 1), (10, 20)]:  # swapping two neurons never helps
            perm = torch.arange(n)
            perm[[i, j]] = perm[[j, i]]
            assert squared_distances(a, actions.permute_ffn(m, perm))["ffn"] >= base["ffn"] - 1e-12

    # scales: optimal given the rotations; the residual rotation: optimal for the globals objective
    r = match_state_dict(_sd(a_model), _sd(s_model), s_model.config, ALL_RESIDUAL)
    folded = fold_state_dict(_sd(a_model), a_model.config)
    ad, a_layers, a_glob = _layers(folded.state_dict, folded.config)
    _, m_layers, m_glob = _layers(r.state_dict, r.config)
    for a, m in zip(a_layers, m_layers):
        base = squared_distances(a, m)
        for f in (0.99, 1.01):
            s = torch.full((L.n_kv_heads,), f, dtype=torch.float64)
            assert squared_distances(a, actions.scale_qk(m, L, s))["qk"] >= base["qk"] - 1e-12
            assert squared_distances(a, actions.scale_vo(m, L, s))["vo"] >= base["vo"] - 1e-12
    base = squared_distances(a_glob, m_glob, is_global=True)["embeddings"]
    for eps in (1e-2, 1e-4):
        Q = torch.linalg.matrix_exp(eps * _skew(ad.hidden, gen))
        moved = actions.rotate_residual_globals(m_glob, Q)
        assert squared_distances(a_glob, moved, is_global=True)["embeddings"] >= base - 1e-12


@pytest.mark.parametrize(
    "family,options", [("llama", ALL_RESIDUAL), ("qwen2", ALL_RESIDUAL), ("gpt2", ALL), ("bert", ALL)]
)
def test_matching_a_model_to_itself_returns_identities(family, options):
    model = tiny_model(family)
    sd = _sd(model)
    r = match_state_dict(sd, sd, model.config, options)
    assert r.solution.is_identity()
    assert r.distances.summary()["total"]["after"] < 1e-20


def test_qk_norm_family_matches_vo_only_and_refuses_qk():
    m = tiny_model("qwen3")
    r = match_state_dict(_sd(m), _sd(tiny_model("qwen3", seed=3)), m.config, MatchOptions())
    assert "qk_rotation" not in r.symmetries and "vo_rotation" in r.symmetries
    with pytest.raises(UnsupportedSymmetry, match="QK-norm"):
        match_state_dict(_sd(m), _sd(m), m.config, MatchOptions(heads="qk"))


# --------------------------------------------------------------------------- Gram transport


def test_grams_before_matching_transform_exactly_into_grams_after(exact_rmsnorm):
    a_model, s_model = tiny_model("llama", seed=0), tiny_model("llama", seed=41)
    batches = [torch.randint(2, 97, (2, 24), generator=torch.Generator().manual_seed(9))]
    cfg = s_model.config.to_dict()
    ad = Adapter.from_config(cfg, list(_sd(s_model)))
    before = gram_matrices(s_model, ad, batches, progress=False)
    assert set(before) == {"head_in"} | {
        f"layers.{i}.{n}" for i in range(2) for n in ("attn_in", "o_in", "ffn_in", "down_in")
    }
    r = match_state_dict(_sd(a_model), _sd(s_model), cfg, MatchOptions(scaling=True, residual=True))
    matched = _model(r.config, r.state_dict)
    after = gram_matrices(matched, Adapter.from_config(r.config, list(r.state_dict)), batches, progress=False)
    moved = r.solution.transform_grams(before, ad.layout)
    for key in after:
        scale = after[key].abs().max()
        assert (moved[key] - after[key]).abs().max() <= 1e-12 * scale, key
        assert (before[key] - after[key]).abs().max() > 1e-3 * scale, key  # untransformed Grams are wrong


# --------------------------------------------------------------------------- refusals and CLI


def _save(model, folder, tokenizer_vocab: dict | None = None):
    model.to(torch.float32).save_pretrained(folder)
    if tokenizer_vocab is not None:
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": tokenizer_vocab}}))
    return folder


@pytest.mark.parametrize(
    "other,message",
    [
        (lambda: tiny_model("gpt2"), "is a gpt2 model but"),
        (lambda: tiny_model("llama", intermediate_size=96), "intermediate_size"),
        (lambda: tiny_model("llama", vocab_size=101), "vocab_size"),
    ],
    ids=["family", "shape", "vocab-size"],
)
def test_incompatible_models_are_refused_before_any_work(tmp_path, capsys, other, message):
    a = _save(tiny_model("llama"), tmp_path / "a")
    b = _save(other(), tmp_path / "b")
    capsys.readouterr()
    assert main(["match", str(a), str(b), str(tmp_path / "out"), "--quiet", "--no-verify"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_different_vocabularies_are_refused_for_residual_matching(tmp_path, capsys):
    vocab = {f"t{i}": i for i in range(97)}
    a = _save(tiny_model("llama"), tmp_path / "a", vocab)
    b = _save(tiny_model("llama", seed=2), tmp_path / "b", {**vocab, "t0": 1, "t1": 0})
    capsys.readouterr()
    # (--no-verify: the stub tokenizer.json loads nowhere, and the verification's text check would say so first)
    assert main(["match", str(a), str(b), str(tmp_path / "out"), "--residual", "--quiet", "--no-verify"]) == 2
    assert "different vocabularies" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # head/FFN matching does not compare embedding rows, so it goes ahead
    assert main(["match", str(a), str(b), str(tmp_path / "out"), "--quiet", "--no-verify"]) == 0


def test_match_cli_writes_a_stock_folder_with_a_card(tmp_path, capsys):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    a = _save(tiny_model("llama"), tmp_path / "anchor")
    b = _save(tiny_model("llama", seed=9), tmp_path / "source")
    out = tmp_path / "matched"
    assert (
        main(
            [
                "match",
                str(a),
                str(b),
                str(out),
                "--residual",
                "--scaling",
                "--quiet",
                "--no-verify",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "matched llama model" in text and "total" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["distances"]["total"]["after"] < report["distances"]["total"]["before"]
    src = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float64)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert got.config.tie_word_embeddings is False  # the final norm folded into lm_head
    ids = input_ids()
    assert (outputs(src, ids) - outputs(got, ids)).abs().max() < 1e-4  # float32 checkpoint
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # no Hub ancestor; local paths stay private
    assert card.data.hf_symmetry["extra"]["anchor"] == "anchor" and card.data.hf_symmetry["extra"]["source"] == "source"
    assert str(tmp_path) not in (out / "README.md").read_text()
    assert "qk_rotation" in card.data.hf_symmetry["extra"]["symmetries"]
    assert "| total |" in card.text
    # the card shows the per-layer distance plot, a real PNG in the folder; every layer got closer
    assert "![Relative distance to the anchor per layer" in card.text and "(match_distances.png)" in card.text
    assert (out / "match_distances.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layers = report["layer_distances"]
    assert [r["layer"] for r in layers] == list(range(got.config.num_hidden_layers))
    assert all(r["relative_after"] < r["relative_before"] for r in layers)
    # refuses a non-empty OUT
    assert main(["match", str(a), str(b), str(out), "--quiet", "--no-verify"]) == 2


def test_match_distances_do_not_depend_on_the_hash_seed():
    """The card's distance figures summed tensors in set order, which Python's hash seed changes: the
    last digits of a match card differed between runs of the same command."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, torch\n"
        "from hf_symmetry.conversion.match.distances import squared_distances\n"
        "g = torch.Generator().manual_seed(0)\n"
        "keys = [f'norm{i}.weight' for i in range(64)]\n"
        "a = {k: torch.randn(8, generator=g) * 10 ** (i % 7) for i, k in enumerate(keys)}\n"
        "b = {k: torch.randn(8, generator=g) for k in keys}\n"
        "print(json.dumps(squared_distances(a, b)['norms'].hex()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True
        ).stdout.strip()
        for seed in range(4)
    }
    assert len(runs) == 1 and json.loads(runs.pop())
