"""``--q-mode global``: one rotation over every segment, solved with the weights streamed from the
checkpoint on each alternation (:class:`hf_symmetry.conversion.compress.solve.GlobalSolve`). It must
give the same rotation and factors as the whole problem held in memory and solved at once
(:func:`hf_symmetry.solvers.segments.solve_segment` on every term), and read the layers again on
each alternation instead of holding them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import hf_symmetry  # noqa: F401  (registers the family)
from hf_symmetry.conversion import compress as C
from hf_symmetry.conversion.compress import solve as SV
from hf_symmetry.conversion.compress.moments import one_pass_statistics
from hf_symmetry.solvers.segments import solve_segment
from hf_symmetry.testing import SEQ40, input_ids, tiny_model


def _setup(structure: str, stage: str, solver_dtype: str, family: str = "llama"):
    model = tiny_model(family)
    config = model.config.to_dict()
    options = C.CompressOptions(
        structure=structure,
        ratio=0.3,
        stage=stage,
        q_mode="global",
        f_iters=3,
        w_iters=3,
        als_iters=2,
        wopp_iters=10,
        ratio_slack=1.0,
        solver_dtype=solver_dtype,
    )
    src = C.DictSource({k: v.detach() for k, v in model.state_dict().items()})
    plan, adapter = C.plan_for(src, config, options)
    calib = input_ids(batch=1, length=120, seed=5)[0]
    stats = one_pass_statistics(C.CompressRun(src, config, options, calib, progress=False, calibration=SEQ40))
    layers, globals_, _ = C.read_folded(src, adapter, src.keys(), plan.tied, lazy=True, keep=2)
    return plan, layers, globals_, stats, options, src, config


def _held(plan, layers, globals_, stats, stage, options, iters):
    """The whole problem in memory, solved at once (the reference)."""
    run = C.CompressRun(None, {}, options, progress=False, plan=plan, stats=stats)
    terms = [t for k in range(plan.n_segments) for t in SV.segment_terms(run, layers, globals_, stage, k)]
    res = solve_segment(
        terms,
        torch.eye(plan.hidden, dtype=torch.float64),
        replace(options.schedule(stage), iters=iters),
    )
    kept = SV.Kept()
    kept.keep(terms, res.Q)
    return res.Q, kept.factors, res.trace


@pytest.mark.parametrize("structure,stage", [("kron", "f"), ("gs", "w"), ("kron", "w"), ("lowrank", "w")])
def test_streamed_global_solve_equals_the_whole_problem_solved_at_once(structure, stage):
    plan, layers, globals_, stats, options, src, config = _setup(structure, stage, "float64")
    # low rank: no rotation lowers its error; solve() projects once at Q (no alternation)
    iters = 0 if structure == "lowrank" else options.f_iters if stage == "f" else options.w_iters
    Q_ref, f_ref, trace_ref = _held(plan, layers, globals_, stats, stage, options, iters)
    reads = []
    get = src.get
    src.get = lambda names: (reads.extend(names), get(names))[1]
    segments_done = []
    kept = SV.Kept(on_segment=lambda k, Qs, f: segments_done.append(k))
    Qs, traces = SV._solve_stage(
        C.CompressRun(src, config, options, progress=False, plan=plan, stats=stats, calibration=SEQ40),
        layers,
        globals_,
        stage,
        [torch.eye(plan.hidden, dtype=torch.float64)] * plan.n_segments,
        kept,
    )
    factors = kept.factors
    assert segments_done == list(range(plan.n_segments))  # each segment handed on once final
    assert torch.allclose(Qs[0], Q_ref, atol=1e-9, rtol=0)
    if iters:
        assert not torch.allclose(Q_ref, torch.eye(plan.hidden, dtype=torch.float64), atol=1e-3)  # it did rotate
    assert set(factors) == set(f_ref)
    for name, f in f_ref.items():
        for a, b in zip(factors[name], f):
            a = a.materialise() if hasattr(a, "materialise") else a
            b = b.materialise() if hasattr(b, "materialise") else b
            assert torch.allclose(a, b, atol=1e-8, rtol=1e-8), name
    trace = traces["global"]
    assert len(trace) == len(trace_ref)
    assert trace[-1] == pytest.approx(trace_ref[-1], rel=1e-10)
    # every sweep read each compressed matrix from the checkpoint again (nothing held between sweeps):
    # at least once per alternation (stage W's over-relaxation adds trial sweeps), and the final sweep
    alternations = (len(trace) - 1) // 2
    assert reads.count("model.layers.1.mlp.up_proj.weight") >= alternations + 1


def test_streamed_global_solve_in_float32_iterations_matches_closely():
    """The default: iterations in float32, the final projection in float64 (the warm starts of the
    weighted Kronecker fits go through the scratch files and come back bit for bit)."""
    plan, layers, globals_, stats, options, src, config = _setup("kron", "w", "float32")
    Q_ref, f_ref, trace_ref = _held(plan, layers, globals_, stats, "w", options, options.w_iters)
    Qs, traces = SV._solve_stage(
        C.CompressRun(src, config, options, progress=False, plan=plan, stats=stats, calibration=SEQ40),
        layers,
        globals_,
        "w",
        [torch.eye(plan.hidden, dtype=torch.float64)] * plan.n_segments,
        SV.Kept(),
    )
    assert float((Qs[0] - Q_ref).abs().max()) < 1e-4
    assert traces["global"][-1] == pytest.approx(trace_ref[-1], rel=1e-4)


def test_global_stage_f_before_stage_w_keeps_no_factors(monkeypatch):
    """Stage F's factors are replaced by stage W's: only its rotation is kept (no last sweep)."""
    plan, layers, globals_, stats, options, src, config = _setup("gs", "w", "float64")
    kept = []
    real = SV.Kept.keep
    monkeypatch.setattr(
        SV.Kept, "keep", lambda self, terms, Q: (kept.extend(t.name for t in terms), real(self, terms, Q))
    )
    run = C.CompressRun(src, config, options, progress=False, plan=plan, stats=stats, calibration=SEQ40)
    res = SV.solve(run, layers, globals_)
    compressed = [m.name for m in plan.matrices if m.compressed]
    assert sorted(kept) == sorted(compressed)  # once each: stage W's, none of stage F's
    assert set(res.factors) == set(compressed)


# ----------------------------------------------------------------------------- one-pass statistics on demand
def test_one_pass_statistics_on_demand_give_the_same_model_and_hold_one_layers_moments(monkeypatch):
    """Stage W with one rotation per segment (not sequential) measures each layer's moments when the
    solver first reads them and drops them once their segment is solved: the output is that of the
    statistics taken all up front, bit for bit, and at most one layer's FFN input moments are held."""
    from hf_symmetry.conversion.compress import moments as MO
    from hf_symmetry.conversion.compress.pipeline import compress_tensors

    model = tiny_model("llama", num_hidden_layers=3)
    config = model.config.to_dict()
    options = C.CompressOptions(
        structure="kron",
        ratio=0.3,
        stage="w",
        f_iters=2,
        w_iters=2,
        als_iters=2,
        wopp_iters=5,
        ratio_slack=1.0,
    )
    assert options.statistics_on_demand
    assert not C.CompressOptions(structure="kron", q_mode="global").statistics_on_demand
    assert not C.CompressOptions(structure="kron", sequential=True).statistics_on_demand
    src = C.DictSource({k: v.detach() for k, v in model.state_dict().items()})
    calib = input_ids(batch=1, length=120, seed=5)[0]
    eager = one_pass_statistics(C.CompressRun(src, config, options, calib, progress=False, calibration=SEQ40))
    assert isinstance(eager.mlp_hidden, list)
    ref, _, _ = compress_tensors(
        C.CompressRun(src, config, options, calib_ids=calib, stats=eager, progress=False, calibration=SEQ40)
    )

    held = []
    real = MO.collect_statistics

    def watched(*a, **k):
        stats = real(*a, **k)
        assert k["on_demand"]
        release = stats.release_segment

        def release_segment(j):
            held.append(sum(x is not None for x in stats.mlp_hidden.items))
            release(j)

        stats.release_segment = release_segment
        return stats

    monkeypatch.setattr(MO, "collect_statistics", watched)
    out, _, report = compress_tensors(
        C.CompressRun(src, config, options, calib_ids=calib, progress=False, calibration=SEQ40)
    )
    assert len(held) == 2 * model.config.num_hidden_layers + 1  # every segment released once solved
    assert max(held) == 1  # one layer's FFN moments at a time
    assert report.calibration_tokens == eager.tokens
    assert set(out) == set(ref)
    for k in ref:
        assert torch.equal(out[k], ref[k]), k
