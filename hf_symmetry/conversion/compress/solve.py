"""Step 3, rotations and factors.

Stage ``none`` (plain projection, Q = I), stage ``f`` (alternating Frobenius projection / Procrustes per
segment), stage ``w`` (from stage F's Q: weighted projections and weighted Procrustes with the
calibration covariances), see :mod:`...solvers.segments`; either one Q per residual segment (skip
connections carry ``Q_prevᵀ Q_next``) or one global Q. SliceGPT: PCA of the stream per segment (one pass
or sequential) or globally, then slicing. Which path runs is :attr:`CompressOptions.solver`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ...solvers import structures as st
from ...solvers.segments import Term, balance, solve_segment
from .global_q import GlobalSolve
from .moments import CalibrationStats, sequential_weighted
from .options import CompressOptions
from .pca import pca_rotations
from .plan import MatrixPlan
from .routes import CompressRun
from .terms import each_term, segment_terms

Tensors = dict[str, torch.Tensor]


class Kept:
    """A solve's results (see :func:`solve`): the solved ``factors`` (per compressed matrix, M orientation,
    in host memory, in ``row_dtype`` where given) and ``relative_errors``, the rotations ``Qs`` (one per
    segment, the same tensor in global mode; ``None`` where an ``on_segment`` consumer released one once
    used), the objective ``traces`` per solved problem and the ``stats`` sequential calibration measured;
    the consumer of each finished segment (``on_segment(k, Qs, factors)``), and whether sequential
    calibration keeps its statistics (``keep_stats``)."""

    def __init__(
        self, row_dtype: torch.dtype | None = None, on_segment: Callable | None = None, keep_stats: bool = True
    ):
        self.row_dtype, self.on_segment, self.keep_stats = row_dtype, on_segment, keep_stats
        self.factors: dict[str, st.Factors] = {}
        self.relative_errors: dict[str, float] = {}
        self.Qs: list[torch.Tensor | None] = []
        self.traces: dict[str, list[float]] = {}
        self.stats: CalibrationStats | None = None

    def result(self, Qs: list, traces: dict, stats: CalibrationStats | None = None) -> Kept:
        """This object, completed with the solve's rotations, traces and sequential statistics."""
        self.Qs, self.traces, self.stats = Qs, traces, stats
        return self

    def keep(self, terms: list[Term], Q: torch.Tensor) -> None:
        """Record ``terms``' factors and relative errors at ``Q`` (:func:`_keep`)."""
        _keep(terms, Q, self.factors, self.relative_errors, self.row_dtype)

    def segment_done(self, k: int, Qs: list) -> None:
        """Segment ``k``'s rotation and factors are final: hand them on."""
        if self.on_segment is not None:
            self.on_segment(k, Qs, self.factors)


def _kept_rotation(Q: torch.Tensor, Q0: torch.Tensor, iters: int) -> torch.Tensor:
    """A segment's solved rotation on the CPU: without iterations it is its start ``Q0`` (shared, not a
    ``d × d`` copy per segment)."""
    return Q0 if iters == 0 and Q0.dtype == torch.float64 and Q0.device.type == "cpu" else Q.cpu()


def _keep(terms: list[Term], Q: torch.Tensor, factors: dict, rel: dict, dtype: torch.dtype | None = None) -> None:
    """Record the solved factors (in host memory; in ``dtype``, the output's, when given: they are
    rounded to it when written anyway) and relative errors of ``terms`` (their matrices are then no
    longer needed: nothing else holds them)."""
    for t in terms:
        tall = getattr(t, "tall", None)
        if tall is not None:
            factors[t.name], rel[t.name] = tall.lift(Q)
            continue
        factors[t.name] = tuple(f.to(device="cpu", dtype=dtype or f.dtype) for f in t.factors)
        D = t.structure.dense(t.factors)
        if any(D.data_ptr() == f.data_ptr() for f in t.factors):
            D = D.clone()  # (a dense term's product is its factor)
        D.addmm_(t.M, Q.to(t.M), beta=-1)  # M Q − Ŵ with one matrix-sized temporary
        rel[t.name] = float(torch.linalg.matrix_norm(D) / torch.linalg.matrix_norm(t.M).clamp_min(1e-300))
        del D


@dataclass(frozen=True)
class Stage:
    """One stage's run: its ``name`` (``none``, ``f`` or ``w``: the weighting), its alternations at most,
    its progress label, and whether its factors are kept (``False``: only the rotations are wanted, as
    stage F's before stage W, which replaces every factor: none kept, ``on_segment`` not called)."""

    name: str
    iters: int
    desc: str
    keep_factors: bool = True


def _solve_stage(run: CompressRun, layers: list[Tensors], globals_: Tensors, stage: Stage, Q_init: list, kept: Kept):
    """One stage (F, W, or the plain/weighted projection) on one pass's statistics. One global Q solves
    all segments' terms together, streaming them from the checkpoint on each alternation
    (:class:`.global_q.GlobalSolve`, :func:`_solve_global`); one Q per segment builds, solves and drops the
    terms segment by segment (the layers are read as the segments need them). Both keep only factors
    and errors (into ``kept``), and hand segment k on once its are final (:meth:`Kept.segment_done`)."""
    options = run.options
    if options.q_mode == "global":
        return _solve_global(run, layers, globals_, stage, Q_init, kept)
    traces = {}
    dtype = getattr(torch, options.solver_dtype)
    Qs = []
    # statistics measured on demand are this solve's own: consumed in place (no copy of a writer's moments)
    stats = run.stats
    owned = stage.name == "w" and hasattr(stats, "release_segment")
    for k in tqdm(range(run.plan.n_segments), desc=stage.desc, unit="segment", disable=not run.progress):
        terms, _ = segment_terms(run, layers, globals_, stage.name, only=k, row_dtype=kept.row_dtype, consume=owned)[k]
        res = solve_segment(
            terms,
            Q_init[k],
            options.alternation(stage.iters, stage.name, dtype),
        )
        Qs.append(_kept_rotation(res.Q, Q_init[k], stage.iters))
        traces[f"segment{k}"] = res.trace
        if stage.keep_factors:
            kept.keep(terms, res.Q)
        del terms, res
        if stage.keep_factors:
            kept.segment_done(k, Qs)
        if owned:
            stats.release_segment(k)  # (statistics measured on demand: one layer's held)
    return Qs, traces


def _solve_global(run: CompressRun, layers: list[Tensors], globals_: Tensors, stage: Stage, Q_init: list, kept: Kept):
    """:func:`_solve_stage` with one global Q (:class:`.global_q.GlobalSolve`; it spills its warm starts
    under ``run.folder``, default the system's temporary folder)."""
    plan, options = run.plan, run.options
    Qs: list = []

    def each(k: int):
        return each_term(run, layers, globals_, stage.name, only=k, row_dtype=kept.row_dtype)

    def keep(t: Term, Q: torch.Tensor) -> None:
        kept.keep([t], Q)

    def done(k: int, Q: torch.Tensor) -> None:
        if not Qs:
            Qs.extend([Q.cpu()] * plan.n_segments)
        if stage.keep_factors:
            kept.segment_done(k, Qs)

    Q, trace = GlobalSolve(each, plan.n_segments, stage.name, options, plan.hidden, run.device).solve(
        Q_init[0],
        stage.iters,
        run.progress,
        desc=f"{stage.desc} (global)",
        final=stage.keep_factors,
        keep=keep,
        on_segment=done,
        scratch=run.folder,
    )
    if not Qs:
        Qs.extend([Q.cpu()] * plan.n_segments)
    return Qs, {"global": trace}


def _each_at_fixed_rotation(each, Q: torch.Tensor, options: CompressOptions, kept: Kept, approximation):
    """One segment's terms at a fixed rotation ``Q`` (no alternation: each term's factors are its own
    projection, whatever the others'): each term from the iterator ``each`` of ``(MatrixPlan, Term)`` is
    solved (on its Gram root where it is reducible), its factors kept (:meth:`Kept.keep`) and its
    ``approximation(term)`` made, and then dropped before the next is built, so one term's matrices
    and working set are held at a time instead of the segment's. Returns the ``(name, approximation)``
    pairs and the segment's objective at Q, balanced as :func:`.terms.segment_terms` balances it: the writers' errors
    plus λ times the readers', ``λ = Σ`` writers' energies ``/ Σ`` readers' (compressed terms only)."""
    approximations = []
    errors = {"writer": 0.0, "reader": 0.0}
    energies = {"writer": 0.0, "reader": 0.0}
    compressed = {"writer": 0, "reader": 0}
    dtype = getattr(torch, options.solver_dtype)
    for m, t in each:
        if not t.is_dense:
            energies[m.role] += t.energy()
            compressed[m.role] += 1
        res = solve_segment([t], Q, options.alternation(0, None, dtype))
        errors[m.role] += res.trace[-1]
        kept.keep([t], Q)
        approximations.append((t.name, approximation(t)))
        del t, res
    lam = 1.0
    if compressed["writer"] and compressed["reader"]:
        lam = energies["writer"] / max(energies["reader"], 1e-300)
    return approximations, errors["writer"] + lam * errors["reader"]


def _approximation(t: Term, Q: torch.Tensor, m: MatrixPlan):
    """What replaces ``t``'s matrix in the sequential calibration from now on (see
    :func:`.moments.sequential_weighted`): its approximation in the original basis, or a function making it
    when it is applied."""
    if hasattr(t, "tall"):
        return t.tall.rows(Q)
    Q = Q.to(t.factors[0].device)
    if m.canon == "embed":
        return t.structure.dense(t.factors) @ Q.T
    return lambda s=t.structure, f=t.factors: s.dense(f) @ Q.T


def _solve_rotating_segment(each, Q0: torch.Tensor, iters: int, options: CompressOptions, keep) -> tuple:
    """One sequential segment's terms from the iterator ``each``, balanced and solved together from ``Q0``
    (stage W's alternations); ``keep(terms, Q)`` records the factors. Returns (terms, result)."""
    terms, readers = [], []
    for m, t in each:
        terms.append(t)
        if m.role == "reader":
            readers.append(t)
    balance(terms, readers)
    del readers
    res = solve_segment(
        terms,
        Q0,
        options.alternation(iters, "w", getattr(torch, options.solver_dtype)),
    )
    keep(terms, res.Q)
    return terms, res


def _solve_sequential(run: CompressRun, layers: list[Tensors], globals_: Tensors, Q_init: list, kept: Kept):
    """Stage W with sequential calibration (SliceGPT/GPTQ-style): segment k is weighted by the
    statistics of the model whose segments before k are already compressed, measured on the
    calibration engine (:func:`.moments.sequential_weighted`, on the run's calibration ids),
    and its matrices are replaced there by their approximations once solved. ``match_original``: each
    matrix then targets the original model's outputs and writers the original residual stream
    (:func:`.targets.matched_target`), instead of the matrix's own outputs on X̂."""
    plan, options = run.plan, run.options
    iters = options.w_iters if options.rotates else 0
    ms = plan.by_name()
    Qs, traces = [None] * plan.n_segments, {}
    bar = tqdm(total=plan.n_segments, desc="stage W (sequential)", unit="segment", disable=not run.progress)

    def segment(k: int, seq: CalibrationStats):
        each = each_term(
            replace(run, stats=seq),
            layers,
            globals_,
            "w",
            only=k,
            row_dtype=kept.row_dtype,
            consume=not kept.keep_stats,
        )
        if iters == 0:  # Q fixed: the terms do not interact, each is solved and dropped in turn
            approximations, J = _each_at_fixed_rotation(
                each, Q_init[k], options, kept, lambda t: _approximation(t, Q_init[k], ms[t.name])
            )
            Qs[k] = Q_init[k]
            traces[f"segment{k}"] = [J]
        else:
            terms, res = _solve_rotating_segment(each, Q_init[k], iters, options, kept.keep)
            Qs[k] = _kept_rotation(res.Q, Q_init[k], iters)
            traces[f"segment{k}"] = res.trace
            approximations = [(t.name, _approximation(t, res.Q, ms[t.name])) for t in terms]
            del terms, res
        bar.update(1)
        # nothing runs after the head; the others' approximations are made one at a time when applied
        approximations = [(ms[name], a) for name, a in approximations if ms[name].canon != "lm_head"]
        kept.segment_done(k, Qs)
        return approximations

    try:
        seq = sequential_weighted(
            run,
            run.stats.token_counts,
            options.match_original,
            segment,
            progress=run.progress,
            keep=kept.keep_stats,
            folded=layers,
        )
    finally:
        bar.close()
    return Qs, traces, seq


def solve(run: CompressRun, layers: list[Tensors], globals_: Tensors, kept: Kept | None = None) -> Kept:
    """The rotations and structured factors of ``run.options.stage`` (or SliceGPT's PCA rotations) for
    ``run.plan``, weighted by ``run.stats``, on the norm-folded ``layers`` and ``globals_``.
    ``run.rotations`` (one per segment) replaces the identity as the starting point — with stage ``none``
    the factors are simply projected at these rotations. Sequential calibration
    (``options.sequential``) runs on the run itself (its calibration ids); the solvers' linear algebra
    runs on ``run.device`` (the matrices and statistics of one segment are moved there; results come back
    to the CPU), and one global Q spills its warm starts under ``run.folder`` (default: the system's
    temporary folder). ``kept`` (:class:`Kept`): ``keep_stats=False``: sequential calibration drops each
    segment's statistics once it is solved (``Kept.stats`` then holds none);
    ``on_segment(k, Qs, factors)``: called by the paths that finish the segments one after the other (one
    rotation per segment, or none) once segment k's rotation ``Qs[k]`` and factors are final, with those
    of every earlier segment (e.g. :meth:`.assemble.Assembler.segment_done`, which writes what they
    complete and drops its factors from ``factors``).
    ``row_dtype``: the dtype the solved factors are kept in, the vocabulary-sized row factor of a low-rank
    embedding included (the output's: they are rounded to it when written anyway; default float64, the
    solver's)."""
    kept = Kept() if kept is None else kept
    plan, stats, options, rotations = run.plan, run.stats, run.options, run.rotations
    n_seg = plan.n_segments
    path = options.solver
    if path == "pca":
        return kept.result(pca_rotations(stats, n_seg, options.q_mode), {})
    if path == "pca-sequential":  # rotations measured by pca.sequential_stream_pca
        if rotations is None:
            raise ValueError("sequential SliceGPT takes its rotations from sequential_stream_pca")
        return kept.result(list(rotations), {}, stats)
    eye = torch.eye(plan.hidden, dtype=torch.float64)
    Q0 = list(rotations) if rotations is not None else [eye] * n_seg
    seq = None
    if path == "projection":
        # low rank: no rotation can lower the error, the stage only picks the weighting
        Qs, traces = _solve_stage(run, layers, globals_, Stage(options.stage, 0, "projection"), Q0, kept)
    elif not options.rotates:  # low rank, sequential: one segment after the other, Q = I
        Qs, traces, seq = _solve_sequential(run, layers, globals_, Q0, kept)
    else:
        # stage F's factors only where they are the result (stage W replaces every one of them)
        stage_f = Stage("f", options.f_iters, "stage F", keep_factors=options.stage == "f")
        Qs, traces = _solve_stage(run, layers, globals_, stage_f, Q0, kept)
        if options.stage == "w":
            if path == "sequential":
                Qs, w_traces, seq = _solve_sequential(run, layers, globals_, Qs, kept)
            else:
                stage_w = Stage("w", options.w_iters, "stage W")
                Qs, w_traces = _solve_stage(run, layers, globals_, stage_w, Qs, kept)
            traces = {**{f"F/{k}": v for k, v in traces.items()}, **{f"W/{k}": v for k, v in w_traces.items()}}
    return kept.result(Qs, traces, seq)
