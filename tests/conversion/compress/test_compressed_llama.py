"""``compress``: the compressed Llama family (structured layers, per-segment rotations with skip matrices,
tied head with its change of basis, SliceGPT slicing), parameter accounting, refusals of bad input,
the CLI, and on SmolLM2: full-rank exactness and loading as remote code without hf_symmetry."""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import replace

import pytest
import torch

import hf_symmetry  # noqa: F401  (registers the family)
from hf_symmetry.calibration import token_batches
from hf_symmetry.checkpoint_io import RowBlocks
from hf_symmetry.cli import main
from hf_symmetry.conversion import compress as C
from hf_symmetry.conversion.compress import folded as folded_mod
from hf_symmetry.conversion.compress import solve as solve_mod
from hf_symmetry.conversion.compress import terms as terms_mod
from hf_symmetry.conversion.compress.terms import TallTerm
from hf_symmetry.conversion.stream import DictSink
from hf_symmetry.solvers import structures as S
from hf_symmetry.symmetry.groups import haar_orthogonal, rng
from hf_symmetry.testing import SEQ40, full_width, full_rank, input_ids, outputs, run_without_hf_symmetry, tiny_model


def _source(model):
    return C.DictSource({k: v.detach() for k, v in model.state_dict().items()})


_full_rank = full_rank


def _exact_compression(model, structure: str, q_mode: str = "segment", dtype=torch.float64, seed=0):
    """Full-rank structures projected at random per-segment rotations (so skips and the head's change of
    basis are far from the identity)."""
    config = model.config.to_dict()
    options = C.CompressOptions(structure=structure, ratio=0.25, stage="f", q_mode=q_mode, f_iters=0, ratio_slack=1.0)
    src = _source(model)
    plan = _full_rank(C.plan_for(src, config, options)[0])
    n_seg = 2 * plan.n_layers + 1
    if q_mode == "segment":
        Qs = [haar_orthogonal(plan.hidden, rng(seed, k)) for k in range(n_seg)]
    else:
        Qs = [haar_orthogonal(plan.hidden, rng(seed, 0))] * n_seg
    counts = C.CalibrationStats(1, torch.ones(config["vocab_size"], dtype=torch.float64))  # stage F's token weights
    state, cfg, _ = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            hf_config=model.config,
            plan=plan,
            rotations=Qs,
            stats=counts,
            dtype=dtype,
            progress=False,
        )
    )
    return C.build_model(state, cfg, dtype)[0], cfg


class _BlockSink(dict):
    """A sink that takes row blocks (as the folder's CountingSink does, by its class attribute)."""

    row_blocks = True

    def add(self, tensors):
        self.update(tensors)


def test_the_two_tensor_entry_points_and_the_sinks_row_blocks(tmp_path):
    """compress_tensors collects the tensors (and refuses a sink: compress_into writes into one); a sink
    whose class takes row blocks gets vocabulary-sized factors as RowBlocks, a DictSink (the negative
    control) whole tensors, the same values either way."""
    model = tiny_model("llama", seed=2)
    config, src = model.config.to_dict(), _source(model)
    options = C.CompressOptions(structure="lowrank", ratio=0.25, stage="f", f_iters=0, ratio_slack=1.0)
    counts = C.CalibrationStats(1, torch.ones(config["vocab_size"], dtype=torch.float64))
    run = C.CompressRun(src, config, options, progress=False, stats=counts)
    with pytest.raises(ValueError, match="compress_into"):
        C.compress_tensors(replace(run, sink=DictSink()))
    state, _, _ = C.compress_tensors(run)
    plain, blocks = DictSink(), _BlockSink()
    for sink in (plain, blocks):
        C.compress_into(replace(run, sink=sink))
    streamed = [k for k, v in blocks.items() if isinstance(v, RowBlocks)]
    assert streamed and not any(isinstance(v, RowBlocks) for v in plain.values())
    assert set(plain) == set(blocks) == set(state)
    for k, v in blocks.items():
        whole = v.materialise() if isinstance(v, RowBlocks) else v
        assert torch.equal(whole, plain[k]) and torch.equal(plain[k], state[k]), k


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("structure", ["kron", "gs"])
def test_full_rank_compression_reproduces_the_model(family, structure, exact_rmsnorm):
    """Per-segment rotations, Cayley skips and the tied head's mix (llama) / untied head and biases (qwen2)."""
    model = tiny_model(family)
    compressed, cfg = _exact_compression(model, structure)
    assert cfg["skip_connections"] == "orthogonal"
    assert cfg["lm_head"] == ("tied_mixed" if family == "llama" else "separate")
    ids = input_ids()
    ref = outputs(model, ids)
    assert (outputs(compressed, ids) - ref).abs().max().item() <= 1e-9
    # negative control: a skip connection left at the identity breaks the function
    with torch.no_grad():
        compressed.model.layers[1].mlp_skip.skip_k.zero_()
        compressed.model.layers[1].mlp_skip.skip_signs.fill_(1.0)
    assert (outputs(compressed, ids) - ref).abs().max().item() > 1e-3


def test_full_width_slicegpt_is_exact(exact_rmsnorm):
    """SliceGPT's path (PCA rotations, dense skip matrices, norm over the original width) with nothing sliced."""
    model = tiny_model("llama")
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", q_mode="segment", ratio=0.25, ratio_slack=1.0)
    src = _source(model)
    plan = C.plan_for(src, config, options)[0]
    assert plan.residual < plan.hidden and plan.skip == "dense"
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
    ids = input_ids()
    assert (outputs(compressed, ids) - outputs(model, ids)).abs().max().item() <= 1e-9
    with torch.no_grad():
        compressed.model.layers[0].attn_skip.weight.copy_(torch.eye(plan.hidden))
    assert (outputs(compressed, ids) - outputs(model, ids)).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------- sequential calibration
def _rel(a, b):
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def _placement64():
    from hf_symmetry import devices

    return devices.resolve("cpu", "float64")


def _walk_setup(model, options, calib, seq_len, placement=None):
    config, src = model.config.to_dict(), _source(model)
    plan, adapter = C.plan_for(src, config, options)
    layers, globals_, gamma = C.read_folded(src, adapter, src.keys(), plan.tied)
    run = C.CompressRun(
        src, config, calib_ids=calib, placement=placement, calibration=replace(C.CALIBRATION, seq_len=seq_len)
    )
    return plan, adapter, layers, globals_, gamma, run


def _walk(model, calib, replace=lambda k, seq: []):
    """Sequential stage-W statistics on the calibration engine (float64), with ``replace(k, stats)``
    in place of the segment solves; also the one-pass statistics of the original model."""
    config = model.config.to_dict()
    given = dict(calib_ids=calib, placement=_placement64(), progress=False, calibration=SEQ40)
    ref = C.collect_statistics(C.CompressRun(_source(model), config, **given), want_normed=True, want_stream=False)
    seq = C.sequential_weighted(C.CompressRun(_source(model), config, stats=ref, **given), replace)
    return seq, ref


@pytest.mark.parametrize(
    "family,kwargs", [("llama", {}), ("qwen2", {}), ("llama", dict(attention_bias=True, mlp_bias=True))]
)
def test_sequential_walk_of_the_uncompressed_model_measures_the_one_pass_statistics(family, kwargs, exact_rmsnorm):
    """Nothing replaced: the calibration engine's sequential mode, each layer run as the family's own
    module with its norms folded (RoPE, GQA, biases, ragged batches 40+40+30), gives the statistics of
    one pass of the original model, segment after segment, and the original stream alongside is the
    same stream (cross moments = moments; no drift: each writer's target is its own output, its bias
    left out)."""
    model = tiny_model(family, **kwargs)
    calib = input_ids(batch=1, length=110, seed=3)[0]
    visited = []
    seq, ref = _walk(model, calib, lambda k, stats: visited.append(k) or [])
    L = model.config.num_hidden_layers
    assert visited == list(range(2 * L + 1)) and seq.tokens == ref.tokens == 110
    for name in ("normed", "attn_out", "mlp_hidden"):
        for a, b in zip(getattr(seq, name), getattr(ref, name)):
            assert _rel(a, b) < 1e-10, name
    for a, b in zip(seq.normed_cross, ref.normed):
        assert _rel(a, b) < 1e-10  # the original model alongside: the same activations
    _assert_targets_are_own_outputs(model, seq)  # ... and the same residual stream


def _writers(model, i):
    layer = model.model.layers[i]
    return {"attn_out": layer.self_attn.o_proj, "mlp_hidden": layer.mlp.down_proj}


def _assert_targets_are_own_outputs(model, seq, tol=1e-10):
    """No drift: each writer's target moment X̂ᵀ(H' − b − Ĥ) is its own outputs' X̂ᵀX̂ M (M = Wᵀ)."""
    for i in range(model.config.num_hidden_layers):
        for kind, linear in _writers(model, i).items():
            G, T = getattr(seq, kind)[i], getattr(seq, kind + "_target")[i]
            assert _rel(T, G @ linear.weight.detach().T.double()) < tol, (kind, i)


def test_sequential_walk_measures_the_model_with_replaced_matrices(exact_rmsnorm):
    """Negative control of the test above: replacing layer 0's q_proj (segment 0) and its o_proj
    (segment 1) changes exactly the statistics measured after them — o_proj's inputs, then the streams —
    and the original stream alongside now drifts away; the embedding's segment is untouched."""
    model = tiny_model("llama")
    calib = input_ids(batch=1, length=110, seed=3)[0]
    config, src = model.config.to_dict(), _source(model)
    options = C.CompressOptions(structure="gs", stage="w", sequential=True, ratio_slack=1.0)
    plan, adapter = C.plan_for(src, config, options)
    layers, *_ = C.read_folded(src, adapter, src.keys(), plan.tied)
    ms = plan.by_name()

    def replace(k, stats):
        if k == 0:
            return [(ms["layers.0.q_proj"], 0.5 * layers[0]["q.weight"])]
        if k == 1:
            return [(ms["layers.0.o_proj"], -layers[0]["o.weight"].T)]
        return []

    seq, ref = _walk(model, calib, replace)
    assert _rel(seq.normed[0], ref.normed[0]) < 1e-10
    assert _rel(seq.attn_out[0], ref.attn_out[0]) > 1e-2  # q scaled: other attention patterns
    assert _rel(seq.normed[1], ref.normed[1]) > 1e-2
    assert _rel(seq.normed[2], ref.normed[2]) > 1e-2  # o negated from segment 1 on
    # the targets are the original model's outputs (and stream), no longer the partly replaced model's own
    o, down = (w.weight.detach().T.double() for w in _writers(model, 0).values())
    assert _rel(seq.attn_out_target[0], seq.attn_out[0] @ o) > 1e-2
    assert _rel(seq.mlp_hidden_target[0], seq.mlp_hidden[0] @ down) > 1e-2


def test_sequential_statistics_are_those_of_the_compressed_model():
    """After a sequential solve, the o_proj/down_proj inputs (basis-free) of the assembled compressed model
    have exactly the second moments the solve used — and not those of the original model."""
    model = tiny_model("llama")
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(
        structure="gs",
        ratio=0.25,
        stage="w",
        sequential=True,
        f_iters=1,
        w_iters=2,
        als_iters=2,
        wopp_iters=10,
        ratio_slack=1.0,
    )
    plan, adapter, layers, globals_, gamma, calib_input = _walk_setup(model, options, calib, 40)
    one_pass = C.collect_statistics(
        C.CompressRun(_source(model), model.config.to_dict(), calib_ids=calib, calibration=SEQ40, progress=False),
        want_normed=True,
        want_stream=False,
    )
    run = C.CompressRun(
        calib_input.source,
        calib_input.config,
        options,
        calib,
        progress=False,
        plan=plan,
        stats=one_pass,
        calibration=SEQ40,
    )
    # the sequential calibration runs on the same input
    assert torch.equal(run.ids, calib_input.ids) and run.seq_len == calib_input.seq_len == 40
    res = solve_mod.solve(run, layers, globals_)
    state = C.Assembler(plan, layers, globals_, gamma, torch.float64).finish(res, progress=False)
    compressed = C.build_model(
        state, C.compressed_config(model.config.to_dict(), plan, options, model.config), torch.float64
    )[0]
    acc = {}

    def hook(key):
        def fn(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            acc[key] = acc.get(key, 0) + x.T @ x

        return fn

    handles = [
        getattr(layer, part).get_submodule(proj).register_forward_pre_hook(hook((i, proj)))
        for i, layer in enumerate(compressed.model.layers)
        for part, proj in (("self_attn", "o_proj"), ("mlp", "down_proj"))
    ]
    with torch.no_grad():
        for batch in token_batches(calib, 40):
            compressed(input_ids=batch)
    for h in handles:
        h.remove()
    for i in range(plan.n_layers):
        for proj, name in (("o_proj", "attn_out"), ("down_proj", "mlp_hidden")):
            measured = acc[(i, proj)] / calib.numel()
            assert _rel(getattr(res.stats, name)[i], measured) < 1e-5, (i, proj)
            assert _rel(getattr(one_pass, name)[i], measured) > 1e-3, (i, proj)


@pytest.mark.parametrize("structure, match", [("gs", True), ("gs", False), ("lowrank", True)])
def test_full_rank_sequential_stage_w_reproduces_the_model(structure, match, exact_rmsnorm):
    """Matching the original model, the targets are M itself only if the compressed model's inputs are the
    original's and the regularisation pulls towards M (towards 0, the relative error here is 0.3)."""
    model = tiny_model("llama")
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(
        structure=structure,
        ratio=0.25,
        stage="w",
        sequential=True,
        match_original=match,
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
            calib_ids=calib,
            hf_config=model.config,
            plan=plan,
            rotations=Qs if structure == "gs" else None,
            dtype=torch.float64,
            progress=False,
            placement=_placement64(),
            calibration=SEQ40,
        )
    )
    assert report.options["sequential"] and any(
        k.startswith("W/segment") or k.startswith("segment") for k in report.objective
    )
    ids = input_ids()
    ref = outputs(model, ids)
    err = (outputs(C.build_model(state, cfg, torch.float64)[0], ids) - ref).abs().max() / ref.abs().max()
    assert err <= 1e-9, err


def _whole_matched(m, M, stats, damping, consume=False, rows_gram=False, reader_map=None):
    """``matched_target`` as computed before the ridge went onto the diagonals (dense ``[k, k]`` ridge matrix),
    from the statistics alone (nothing consumed, nothing damped in place): the target and a writer's
    damped moments."""
    if m.role == "reader":
        G, Cx = stats.normed[m.segment], stats.normed_cross[m.segment]
        ridge = terms_mod.damped(G, damping) - G
        return torch.linalg.solve(G + ridge, (Cx + ridge) @ M.T).T, None
    key = "attn_out" if m.canon == "o" else "mlp_hidden"
    G, T = getattr(stats, key)[m.layer], getattr(stats, key + "_target")[m.layer]
    ridge = terms_mod.damped(G, damping) - G
    out = torch.linalg.solve(G + ridge, T + ridge @ M)
    return out, (out.T @ (G + ridge) @ out if rows_gram else G + ridge)


@pytest.mark.parametrize("structure", ["lowrank", "gs", "kron"])
def test_written_checkpoint_holds_the_in_memory_tensors(tiny_dir, tmp_path, structure):
    """``compress_checkpoint`` hands each part to the shard writer as it is assembled, a low-rank or
    GS embedding's row factor streamed a block of rows at a time (:class:`RowBlocks`; GS: ``[1, vocab,
    c]``; Kronecker: ``B [vocab, r, n2]``): the files hold exactly the tensors ``compress_tensors``
    collects in memory from the same tokens."""
    from hf_symmetry.checkpoint_io import CheckpointReader
    from hf_symmetry.evaluation.compare import load_tokenizer
    from hf_symmetry.text import read_text, tokenize_text

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(300)))
    options = C.CompressOptions(structure=structure, ratio=0.3, sequential=True, f_iters=1, w_iters=1, ratio_slack=0.1)
    calibration = replace(C.CALIBRATION, text=calib, seq_len=64)
    reader = CheckpointReader(tiny_dir)
    assert TallTerm.applies(C.plan_for(reader, reader.config, options)[0].by_name()["embed"])
    C.compress_checkpoint(tiny_dir, tmp_path / "out", options, calibration, progress=False)
    ids = tokenize_text(load_tokenizer(tiny_dir), read_text(calib), max_tokens=calibration.tokens)
    state, _, _ = C.compress_tensors(
        C.CompressRun(
            reader, reader.config, options, calib_ids=ids, dtype=torch.float32, progress=False, calibration=calibration
        )
    )
    written = CheckpointReader(tmp_path / "out")
    row_factor = {"lowrank": "lr_u", "gs": "gs_left", "kron": "kron_b"}[structure]
    assert set(written.keys()) == set(state) and any(k.endswith(row_factor) and "embed" in k for k in state)
    got = written.get(written.keys())
    assert all(torch.equal(got[k], state[k]) for k in state)


def _whole_reader_moments(segment, stats, damping, device, matched, consume):
    """``reader_weights`` as a dense-ridge computation that leaves the statistics in place."""
    G = stats.normed[segment]
    ridge = terms_mod.damped(G, damping) - G
    A = torch.linalg.solve(G + ridge, stats.normed_cross[segment] + ridge) if matched else None
    return G + ridge, A


@pytest.mark.parametrize("structure", ["lowrank", "gs", "kron"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("sequential", [False, True])
def test_streamed_low_rank_equals_the_whole_matrix_computation(sequential, tied, structure, monkeypatch, exact_rmsnorm):
    """What keeps low rank (and GS and Kronecker embeddings, whose rows are free) flat in depth changes
    no tensor: the
    embedding and an untied head solved on
    their Grams accumulated a block of rows at a time and lifted block by block (``TallTerm``; the
    head's matched target ``M Aᵀ`` applied per block, never read whole), the matched targets with the
    ridge on the diagonals and the writers' moments damped in place, and each part written as soon as its
    segments are solved (``Assembler.segment_done``) give the tensors (float64, to 1e-10) of the
    whole-matrix computation, with at most three rotations held: the vocabulary-sized matrices reduced
    and lifted inside ``solve_segment``, a dense ridge, everything assembled at the end. Negative
    control: a 1 % change of the damping is seen at this tolerance."""
    model = tiny_model("llama", tie_word_embeddings=tied)
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(
        structure=structure,
        ratio=0.25,
        stage="w",
        sequential=sequential,
        ratio_slack=1.0,
        f_iters=0,
        w_iters=0,
    )
    # (GS at Q = I: with rotation steps the round-off of a Gram summed by blocks is amplified by the
    # rotation search's line search to ~1e-4 relative, the same objective reached by another path)
    ms = C.plan_for(_source(model), config, options)[0].by_name()
    assert TallTerm.applies(ms["embed"])
    assert tied or TallTerm.applies(ms["lm_head"])
    whole_read = folded_mod.FoldedGlobals.__getitem__

    def no_whole_head(self, key):
        assert key != "lm_head.weight", "the head was read whole"
        return whole_read(self, key)

    monkeypatch.setattr(folded_mod.FoldedGlobals, "__getitem__", no_whole_head)
    streamed, live = [], []

    def segment_done(self, k, Qs, f, _orig=C.Assembler.segment_done):
        streamed.append(k)
        _orig(self, k, Qs, f)
        live.append(sum(Q is not None for Q in Qs))  # rotations still held once segment k is written

    monkeypatch.setattr(C.Assembler, "segment_done", segment_done)

    def run(**changes):
        state, _, report = C.compress_tensors(
            C.CompressRun(
                _source(model),
                config,
                options.with_(**changes),
                calib_ids=calib,
                hf_config=model.config,
                dtype=torch.float64,
                progress=False,
                placement=_placement64(),
                calibration=SEQ40,
            )
        )
        return state, report

    new, report = run()
    assert streamed == list(range(2 * config["num_hidden_layers"] + 1))
    assert max(live) <= 3, live  # flat in depth: those of written layers released (segment 0 kept: tied head)
    with monkeypatch.context() as mp:
        mp.setattr(folded_mod.FoldedGlobals, "__getitem__", whole_read)
        mp.setattr(TallTerm, "applies", staticmethod(lambda m: False))
        mp.setattr(terms_mod, "matched_target", _whole_matched)
        mp.setattr(terms_mod, "reader_weights", _whole_reader_moments)
        mp.setattr(C.Assembler, "segment_done", lambda self, k, Qs, f: None)
        whole, whole_report = run()
        other, _ = run(damping=0.0101)
    assert new.keys() == whole.keys() == other.keys()
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    assert max(rel(new[k], whole[k]) for k in new) < 1e-10
    assert abs(report.relative_errors["embed"] - whole_report.relative_errors["embed"]) < 1e-10
    assert max(rel(other[k], whole[k]) for k in new) > 1e-6


@pytest.mark.parametrize("canon", ["q", "o", "down"])
def test_matched_targets_are_ridge_least_squares_fits_of_the_original_outputs(canon):
    """Reader: X̂ M'ᵀ ≈ X Mᵀ; writers: X̂ M' ≈ X M + D (undo the stream's drift D); ridge towards M."""
    g = torch.Generator().manual_seed(0)
    n, k, d = 200, 5, 6
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    reader = canon == "q"
    M = randn(k, d)
    X = randn(n, d if reader else k)
    Xh = X + 0.3 * randn(*X.shape)
    D = torch.zeros(n, d) if reader else 0.5 * randn(n, d)
    G, key = Xh.T @ Xh / n, {"q": "normed", "o": "attn_out", "down": "mlp_hidden"}[canon]
    stats = C.CalibrationStats(n, torch.ones(3), **{key: [G]})
    if reader:
        stats.normed_cross = [Xh.T @ X / n]
    else:
        setattr(stats, key + "_target", [Xh.T @ (X @ M + D) / n])
    segment = {"q": 0, "o": 1, "down": 2}[canon]  # layer 0's
    m = C.MatrixPlan("m", canon, 0, "reader" if reader else "writer", segment, S.Dense((k, d)))
    G0 = G.clone()
    got, metric = C.matched_target(m, M, stats, damping=0.05, consume=True)
    if reader:
        assert metric is None and stats.normed == [G] and torch.equal(G, G0)  # shared by the segment's readers
    else:  # a writer's statistics are consumed and its moments damped in place: they are its row metric
        assert getattr(stats, key) == [None] and getattr(stats, key + "_target") == [None]
        assert metric is G and torch.allclose(metric, G0 + 0.05 * G0.diagonal().mean() * torch.eye(k), atol=1e-15)
    lam = (n * 0.05 * G0.diagonal().mean()).sqrt()
    A = torch.cat([Xh, lam * torch.eye(X.shape[1], dtype=torch.float64)])
    target, prior = (X @ M.T, M.T) if reader else (X @ M + D, M)
    want = torch.linalg.lstsq(A, torch.cat([target, lam * prior])).solution
    assert torch.allclose(got, want.T if reader else want, atol=1e-10)
    if not reader:  # a reducible writer's target by an in-place Cholesky solve, and only Mᵀ Gd M of its weight
        Gd = G0 + 0.05 * G0.diagonal().mean() * torch.eye(k, dtype=torch.float64)
        fresh = lambda G: C.CalibrationStats(n, torch.ones(3), **{key: [G], key + "_target": [Xh.T @ (X @ M + D) / n]})  # noqa: E731
        got2, P = C.matched_target(m, M, fresh(G0.clone()), damping=0.05, consume=True, rows_gram=True)
        assert torch.allclose(got2, want, atol=1e-10) and torch.allclose(P, want.T @ Gd @ want, atol=1e-10)
        with pytest.raises(ValueError, match="not positive definite"):
            C.matched_target(m, M, fresh(-G0.clone()), damping=0.05, consume=True, rows_gram=True)


@pytest.mark.parametrize("kwargs", [dict(stage="f"), dict(q_mode="global"), dict(structure="slice")])
def test_sequential_calibration_is_refused_where_it_does_not_apply(kwargs):
    with pytest.raises(ValueError, match="sequential calibration applies"):
        C.CompressOptions(**{"structure": "gs", "stage": "w", "sequential": True, **kwargs}).validate()


# ----------------------------------------------------------------------------- ratios and parameters
@pytest.mark.parametrize("q_mode", ["segment"])
def test_equal_ratios_give_equal_model_sizes(q_mode):
    model = tiny_model("llama", dtype=torch.float32)
    calib = input_ids(batch=1, length=160, seed=5)[0]
    ids = input_ids(batch=1, length=10)
    totals = {}
    for structure in ("kron", "gs", "lowrank", "slice"):
        options = C.CompressOptions(
            structure=structure,
            ratio=0.3,
            stage="w",
            q_mode=q_mode,
            f_iters=1,
            w_iters=2,
            als_iters=2,
            ratio_slack=0.05,
            wopp_iters=10,
        )
        compressed, report = C.compress_model(model, options, calib_ids=calib, calibration=SEQ40)
        acc = report.accounting
        # parameter counts from the module shapes agree with the plan
        assert acc.compressed_model_params_counted == acc.compressed_model_params
        assert abs(acc.ratio_over_compressed - 0.3) <= 0.05
        totals[structure] = acc.compressed_model_params
        out = compressed.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert out.shape == (1, 14)
    p_c = acc.dense_params_of_compressed_matrices
    assert max(totals.values()) - min(totals.values()) <= 0.1 * p_c, totals


def test_ratio_is_reported_per_matrix_and_over_the_model():
    model = tiny_model("qwen2", dtype=torch.float32)
    options = C.CompressOptions(structure="kron", ratio=0.25, stage="none", ratio_slack=0.05)
    compressed, report = C.compress_model(model, options)
    acc = report.accounting
    per = acc.per_matrix
    assert per["layers.0.v_proj"]["ratio"] == 0  # V stays dense, as in the paper
    assert all(0.2 < per[f"layers.0.{m}"]["ratio"] < 0.3 for m in ("q_proj", "o_proj", "down_proj"))
    assert sum(p.numel() for p in compressed.parameters()) == acc.compressed_model_params
    dense = sum(p.numel() for p in model.parameters())
    assert acc.dense_model_params == dense
    assert acc.ratio_over_model == pytest.approx(1 - acc.compressed_model_params / dense)
    assert 0 < acc.ratio_over_model < acc.ratio_over_compressed


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ratio=0.995), "cannot be met|meets ratio"),
        (dict(ratio=1.5), "ratio must be in"),
        (dict(ratio=0.0), "ratio must be in"),
        (dict(structure="kron", kron_factor=5), "does not divide"),
        (dict(structure="gs", gs_blocks=(5, 4)), "do not divide"),
        (dict(structure="tucker"), "unknown structure"),
    ],
)
def test_impossible_requests_are_refused_by_the_plan(kwargs, match):
    model = tiny_model("llama", dtype=torch.float32)
    options = C.CompressOptions(**{"stage": "none", **kwargs})
    with pytest.raises(ValueError, match=match):
        C.plan_for(_source(model), model.config.to_dict(), options)


@pytest.mark.parametrize("family", ["gpt2", "bert", "smollm3"])  # smollm3: NoPE layers (qwen3: supported)
def test_unsupported_families_are_refused(family):
    model = tiny_model(family, dtype=torch.float32)
    with pytest.raises(ValueError, match="compress: "):  # the capability's structural reason
        C.plan_for(_source(model), model.config.to_dict(), C.CompressOptions(stage="none"))


def test_empty_calibration_text_fails_before_any_work(tiny_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="empty"):
        C.compress_checkpoint(
            tiny_dir, out, C.CompressOptions(stage="f"), replace(C.CALIBRATION, text=empty), progress=False
        )
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    assert main(["compress", str(tiny_dir), str(out), "--calib", str(empty), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty" in err[0] and not out.exists()
    # a stage that needs calibration, without any
    assert main(["compress", str(tiny_dir), str(out), "--stage", "w", "--quiet"]) == 2
    assert "--calib is required" in capsys.readouterr().err and not out.exists()
    # an impossible ratio is refused before the calibration text is even read
    assert main(["compress", str(tiny_dir), str(out), "--ratio", "0.995", "--calib", str(empty), "--quiet"]) == 2
    assert "ratio" in capsys.readouterr().err and not out.exists()
    # bad verification flags (the one verification path of every conversion) too
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    assert main(["compress", str(tiny_dir), str(out), "--calib", str(calib), "--ppl-tokens", "1", "--quiet"]) == 2
    assert "--ppl-tokens" in capsys.readouterr().err and not out.exists()


def test_cli_writes_a_loadable_model_with_its_report(tiny_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    out = tmp_path / "kron"
    assert (
        main(
            [
                "compress",
                str(tiny_dir),
                str(out),
                "--structure",
                "kron",
                "--ratio",
                "0.25",
                "--stage",
                "w",
                "--f-iters",
                "2",
                "--w-iters",
                "2",
                "--calib",
                str(calib),
                "--calib-seq-len",
                "64",
                "--quiet",
                "--no-verify",
                "--json",
                str(tmp_path / "summary.json"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "removed from the model" in text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "hf_symmetry_compressed_llama"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_compressed_llama.CompressedLlamaForCausalLM"
    for name in ("modeling_compressed_llama.py", "configuration_compressed_llama.py", "structured_linear.py"):
        assert (out / name).is_file(), name
    report = json.loads((out / "compression_report.json").read_text())
    assert report["accounting"]["compressed_model_params"] == report["accounting"]["compressed_model_params_counted"]
    assert (out / "README.md").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert (
        sum(p.numel() for p in model.parameters()) + 2 * 2 * cfg["hidden_size"]
        == report["accounting"]["compressed_model_params"]
    )  # + the skip signs (buffers)
    ids = input_ids(batch=1, length=8)
    assert model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, 11)
    # refusing to overwrite
    assert main(["compress", str(tiny_dir), str(out), "--stage", "none", "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--structure", "kron", "--sequential"],
        ["--structure", "gs", "--ratio", "0.29"],
        ["--structure", "lowrank", "--sequential"],
        ["--structure", "slice", "--q-mode", "segment", "--sequential"],
    ],
)
def test_compress_never_loads_the_whole_source_model(flags, tiny_dir, tmp_path, capsys, monkeypatch):
    """Calibration (one pass or sequential), solve and assembly read the checkpoint layer by layer: no
    model class is ever instantiated from the source folder (``from_pretrained`` fails here); the
    verification step, which loads through accelerate's big-model loading, is skipped."""
    import transformers

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    out = tmp_path / "out"
    common = [
        str(tiny_dir),
        str(out),
        "--stage",
        "w",
        "--f-iters",
        "1",
        "--w-iters",
        "2",
        "--calib",
        str(calib),
        "--calib-seq-len",
        "64",
        "--quiet",
        "--no-verify",
        *flags,
    ]
    if "--sequential" in flags and "kron" in flags:
        assert main(["compress", *common, "--q-mode", "global"]) == 2
        assert "sequential calibration applies" in capsys.readouterr().err and not out.exists()

    def no_model(*args, **kwargs):
        raise AssertionError("compress loaded a whole model")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_model))
    assert main(["compress", *common]) == 0, capsys.readouterr().err
    report = json.loads((out / "compression_report.json").read_text())
    assert report["options"]["sequential"] == ("--sequential" in flags)
    if "--sequential" in flags and "slice" not in flags:
        assert report["options"]["match_original"]
        assert any(k.startswith(("W/segment", "segment")) for k in report["objective"])
    with pytest.raises(AssertionError, match="loaded a whole model"):  # the patch does catch a load
        transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)


def test_cli_card_states_the_compression_and_push_to_hub_publishes_it(tiny_dir, tmp_path, monkeypatch):
    """The README (model_cards/compress.md, parsed back by huggingface_hub) states structure, stage,
    q-mode, the ratio per matrix and over the model, perplexity before and after; ``--push-to-hub`` is
    accepted and publishes OUT after its card is written (the Hub itself is faked here: see
    test_push.py for real round trips)."""
    from types import SimpleNamespace

    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    from hf_symmetry.hub import push as hub_push

    pushed = []

    def fake_push(folder, repo_id, private=False, progress=True):
        card = ModelCard.load(os.path.join(folder, "README.md"))  # the card is there before the push
        pushed.append((str(folder), repo_id, private, card.data.hf_symmetry["kind"]))
        return SimpleNamespace(
            files=["README.md"],
            bytes=1,
            commit_url=f"https://hub/{repo_id}/commit/1",
            as_dict=lambda: {"repo_id": repo_id},
        )

    monkeypatch.setattr(hub_push, "resolve_token", lambda token=None: "token")  # no token nor network in tests
    monkeypatch.setattr(hub_push, "check_online", lambda: None)
    monkeypatch.setattr(hub_push, "push_folder", fake_push)
    from hf_symmetry.commands import common  # the command module looks them up in its own namespace

    monkeypatch.setattr(common, "resolve_token", lambda token=None: "token")
    monkeypatch.setattr(common, "check_online", lambda: None)
    monkeypatch.setattr(common, "push_folder", fake_push)
    calib, held = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    held.write_text(" ".join(str((11 * i + 5) % 97) for i in range(300)))
    out = tmp_path / "kron-global"
    assert (
        main(
            [
                "compress",
                str(tiny_dir),
                str(out),
                "--structure",
                "kron",
                "--ratio",
                "0.28",
                "--stage",
                "f",
                "--q-mode",
                "global",
                "--f-iters",
                "1",
                "--w-iters",
                "2",
                "--calib",
                str(calib),
                "--calib-seq-len",
                "64",
                "--text",
                str(held),
                "--tokens",
                "16",
                "--ppl-tokens",
                "256",
                "--quiet",
                "--push-to-hub",
                "user/compressed",
                "--private",
                "--json",
                str(tmp_path / "summary.json"),
            ]
        )
        == 0
    )
    assert pushed == [(str(out), "user/compressed", True, "compress")]
    assert json.loads((tmp_path / "summary.json").read_text())["push"] == {"repo_id": "user/compressed"}
    assert all(p.is_file() for p in out.iterdir())  # the global solve's spill folder is gone

    report = json.loads((out / "compression_report.json").read_text())
    assert str(tmp_path) not in (out / "compression_report.json").read_text()  # published: no local paths
    assert report["source"].startswith(tiny_dir.name)  # a local input is named by its folder
    acc, pp = report["accounting"], report["perplexity"]
    card = ModelCard.load(out / "README.md")
    assert "hf_symmetry-compress" in card.data.tags
    meta = card.data.hf_symmetry
    assert meta["parameters"]["structure"] == "kron" and meta["parameters"]["q_mode"] == "global"
    assert meta["extra"]["ratio_over_model"] == acc["ratio_over_model"]
    text = card.text
    readme = (out / "README.md").read_text()
    assert str(tiny_dir) not in readme and str(held) not in readme  # local paths stay private
    assert "structure: **kron**" in text and "stage: **f**" in text and "q-mode: **global**" in text
    assert f"**{100 * acc['ratio_over_compressed']:.1f}%** of the compressed matrices' parameters" in text
    assert f"**{100 * acc['ratio_over_model']:.1f}%** of the whole model" in text
    assert f"before **{pp['original']:.3f}**, after **{pp['compressed']:.3f}**" in text
    n_layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    for name, m in acc["per_matrix"].items():
        if name.startswith("layers.0.") or "." not in name:
            spec = ", ".join(f"{k}={v}" for k, v in m["structure"].items())
            count = n_layers if name.startswith("layers.") else 1
            row = f"| {name.split('.')[-1]} | {count} | `{spec}` |"
            assert row in text and f"| {100 * m['ratio']:.1f}% |" in text.split(row, 1)[1].splitlines()[0]
    _, results = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert [r.metric_value for r in results if r.metric_type == "perplexity"] == [pp["compressed"]]


# ----------------------------------------------------------------------------- SmolLM2
ISOLATED_LOADER = textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True).eval()
    ids = load_file(IDS)["ids"]
    with torch.no_grad():
        logits = model(ids.unsqueeze(0)).logits[0]
    save_file({"logits": logits.contiguous()}, OUTPUT)
    print(json.dumps({"imported": "hf_symmetry" in sys.modules, "module": type(model).__module__}))
""")


@pytest.fixture(scope="module")
def smollm2_full_rank(smollm2):
    return _exact_compression(smollm2, "kron", dtype=torch.float32, seed=1)[0]


@pytest.mark.slow
def test_full_rank_compression_of_smollm2_reproduces_its_logits(smollm2, smollm2_full_rank, eval_ids):
    ref = outputs(smollm2, eval_ids[None])
    got = outputs(smollm2_full_rank, eval_ids[None])
    assert (got - ref).abs().max().item() <= 1e-3
    assert smollm2_full_rank.config.skip_connections == "orthogonal"


@pytest.mark.slow
def test_compressed_smollm2_loads_as_remote_code_without_hf_symmetry(smollm2_full_rank, eval_ids, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "compressed"
    smollm2_full_rank.save_pretrained(folder)
    ids = eval_ids[:128]
    save_file({"ids": ids.contiguous()}, str(tmp_path / "ids.safetensors"))
    out = str(tmp_path / "logits.safetensors")
    meta = run_without_hf_symmetry(
        ISOLATED_LOADER, tmp_path, timeout=600, FOLDER=str(folder), IDS=str(tmp_path / "ids.safetensors"), OUTPUT=out
    )
    assert meta["imported"] is False and meta["module"].startswith("transformers_modules.")
    # The in-process reference loads the same folder through hf_symmetry's registered classes, on one
    # thread like the subprocess, so both run the same kernels in the same order.
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(local).__module__.startswith("hf_symmetry.")
        with torch.no_grad():
            ref = local(ids[None]).logits[0]
    finally:
        torch.set_num_threads(threads)
    assert (load_file(out)["logits"] - ref).abs().max().item() <= 1e-5
    # and the folder is the model that was saved (float32 round-off of 30 layers of kernels)
    with torch.no_grad():
        assert (smollm2_full_rank(ids[None]).logits[0] - ref).abs().max().item() <= 1e-3


def test_modeling_files_only_import_torch_and_transformers():
    import ast
    from pathlib import Path

    folder = Path(hf_symmetry.__file__).parent / "modeling"
    allowed = {"torch", "transformers", "huggingface_hub", "__future__", "dataclasses", "typing"}
    siblings = {"configuration_compressed_llama", "structured_linear"}  # shipped beside it (remote code)
    for name in ("modeling_compressed_llama.py", "configuration_compressed_llama.py", "structured_linear.py"):
        for node in ast.walk(ast.parse((folder / name).read_text())):
            if isinstance(node, ast.Import):
                assert {a.name.split(".")[0] for a in node.names} <= allowed, name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level == 1 and node.module in siblings, name
                else:
                    assert node.module.split(".")[0] in allowed, name


# ----------------------------------------------------------------------------- converged stage W by default
def test_stage_w_runs_to_convergence_by_default_and_the_flags_reach_the_solver(monkeypatch):
    """Defaults: stage W capped at 50 alternations, stopped by a relative decrease of 1e-3, with
    over-relaxation; stage F stops by the same rule, without it. ``--w-iters 1 --tol 0 --no-extrapolate``
    is the single alternation of the paper, and the card lists the settings that apply."""
    from hf_symmetry.cli import build_parser
    from hf_symmetry.flags import from_args

    solve_module = solve_mod

    calls = []
    real = solve_module.solve_segment

    def spy(terms, Q0, schedule):
        res = real(terms, Q0, schedule)
        calls.append((schedule.iters, schedule.tol, schedule.extrapolate, res.alternations, res.converged))
        return res

    monkeypatch.setattr(solve_module, "solve_segment", spy)
    model = tiny_model("llama", dtype=torch.float32)
    calib = input_ids(batch=1, length=120, seed=5)[0]
    options = C.CompressOptions(
        structure="gs", ratio=0.3, stage="w", f_iters=3, ratio_slack=0.05, als_iters=2, wopp_iters=10
    )
    assert (options.w_iters, options.stop_tol, options.extrapolate) == (50, 1e-3, True)
    C.compress_model(model, options, calib_ids=calib, calibration=SEQ40)
    n_seg = 2 * model.config.num_hidden_layers + 1
    stage_f, stage_w = calls[:n_seg], calls[n_seg:]
    assert len(stage_w) == n_seg
    assert all(c[:3] == (3, 1e-3, False) for c in stage_f)
    assert all(c[:3] == (50, 1e-3, True) for c in stage_w)
    assert any(c[4] and 1 <= c[3] < 50 for c in stage_w), stage_w  # stopped by the rule, not the cap
    params = options.applicable(SEQ40)
    assert params["w_iters"] == 50 and params["tol"] == 1e-3 and params["extrapolate"] is True

    parser = build_parser()
    new = from_args(C.CompressOptions, parser.parse_args(["compress", "m", "out", "--structure", "gs"]))
    assert (new.w_iters, new.stop_tol, new.extrapolate) == (50, 1e-3, True)
    old = from_args(
        C.CompressOptions,
        parser.parse_args(
            ["compress", "m", "out", "--structure", "gs", "--w-iters", "1", "--tol", "0", "--no-extrapolate"]
        ),
    )
    assert (old.w_iters, old.stop_tol, old.extrapolate) == (1, 0.0, False)


@pytest.mark.parametrize(
    "family,dtype",
    [
        ("llama", torch.float32),
        ("qwen2", torch.float64),
        ("qwen3", torch.bfloat16),
        ("gemma2", torch.bfloat16),
        ("phi3", torch.float32),
    ],
)
def test_lazy_folded_layers_fold_each_matrix_as_the_whole_layer_fold(family, dtype):
    """The solvers' layers are kept in their checkpoint dtype and each matrix is folded in float64 when
    read (:class:`FoldedLayer`): every tensor equals, bit for bit, the whole layer read in float64 and
    folded at once — also for biases (Qwen2), QK-norms (Qwen3), norms stored as γ − 1 in bfloat16
    (Gemma 2: made γ in float64, not in bfloat16) and fused projections (Phi-3). Negative control: the
    same matrices folded from the bfloat16 γ − 1 + 1 differ."""
    from hf_symmetry.architectures import Adapter
    from hf_symmetry.conversion.stream import partition_keys
    from hf_symmetry.symmetry import actions

    model = tiny_model(family, dtype=dtype)
    src = _source(model)
    adapter = Adapter.from_config(model.config.to_dict(), src.keys())
    _, per_layer, _ = partition_keys(adapter, src.keys())
    lazy = C.FoldedLayers(src, adapter, per_layer, keep=1)
    for i in range(adapter.n_layers):
        whole = actions.fold_layer_norms(adapter.read_layer(i, src.get(per_layer[i])))
        layer = lazy[i]
        assert set(layer) == set(whole)
        for k, t in whole.items():
            got = layer[k]
            assert got.dtype == torch.float64 and torch.equal(got, t), (family, i, k)
        assert layer["q.weight"].data_ptr() != layer["q.weight"].data_ptr()  # a fresh copy per read
        assert all(t.dtype == torch.float64 for t in layer.norms.values())  # only the norms are kept
    assert lazy.reads == adapter.n_layers and len(lazy._cache) == 1  # one layer kept
    if family == "gemma2":  # negative control: γ − 1 restored in bfloat16 is not γ
        raw = adapter.read_layer(0, src.get(per_layer[0]), dtype=None)
        rough = actions.fold_layer_norms({k: v.to(torch.float64) for k, v in raw.items()})
        assert not torch.equal(rough["q.weight"], lazy[0]["q.weight"])


def test_consuming_terms_build_the_same_problem_and_drop_the_writer_statistics(exact_rmsnorm):
    """Sequential stage W with ``keep_stats=False`` builds a segment's terms consuming the writers'
    moments (dropped from the statistics as soon as the matched target and the damped row weight are
    made, so the FFN's ``4d × 4d`` moments are not held through the solve): the terms are those built
    without consuming — same matched matrices, same row weights (a reducible writer's as ``Mᵀ G M``, G
    itself released), same column weights — and the segment's statistics are gone: the writers' and
    the readers' normalised-stream moments, consumed once their shared column weight and map are made."""
    import copy

    S = solve_mod
    model = tiny_model("llama")
    calib = input_ids(batch=1, length=110, seed=3)[0]
    config, src = model.config.to_dict(), _source(model)
    options = C.CompressOptions(structure="lowrank", ratio=0.3, sequential=True, ratio_slack=1.0)
    plan, adapter = C.plan_for(src, config, options)
    layers, globals_, _ = C.read_folded(src, adapter, src.keys(), plan.tied)
    seq, _ = _walk(model, calib)
    for k in (1, 2):  # layer 0's attention (o) and FFN (down) segments
        kept, eaten = copy.deepcopy(seq), copy.deepcopy(seq)
        run = C.CompressRun(src, config, options, plan=plan)
        a = S.segment_terms(replace(run, stats=kept), layers, globals_, "w", k)
        b = S.segment_terms(replace(run, stats=eaten), layers, globals_, "w", k, consume=True)
        assert [t.name for t in a] == [t.name for t in b] and len(a) >= 2
        for ta, tb in zip(a, b):
            assert _rel(tb.M, ta.M) < 1e-12, ta.name
            assert (ta.col_gram is None) == (tb.col_gram is None), ta.name
            if ta.col_gram is not None:
                assert _rel(tb.col_gram, ta.col_gram) == 0, ta.name
            if ta.row_gram is not None and tb.row_gram is not None:
                assert _rel(tb.row_gram.matrix, ta.row_gram.matrix) == 0
            elif ta.row_gram is not None:  # a reducible writer keeps only Mᵀ G M: the same reduced problem
                assert tb.reducible() and tb.energy() == pytest.approx(ta.energy(), rel=1e-12)
                (ra, _), (rb, _) = ta.reduced(), tb.reduced()
                assert _rel(rb.M, ra.M) < 1e-10, ta.name
                with pytest.raises(RuntimeError, match="released"):
                    tb.error(torch.eye(tb.M.shape[1], dtype=torch.float64))
        writer = "attn_out" if k == 1 else "mlp_hidden"
        for name in (writer, writer + "_target"):
            assert getattr(kept, name)[0] is not None and getattr(eaten, name)[0] is None, name
        # the readers' moments too, once their shared column weight and map are made from them in place
        assert kept.normed[k] is not None and kept.normed_cross[k] is not None
        assert eaten.normed[k] is None and eaten.normed_cross[k] is None
