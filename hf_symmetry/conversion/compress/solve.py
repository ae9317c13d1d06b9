"""Step 3, rotations and factors: stage ``none`` (plain projection at Q), ``f`` (alternating projection /
Procrustes) and ``w`` (the same from stage F's Q, weighted by the calibration covariances), one Q per residual
segment (skip connections carry ``Q_prevᵀ Q_next``) or one global Q (:class:`GlobalSolve`); SliceGPT: PCA of
the stream. Which path runs is :attr:`CompressOptions.solver`."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ...solvers import structures as st
from ...solvers.segments import (
    Alternation,
    Summary,
    Term,
    nearest_orthogonal,
    over_relaxed,
    solve_segment,
    weighted_procrustes,
    work_term,
)
from .moments import CalibrationStats, sequential_weighted
from .pca import pca_rotations
from .plan import MatrixPlan
from .routes import CompressRun
from .terms import each_term, segment_terms


Tensor = torch.Tensor


class _Spill:
    """Warm-start factors by matrix name, one safetensors file each in a new folder under ``root``."""

    def __init__(self, root: str):
        self.folder = Path(tempfile.mkdtemp(dir=root))
        self.files: dict[str, Path] = {}

    def put(self, name: str, factors: tuple[Tensor, ...]) -> None:
        path = self.folder / f"{len(self.files)}.safetensors"
        save_file({str(i): f.detach().cpu().contiguous() for i, f in enumerate(factors)}, str(path))
        self.files[name] = path

    def get(self, name: str, dtype: torch.dtype, device) -> tuple[Tensor, ...]:
        loaded = load_file(str(self.files[name]))
        return tuple(loaded[str(i)].to(device=device, dtype=dtype) for i in range(len(loaded)))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _warm_started(t: Term) -> bool:
    """Whether ``t``'s fit starts from its previous factors (weighted Kronecker/GS: alternating least
    squares; low rank and unweighted fits are closed form)."""
    return not t.is_dense and t.structure.iterative and (t.row_gram is not None or t.col_gram is not None)


class GlobalSolve:
    """One global rotation (``--q-mode global``): ``schedule``'s alternations with one ``d × d`` Q over every
    segment's terms (``terms(k)``: segment ``k``'s, balanced), on ``device``, the weights streamed from the
    checkpoint. Between projections the alternation needs only the matrices' summaries: the rotation step
    minimises ``C − 2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)``, where C, ``K`` (``d × d``) and one ``H_p`` per segment
    with compressed readers (``Σ_p``: its column weight) are sums over the matrices. So each alternation is one
    *sweep* over the segments: each matrix is read, weighted, fitted at the current Q, added to the summaries
    and dropped. Held across sweeps: Q, the summaries and the ALS fits' warm starts, spilled to safetensors
    files: memory does not grow with depth. The last sweep fits at the final Q in float64 and keeps the
    factors. The result equals ``solve_segment`` on all the terms at once, to round-off."""

    def __init__(self, terms, n_segments: int, schedule: Alternation, d: int, device=None):
        self.terms, self.n_segments, self.schedule = terms, n_segments, schedule
        self.d, self.device = d, torch.device(device or "cpu")

    def _fit(self, t: Term, Q: Tensor, dtype: torch.dtype, warm: _Spill | None, grams: dict):
        """``t``'s working term fitted at ``Q`` in ``dtype`` (from ``warm``'s factors where the fit uses them), and
        ``R`` to lift it back (:func:`...solvers.segments.work_term`)."""
        w, R = work_term(t, keep_weights=False)
        if dtype != w.M.dtype:
            w = w.cast(dtype, grams)
        if warm is not None and _warm_started(w):
            w.factors = warm.get(w.name, dtype, w.M.device)
        w.fit(Q, self.schedule.als_iters)
        return w, R

    def sweep(self, Q: Tensor, dtype: torch.dtype, warm: _Spill | None, spill: _Spill) -> Summary:
        """Every matrix fitted at ``Q`` (the warm starts of the new fits put in ``spill``): their summary."""
        summary = Summary(torch.zeros(self.d, self.d, dtype=dtype, device=Q.device))
        for k in range(self.n_segments):
            grams: dict = {}  # the segment's column weight, cast once for its readers
            for t in self.terms(k):
                w, _ = self._fit(t, Q, dtype, warm, grams)
                del t
                summary.add(w, at=Q)
                w._summary = None
                if _warm_started(w):
                    spill.put(w.name, w.factors)
                del w
        return summary

    def finish(self, Q: Tensor, warm: _Spill | None, kept) -> float:
        """The last sweep: every matrix fitted at ``Q`` in float64, lifted, kept (``kept``: a :class:`.solve.Kept`)
        and dropped, each segment handed on once kept. Returns the objective."""
        total, Qs = 0.0, [Q.cpu()] * self.n_segments
        for k in range(self.n_segments):
            for t in self.terms(k):
                w, R = self._fit(t, Q, torch.float64, warm, {})
                if not w.is_dense:
                    total += w.weight * w.error(Q)
                w._summary = None
                if R is not None:
                    t.lift(w, R)
                kept.keep([t], Q)
                del t, w, R
            kept.on_segment(k, Qs, kept.factors)
        return total

    def solve(
        self, Q0: Tensor, progress: bool, desc: str, kept, scratch: str | Path | None, final: bool = True
    ) -> tuple[Tensor, list[float]]:
        """Alternate sweeps and rotation steps from ``Q0`` as ``solve_segment`` does, then :meth:`finish` at the
        final Q where ``final``; warm starts spilled under ``scratch`` (None: the system's temporary folder)."""
        schedule = self.schedule
        iters, dtype = schedule.iters, schedule.dtype
        fast = dtype != torch.float64 and iters > 0
        loop_dtype = dtype if fast else torch.float64
        Qw = Q0.to(device=self.device, dtype=torch.float64).clone().to(loop_dtype)
        trace: list[float] = []
        before, Q_prev, beta = None, None, 1.0
        with tempfile.TemporaryDirectory(prefix="hf_symmetry-global-q-", dir=scratch) as root:
            warm = None
            bar = tqdm(total=iters, desc=desc, unit="alternation", disable=not progress or iters == 0)
            for _ in range(iters):
                new = _Spill(root)
                S = self.sweep(Qw, loop_dtype, warm, new)
                if schedule.extrapolate and Q_prev is not None:
                    # over-relaxation, as solve_segment: kept only if its fitted objective is lower
                    Qc = over_relaxed(Qw, Q_prev, beta)
                    cand = _Spill(root)
                    Sc = self.sweep(Qc, loop_dtype, new, cand)
                    if Sc.J < S.J:
                        new.remove()
                        Qw, S, new, beta = Qc, Sc, cand, min(2 * beta, 8.0)
                    else:
                        cand.remove()
                        beta = max(beta / 2, 0.25)
                if warm is not None:
                    warm.remove()
                warm = new
                trace.append(S.J)
                if before is None:
                    before = S.J
                if S.dense_only:
                    break
                Q_prev = Qw
                Qw, _ = weighted_procrustes(S.K, S.pairs, Qw, iters=schedule.wopp_iters, tol=schedule.wopp_tol)
                trace.append(S.value(Qw))
                del S
                bar.update(1)
                bar.set_postfix(J=f"{trace[-1]:.4g}")
                if schedule.tol > 0 and before - trace[-1] <= schedule.tol * abs(before):
                    break
                before = trace[-1]
            bar.close()
            Q = nearest_orthogonal(Qw) if fast else Qw
            if final:
                trace.append(self.finish(Q, warm, kept))
        return Q, trace


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
