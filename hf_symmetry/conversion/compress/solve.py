"""Step 3, rotations and factors.

Stage ``none`` (plain projection, Q = I), stage ``f`` (alternating Frobenius projection / Procrustes per
segment), stage ``w`` (from stage F's Q: weighted projections and weighted Procrustes with the
calibration covariances), see :mod:`...solvers.segments`; either one Q per residual segment (skip
connections carry ``Q_prevᵀ Q_next``) or one global Q. SliceGPT: PCA of the stream per segment (one pass
or sequential) or globally, then slicing. Which path runs is :attr:`CompressOptions.solver`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ...solvers import structures as st
from ...solvers.segments import Term, balance, solve_segment
from . import targets
from .global_q import GlobalSolve
from .moments import CalibrationInput, CalibrationStats, sequential_weighted
from .options import CompressOptions
from .pca import pca_rotations
from .plan import MatrixPlan, Plan
from .tall import TallTerm

Tensors = dict[str, torch.Tensor]


def _matrix_of(m: MatrixPlan, layers: list[Tensors], globals_: Tensors) -> torch.Tensor:
    if m.canon == "embed":
        return globals_["embed.weight"]
    if m.canon == "lm_head":
        return globals_["lm_head.weight"]
    W = layers[m.layer][f"{m.canon}.weight"]
    return W if m.role == "reader" else W.T


def _terms(
    plan: Plan,
    layers,
    globals_,
    stats: CalibrationStats | None,
    stage: str,
    options: CompressOptions,
    only: int | None = None,
    device=None,
    row_dtype=None,
    consume: bool = False,
) -> list[tuple[list[Term], list[Term]]]:
    """Per segment: (terms, readers) of the compressed matrices, weighted for ``stage`` (only segment
    ``only`` filled when given: sequential calibration has the statistics of one segment at a time),
    balanced (:func:`...solvers.segments.balance`); the terms are those of :func:`_each_term`."""
    segments: list[tuple[list[Term], list[Term]]] = [([], []) for _ in range(2 * plan.n_layers + 1)]
    for m, term in _each_term(plan, layers, globals_, stats, stage, options, only, device, row_dtype, consume):
        terms, readers = segments[m.segment]
        terms.append(term)
        if m.role == "reader":
            readers.append(term)
    for terms, readers in segments:
        if stage != "none":
            balance(terms, readers)
    return segments


def _reducible(m: MatrixPlan) -> bool:
    """Whether ``m``'s term is solved on its Gram root (:meth:`Term.reducible`; shape and structure only)."""
    return Term(m.name, torch.empty(m.structure.shape, device="meta"), m.structure).reducible()


def _each_term(
    plan: Plan,
    layers,
    globals_,
    stats: CalibrationStats | None,
    stage: str,
    options: CompressOptions,
    only: int | None = None,
    device=None,
    row_dtype=None,
    consume: bool = False,
):
    """``(MatrixPlan, Term)`` of each compressed matrix (of segment ``only`` when given), weighted for
    ``stage``, made one at a time when asked for (unbalanced: λ = 1). A low-rank, GS (one row block) or
    Kronecker (``A_s`` of one row) embedding or untied head enters as its reduced term (:class:`TallTerm`, read a block
    of rows at a time; its row factor is
    lifted into ``row_dtype``, default float64). ``consume``: the writers' statistics are dropped from
    ``stats`` once their terms are built (see :func:`.targets.matched_target`)."""
    token_gram = None if stats is None else st.Gram(diag=(stats.token_counts + 1.0).to(device))  # (√(D+1))²
    weighted = stage == "w" and stats is not None and stats.normed is not None
    matched = weighted and stats.normed_cross is not None
    reader_cov: dict[int, torch.Tensor] = {}  # one tensor per segment, shared by its readers
    reader_maps: dict[int, torch.Tensor] = {}  # ... and its matched targets' map A

    def column_weight(segment: int) -> torch.Tensor:
        if segment not in reader_cov:
            if consume:  # the segment's readers' weight and map made at once, from its moments in place
                reader_cov[segment], A = targets.consume_reader_moments(
                    segment, stats, options.damping, device, matched
                )
                if A is not None:
                    reader_maps.clear()
                    reader_maps[segment] = A
            else:
                reader_cov[segment] = targets.damped(stats.normed[segment].to(device), options.damping)
        return reader_cov[segment]

    def reader_map(segment: int) -> torch.Tensor:
        if consume:
            column_weight(segment)
        if segment not in reader_maps:
            reader_maps.clear()  # segments come in order: one A held at a time
            reader_maps[segment] = targets.segment_reader_map(segment, stats, options.damping, device)
        return reader_maps[segment]

    for m in plan.matrices:
        if not m.compressed or (only is not None and m.segment != only):
            continue
        # embedding (stages F, W) and head (stage F): weighted by the token counts on their rows
        token_rows = (
            m.canon in ("embed", "lm_head")
            and stage in ("f", "w")
            and token_gram is not None
            and (m.canon == "embed" or stage == "f")
        )
        if TallTerm.applies(m):  # weighted as below; a head's matched target a block of rows at a time
            head = m.canon == "lm_head"
            col = right = None
            if weighted and head:
                col = column_weight(m.segment)
                if matched:
                    right = reader_map(m.segment)
            yield (
                m,
                TallTerm(m, globals_, token_gram.diag if token_rows else None, device, row_dtype, right, col).take(),
            )
            continue
        row_metric = None  # a writer's damped input moments: its row weight (and matched_target's system)
        rows_gram = None  # ... or only Mᵀ G M of them (a reducible writer, its statistics consumed)
        if matched and m.canon != "embed":
            if consume and m.role == "writer" and _reducible(m):  # M handed over: freed once used
                M, rows_gram = targets.matched_target(
                    m, _matrix_of(m, layers, globals_).to(device), stats, options.damping, consume=True, rows_gram=True
                )
            else:
                M = _matrix_of(m, layers, globals_).to(device)
                M, row_metric = targets.matched_target(
                    m,
                    M,
                    stats,
                    options.damping,
                    consume=consume,
                    reader_map=reader_map(m.segment) if m.role == "reader" else None,
                )
        else:
            M = _matrix_of(m, layers, globals_).to(device)
            if weighted and m.canon in ("o", "down"):
                key = "attn_out" if m.canon == "o" else "mlp_hidden"
                G = getattr(stats, key)[m.layer]
                if consume:
                    getattr(stats, key)[m.layer] = None
                row_metric = targets.damped(G.to(device), options.damping, in_place=consume)
                del G
        term = Term(m.name, M, m.structure)
        del M
        if token_rows:
            term.row_gram = token_gram
        if weighted:
            if m.role == "reader" and term.row_gram is None:
                term.col_gram = column_weight(m.segment)
            elif rows_gram is not None:
                term.set_rows_gram(rows_gram)
            elif row_metric is not None:
                term.row_gram = st.Gram(matrix=row_metric)
                del row_metric
                if consume and term.reducible():  # its solve needs Mᵀ G M only: the [k, k] G goes now
                    term.release_row_weight()
        rows_gram = row_metric = None
        yield m, term
        del term


@dataclass
class SolveResult:
    Qs: list[torch.Tensor | None]  # one per segment (the same tensor in global mode); None
    #                                              where an ``on_segment`` consumer released it once used
    factors: dict[str, st.Factors]  # per compressed matrix, M orientation
    traces: dict[str, list[float]]  # objective traces per solved problem
    relative_errors: dict[str, float]
    stats: CalibrationStats | None = None  # sequential calibration: the statistics it measured


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


def _solve_stage(
    plan,
    layers,
    globals_,
    stats,
    stage,
    options,
    Q_init,
    iters,
    desc,
    progress,
    factors,
    rel,
    device=None,
    on_segment=None,
    row_dtype=None,
    keep_factors=True,
    scratch=None,
):
    """One stage (F, W, or the plain/weighted projection) on one pass's statistics. One global Q solves
    all segments' terms together, streaming them from the checkpoint on each alternation
    (:class:`.global_q.GlobalSolve`); one Q per segment builds, solves and drops the terms segment by
    segment (the layers are read as the segments need them). Both keep only factors and errors, and
    call ``on_segment(k, Qs, factors)`` once segment k's are final (see :func:`solve`).
    ``keep_factors=False``: only the rotations are wanted (stage F before stage W, which replaces
    every factor): no factors are kept and ``on_segment`` is not called. ``scratch``: the folder under
    which one global Q spills its warm starts (default: the system's temporary folder)."""
    traces = {}
    dtype = getattr(torch, options.solver_dtype)
    if options.q_mode == "global":
        Qs: list = []

        def each(k: int):
            return _each_term(plan, layers, globals_, stats, stage, options, only=k, device=device, row_dtype=row_dtype)

        def keep(t: Term, Q: torch.Tensor) -> None:
            _keep([t], Q, factors, rel, row_dtype)

        def done(k: int, Q: torch.Tensor) -> None:
            if not Qs:
                Qs.extend([Q.cpu()] * plan.n_segments)
            if on_segment is not None:
                on_segment(k, Qs, factors)

        Q, trace = GlobalSolve(each, plan.n_segments, stage, options, plan.hidden, device).solve(
            Q_init[0],
            iters,
            progress,
            desc=f"{desc} (global)",
            final=keep_factors,
            keep=keep,
            on_segment=done,
            scratch=scratch,
        )
        if not Qs:
            Qs.extend([Q.cpu()] * plan.n_segments)
        traces["global"] = trace
        return Qs, traces
    Qs = []
    # statistics measured on demand are this solve's own: consumed in place (no copy of a writer's moments)
    owned = stage == "w" and hasattr(stats, "release_segment")
    for k in tqdm(range(plan.n_segments), desc=desc, unit="segment", disable=not progress):
        terms, _ = _terms(
            plan, layers, globals_, stats, stage, options, only=k, device=device, row_dtype=row_dtype, consume=owned
        )[k]
        res = solve_segment(
            terms,
            Q_init[k],
            iters,
            options.als_iters,
            options.wopp_iters,
            dtype=dtype,
            keep_weights=False,
            **options.stopping(stage),
        )
        Qs.append(_kept_rotation(res.Q, Q_init[k], iters))
        traces[f"segment{k}"] = res.trace
        if keep_factors:
            _keep(terms, res.Q, factors, rel, row_dtype)
        del terms, res
        if on_segment is not None and keep_factors:
            on_segment(k, Qs, factors)
        if owned:
            stats.release_segment(k)  # (statistics measured on demand: one layer's held)
    return Qs, traces


def _each_at_fixed_rotation(
    each, Q: torch.Tensor, options: CompressOptions, dtype, factors: dict, rel: dict, row_dtype, approximation
) -> tuple[list, float]:
    """One segment's terms at a fixed rotation ``Q`` (no alternation: each term's factors are its own
    projection, whatever the others'): each term from the iterator ``each`` of ``(MatrixPlan, Term)`` is
    solved (on its Gram root where it is reducible), its factors kept (:func:`_keep`) and its
    ``approximation(term)`` made, and then dropped before the next is built, so one term's matrices
    and working set are held at a time instead of the segment's. Returns the ``(name, approximation)``
    pairs and the segment's objective at Q, balanced as :func:`_terms` balances it: the writers' errors
    plus λ times the readers', ``λ = Σ`` writers' energies ``/ Σ`` readers' (compressed terms only)."""
    approximations = []
    errors = {"writer": 0.0, "reader": 0.0}
    energies = {"writer": 0.0, "reader": 0.0}
    compressed = {"writer": 0, "reader": 0}
    for m, t in each:
        if not t.is_dense:
            energies[m.role] += t.energy()
            compressed[m.role] += 1
        res = solve_segment([t], Q, 0, options.als_iters, options.wopp_iters, dtype=dtype, keep_weights=False)
        errors[m.role] += res.trace[-1]
        _keep([t], Q, factors, rel, row_dtype)
        approximations.append((t.name, approximation(t)))
        del t, res
    lam = 1.0
    if compressed["writer"] and compressed["reader"]:
        lam = energies["writer"] / max(energies["reader"], 1e-300)
    return approximations, errors["writer"] + lam * errors["reader"]


def _solve_sequential(
    plan,
    layers,
    globals_,
    stats,
    options,
    Q_init,
    calib: CalibrationInput,
    progress,
    factors,
    rel,
    device=None,
    keep_stats=True,
    on_segment=None,
    row_dtype=None,
):
    """Stage W with sequential calibration (SliceGPT/GPTQ-style): segment k is weighted by the
    statistics of the model whose segments before k are already compressed, measured on the
    calibration engine (:func:`.moments.sequential_weighted`), and its matrices are replaced there
    by their approximations once solved. ``match_original``: each matrix then targets the original
    model's outputs and writers the original residual stream (:func:`.targets.matched_target`), instead of the
    matrix's own outputs on X̂."""
    iters = options.w_iters if options.rotates else 0
    dtype = getattr(torch, options.solver_dtype)
    ms = plan.by_name()
    Qs, traces = [None] * plan.n_segments, {}
    bar = tqdm(total=plan.n_segments, desc="stage W (sequential)", unit="segment", disable=not progress)

    def approximation(t: Term, Q: torch.Tensor):
        """What replaces ``t``'s matrix in the calibration from now on (see :func:`sequential_weighted`):
        its approximation in the original basis, or a function making it when it is applied."""
        if hasattr(t, "tall"):
            return t.tall.rows(Q)
        Q = Q.to(t.factors[0].device)
        if ms[t.name].canon == "embed":
            return t.structure.dense(t.factors) @ Q.T
        return lambda s=t.structure, f=t.factors: s.dense(f) @ Q.T

    def segment(k: int, seq: CalibrationStats):
        each = _each_term(
            plan,
            layers,
            globals_,
            seq,
            "w",
            options,
            only=k,
            device=device,
            row_dtype=row_dtype,
            consume=not keep_stats,
        )
        if iters == 0:  # Q fixed: the terms do not interact, each is solved and dropped in turn
            approximations, J = _each_at_fixed_rotation(
                each, Q_init[k], options, dtype, factors, rel, row_dtype, lambda t: approximation(t, Q_init[k])
            )
            Qs[k] = Q_init[k]
            traces[f"segment{k}"] = [J]
        else:
            terms, readers = [], []
            for m, t in each:
                terms.append(t)
                if m.role == "reader":
                    readers.append(t)
            balance(terms, readers)
            del readers
            res = solve_segment(
                terms,
                Q_init[k],
                iters,
                options.als_iters,
                options.wopp_iters,
                dtype=dtype,
                keep_weights=False,
                **options.stopping(),
            )
            Qs[k] = _kept_rotation(res.Q, Q_init[k], iters)
            traces[f"segment{k}"] = res.trace
            _keep(terms, res.Q, factors, rel, row_dtype)
            approximations = [(t.name, approximation(t, res.Q)) for t in terms]
            del terms, res
        bar.update(1)
        # nothing runs after the head; the others' approximations are made one at a time when applied
        approximations = [(ms[name], a) for name, a in approximations if ms[name].canon != "lm_head"]
        if on_segment is not None:
            on_segment(k, Qs, factors)
        return approximations

    try:
        seq = sequential_weighted(
            calib, stats.token_counts, options.match_original, segment, progress, keep=keep_stats, folded=layers
        )
    finally:
        bar.close()
    return Qs, traces, seq


def solve(
    plan: Plan,
    layers: list[Tensors],
    globals_: Tensors,
    stats: CalibrationStats | None,
    options: CompressOptions,
    progress: bool = True,
    rotations: list[torch.Tensor] | None = None,
    calib: CalibrationInput | None = None,
    device: torch.device | str | None = None,
    keep_stats: bool = True,
    on_segment=None,
    row_dtype: torch.dtype | None = None,
    scratch=None,
) -> SolveResult:
    """The rotations and structured factors of ``options.stage`` (or SliceGPT's PCA rotations).
    ``rotations`` (one per segment) replaces the identity as the starting point — with stage ``none``
    the factors are simply projected at these rotations. ``calib``: what the sequential calibration of
    ``options.sequential`` runs on (checkpoint, token ids, device). ``device``: where the solvers' linear
    algebra runs (the matrices and statistics of one segment are moved there; results come back to the
    CPU). ``keep_stats=False``: sequential calibration drops each segment's statistics once it is solved
    (``SolveResult.stats`` then holds none). ``on_segment(k, Qs, factors)``: called by the paths that
    finish the segments one after the other (one rotation per segment, or none) once segment k's
    rotation ``Qs[k]`` and factors are final, with those of every earlier segment (e.g.
    :meth:`.assemble.Assembler.segment_done`, which writes what they complete and drops its factors from
    ``factors``, the dict that becomes ``SolveResult.factors``). ``row_dtype``: the dtype the
    solved factors are kept in, the vocabulary-sized row factor of a low-rank embedding included (the
    output's: they are rounded to it when written anyway; default float64, the solver's). ``scratch``:
    where one global Q spills its warm starts (:class:`.global_q.GlobalSolve`; default: the system's
    temporary folder)."""
    n_seg = plan.n_segments
    if options.sequential and not options.slicing and calib is None:
        raise ValueError("sequential calibration needs its calibration input (checkpoint and token ids)")
    path = options.solver
    if path == "pca":
        return SolveResult(pca_rotations(stats, n_seg, options.q_mode), {}, {}, {})
    if path == "pca-sequential":  # rotations measured by pca.sequential_stream_pca
        if rotations is None:
            raise ValueError("sequential SliceGPT takes its rotations from sequential_stream_pca")
        return SolveResult(list(rotations), {}, {}, {}, stats)
    eye = torch.eye(plan.hidden, dtype=torch.float64)
    Q0 = list(rotations) if rotations is not None else [eye] * n_seg
    seq = None
    factors, rel = {}, {}
    args = (plan, layers, globals_, stats)
    out = (factors, rel, device)
    more = {"on_segment": on_segment, "row_dtype": row_dtype, "scratch": scratch}
    if path == "projection":
        # low rank: no rotation can lower the error, the stage only picks the weighting
        Qs, traces = _solve_stage(*args, options.stage, options, Q0, 0, "projection", progress, *out, **more)
    elif not options.rotates:  # low rank, sequential: one segment after the other, Q = I
        Qs, traces, seq = _solve_sequential(
            *args, options, Q0, calib, progress, *out, keep_stats, on_segment=on_segment, row_dtype=row_dtype
        )
    else:
        last_f = options.stage == "f"
        # stage F's factors only where they are the result (stage W replaces every one of them)
        Qs, traces = _solve_stage(
            *args,
            "f",
            options,
            Q0,
            options.f_iters,
            "stage F",
            progress,
            *out,
            on_segment=on_segment if last_f else None,
            row_dtype=row_dtype,
            keep_factors=last_f,
            scratch=scratch,
        )
        if options.stage == "w":
            if path == "sequential":
                Qs, w_traces, seq = _solve_sequential(
                    *args, options, Qs, calib, progress, *out, keep_stats, on_segment=on_segment, row_dtype=row_dtype
                )
            else:
                Qs, w_traces = _solve_stage(*args, "w", options, Qs, options.w_iters, "stage W", progress, *out, **more)
            traces = {**{f"F/{k}": v for k, v in traces.items()}, **{f"W/{k}": v for k, v in w_traces.items()}}
    return SolveResult(Qs, factors, traces, rel, seq)
