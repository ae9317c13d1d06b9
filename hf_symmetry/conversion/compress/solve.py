"""Step 3, rotations and factors: stage ``none`` (plain projection at Q), ``f`` (alternating projection /
Procrustes) and ``w`` (the same from stage F's Q, weighted by the calibration covariances), one Q per residual
segment (skip connections carry ``Q_prevᵀ Q_next``) or one global Q; SliceGPT: PCA of the stream. Which path
runs is :attr:`CompressOptions.solver`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from tqdm.auto import tqdm

from ...solvers import structures as st
from ...solvers.segments import Alternation, Term, solve_segment
from .global_q import GlobalSolve
from .moments import CalibrationStats, sequential_weighted
from .pca import pca_rotations
from .plan import MatrixPlan
from .routes import CompressRun
from .terms import each_term, segment_terms

Tensors = dict[str, torch.Tensor]


class Kept:
    """A solve's results: each compressed matrix's ``factors`` (M orientation, on the CPU, in ``row_dtype``
    where given) and ``relative_errors``, the rotations ``Qs`` (``None`` where ``on_segment`` released one),
    the objective ``traces`` and the ``stats`` sequential calibration measured (each segment's dropped once
    solved unless ``keep_stats``). ``on_segment(k, Qs, factors)`` is called once segments ``≤ k`` are final."""

    def __init__(
        self, row_dtype: torch.dtype | None = None, on_segment: Callable | None = None, keep_stats: bool = True
    ):
        self.row_dtype, self.keep_stats = row_dtype, keep_stats
        self.on_segment = on_segment or (lambda k, Qs, factors: None)
        self.factors: dict[str, st.Factors] = {}
        self.relative_errors: dict[str, float] = {}
        self.Qs: list[torch.Tensor | None] = []
        self.traces: dict[str, list[float]] = {}
        self.stats: CalibrationStats | None = None

    def keep(self, terms: list[Term], Q: torch.Tensor) -> None:
        """Record the solved factors and relative errors of ``terms`` at ``Q``."""
        for t in terms:
            if hasattr(t, "tall"):
                self.factors[t.name], self.relative_errors[t.name] = t.tall.lift(t, Q)
                continue
            self.factors[t.name] = tuple(f.to(device="cpu", dtype=self.row_dtype or f.dtype) for f in t.factors)
            D = t.structure.dense(t.factors)
            if any(D.data_ptr() == f.data_ptr() for f in t.factors):
                D = D.clone()  # (a dense term's product is its factor)
            D.addmm_(t.M, Q.to(t.M), beta=-1)  # M Q − Ŵ with one matrix-sized temporary
            norm = torch.linalg.matrix_norm(t.M).clamp_min(1e-300)
            self.relative_errors[t.name] = float(torch.linalg.matrix_norm(D) / norm)
            del D


def _solve_stage(run: CompressRun, layers, globals_: Tensors, stage: str, Q_init: list, kept: Kept, final=True):
    """Stage ``stage`` on one pass's statistics from the rotations ``Q_init``, segment by segment or globally:
    (Qs, traces). ``final=False``: only the rotations are wanted (stage F's before stage W)."""
    options, n = run.options, run.plan.n_segments
    schedule = options.schedule(stage)
    desc = "projection" if options.solver == "projection" else f"stage {stage.upper()}"
    if options.q_mode == "global":
        terms = partial(segment_terms, run, layers, globals_, stage, row_dtype=kept.row_dtype)
        solver = GlobalSolve(terms, n, schedule, run.plan.hidden, run.device)
        Q, trace = solver.solve(Q_init[0], run.progress, f"{desc} (global)", kept, run.folder, final)
        return [Q.cpu()] * n, {"global": trace}
    Qs, traces = [], {}
    # statistics measured on demand are this solve's own: consumed in place (no copy of a writer's moments)
    owned = stage == "w" and hasattr(run.stats, "release_segment")
    for k in tqdm(range(n), desc=desc, unit="segment", disable=not run.progress):
        terms, Q0 = segment_terms(run, layers, globals_, stage, k, kept.row_dtype, consume=owned), Q_init[k]
        res = solve_segment(terms, Q0, schedule)
        # without iterations Q0 itself (shared, not a d × d copy per segment)
        reuse = schedule.iters == 0 and Q0.dtype == torch.float64 and Q0.device.type == "cpu"
        Qs.append(Q0 if reuse else res.Q.cpu())
        traces[f"segment{k}"] = res.trace
        if final:
            kept.keep(terms, res.Q)
        del terms, res
        if final:
            kept.on_segment(k, Qs, kept.factors)
        if owned:
            run.stats.release_segment(k)  # (one layer's held)
    return Qs, traces


def _approximation(t: Term, Q: torch.Tensor, m: MatrixPlan):
    """What replaces ``t``'s matrix in the sequential calibration from now on: its approximation in the
    original basis, or a function making it when it is applied."""
    if hasattr(t, "tall"):
        return t.tall.rows(t, Q)
    Q = Q.to(t.factors[0].device)
    if m.canon == "embed":
        return t.structure.dense(t.factors) @ Q.T
    return lambda s=t.structure, f=t.factors: s.dense(f) @ Q.T


def _each_at_fixed_rotation(each, Q: torch.Tensor, schedule: Alternation, kept: Kept):
    """A segment at a fixed rotation ``Q``: the terms do not interact, so each of ``each`` is solved, kept, its
    approximation made and dropped before the next is built. Returns the ``(MatrixPlan, approximation)`` pairs
    and the objective at Q, balanced: the writers' errors plus λ times the readers', ``λ = Σ`` writers' energies
    ``/ Σ`` readers' (compressed terms only)."""
    approximations, errors, energies, compressed = [], Counter(), Counter(), Counter()
    for m, t in each:
        if not t.is_dense:
            energies[m.role] += t.energy()
            compressed[m.role] += 1
        res = solve_segment([t], Q, schedule)
        errors[m.role] += res.trace[-1]
        kept.keep([t], Q)
        approximations.append((m, _approximation(t, Q, m)))
        del t, res
    lam = 1.0
    if compressed["writer"] and compressed["reader"]:
        lam = energies["writer"] / max(energies["reader"], 1e-300)
    return approximations, errors["writer"] + lam * errors["reader"]


def _solve_sequential(run: CompressRun, layers: list[Tensors], globals_: Tensors, Q_init: list, kept: Kept):
    """Stage W with sequential calibration: segment k is weighted by the statistics of the model whose segments
    before k are compressed, and its matrices are replaced there by their approximations once solved."""
    plan, options = run.plan, run.options
    schedule = options.schedule("w")
    ms = plan.by_name()
    Qs, traces = [None] * plan.n_segments, {}
    bar = tqdm(total=plan.n_segments, desc="stage W (sequential)", unit="segment", disable=not run.progress)

    def segment(k: int, seq: CalibrationStats):
        seq_run, consume = replace(run, stats=seq), not kept.keep_stats
        if schedule.iters == 0:  # Q fixed: each term solved and dropped in turn
            each = each_term(seq_run, layers, globals_, "w", k, kept.row_dtype, consume)
            approximations, J = _each_at_fixed_rotation(each, Q_init[k], schedule, kept)
            Qs[k], traces[f"segment{k}"] = Q_init[k], [J]
        else:
            terms = segment_terms(seq_run, layers, globals_, "w", k, kept.row_dtype, consume)
            res = solve_segment(terms, Q_init[k], schedule)
            kept.keep(terms, res.Q)
            Qs[k], traces[f"segment{k}"] = res.Q.cpu(), res.trace
            approximations = [(ms[t.name], _approximation(t, res.Q, ms[t.name])) for t in terms]
            del terms, res
        bar.update(1)
        # nothing runs after the head; the others' approximations are made one at a time when applied
        approximations = [(m, a) for m, a in approximations if m.canon != "lm_head"]
        kept.on_segment(k, Qs, kept.factors)
        return approximations

    with bar:
        kept.stats = sequential_weighted(run, segment, keep=kept.keep_stats, folded=layers)
    return Qs, traces


def solve(run: CompressRun, layers: list[Tensors], globals_: Tensors, kept: Kept | None = None) -> Kept:
    """The rotations and factors of ``run.options.stage`` (or SliceGPT's PCA rotations) from ``run.rotations``
    (default: the identity), into ``kept``; on ``run.device``, one segment's matrices and statistics at a time."""
    kept = Kept() if kept is None else kept
    options, n = run.options, run.plan.n_segments
    if options.solver == "pca":
        kept.Qs = pca_rotations(run.stats, n, options.q_mode)
        return kept
    if options.solver == "pca-sequential":  # rotations measured by pca.sequential_stream_pca
        if run.rotations is None:
            raise ValueError("sequential SliceGPT takes its rotations from sequential_stream_pca")
        kept.Qs, kept.stats = list(run.rotations), run.stats
        return kept
    Q0 = list(run.rotations) if run.rotations is not None else [torch.eye(run.plan.hidden, dtype=torch.float64)] * n
    if options.solver == "projection":  # low rank: no rotation lowers the error, the stage only picks the weighting
        kept.Qs, kept.traces = _solve_stage(run, layers, globals_, options.stage, Q0, kept)
    elif not options.rotates:  # low rank, sequential: one segment after the other, Q = I
        kept.Qs, kept.traces = _solve_sequential(run, layers, globals_, Q0, kept)
    else:
        # stage F's factors only where they are the result (stage W replaces every one of them)
        Qs, traces = _solve_stage(run, layers, globals_, "f", Q0, kept, final=options.stage == "f")
        if options.stage == "w":
            if options.solver == "sequential":
                Qs, w_traces = _solve_sequential(run, layers, globals_, Qs, kept)
            else:
                Qs, w_traces = _solve_stage(run, layers, globals_, "w", Qs, kept)
            traces = {**{f"F/{k}": v for k, v in traces.items()}, **{f"W/{k}": v for k, v in w_traces.items()}}
        kept.Qs, kept.traces = Qs, traces
    return kept
