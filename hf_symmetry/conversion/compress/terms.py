"""The solvers' terms: each compressed matrix of the plan as a :class:`...solvers.segments.Term`, weighted for its
stage by the calibration statistics: token counts on the embedding's rows, a reader's column weight, a writer's
row weight, GPTQ-style damped (:func:`damped`), and, when sequential calibration matches the original model,
its target on the partly compressed model's inputs (:func:`matched_target`: readers share one map A per
segment, writers solve their own damped system). Vocabulary-sized matrices with free rows (a low-rank, GS or
Kronecker embedding or untied head, :class:`TallTerm`) are solved on their ``d × d`` Gram and lifted into the
output a block of rows at a time, so that neither the matrix nor its row factor is ever in memory whole."""

from __future__ import annotations

import torch
from scipy.linalg.blas import dtrsm
from scipy.linalg.lapack import dpotrf

from ...checkpoint_io import RowBlocks
from ...solvers import structures as st
from ...solvers.segments import Term, balance
from .folded import global_row_blocks, global_rows
from .moments import CalibrationStats
from .plan import MatrixPlan


class TallTerm:
    """How a tall matrix's reduced term (:meth:`reduced`) is lifted back: from ``R`` and ``MᵀM`` (``plain``),
    its rows read again from the checkpoint (``right``: the matrix is ``M Aᵀ`` instead, a head's matched
    target), its row factor made in ``row_dtype`` (default float64)."""

    def __init__(self, m: MatrixPlan, globals_, device, row_dtype, right: torch.Tensor | None = None):
        self.globals, self.key, self.device = globals_, f"{m.canon}.weight", device
        self.row_dtype, self.right = row_dtype or torch.float64, right

    @classmethod
    def reduced(cls, m: MatrixPlan, globals_, weights, device, row_dtype, right=None, col_gram=None) -> Term:
        """``m``'s term as :func:`solve_segment` solves it, on its ``[d, d]`` Gram root, the Gram ``Mᵀ G M`` (row
        weights ``weights`` or none; and ``MᵀM``) accumulated block by block; ``col_gram``: the head's column
        weight. Its ``tall`` lifts it back (and does not refer to it: both are freed with the term)."""
        tall = cls(m, globals_, device, row_dtype, right)
        tall.n_rows, blocks = tall._blocks()
        P = P1 = None
        for i, B in blocks:
            GB = B if weights is None else weights[i : i + len(B)].to(device)[:, None] * B
            P = B.T @ GB if P is None else P.addmm_(B.T, GB)
            if weights is not None:
                P1 = B.T @ B if P1 is None else P1.addmm_(B.T, B)
        tall.plain = P if P1 is None else P1  # Mᵀ M (the relative error's metric)
        shell = Term(m.name, torch.empty(tall.n_rows, P.shape[0], dtype=P.dtype, device="meta"), m.structure)
        term, tall.R = shell.reduced_from_gram(P)
        term.col_gram, term.tall = col_gram, tall
        return term

    def _map(self, B: torch.Tensor) -> torch.Tensor:
        B = B.to(self.device)
        return B if self.right is None else B @ self.right.T

    def _blocks(self):
        n, blocks = global_row_blocks(self.globals, self.key)
        return n, ((i, self._map(B)) for i, B in blocks)

    @staticmethod
    def applies(m: MatrixPlan) -> bool:
        """A vocabulary-sized matrix with a free row factor (low rank, GS of one row block, Kronecker, A one row)."""
        s = m.structure
        return m.canon in ("embed", "lm_head") and s.rows_free and s.shape[0] > s.shape[1]

    def lift(self, term: Term, Q: torch.Tensor) -> tuple[st.Factors, float]:
        """The full matrix's factors (the reduced ``term``'s lifted) and its relative error ``‖M Q − Ŵ‖ / ‖M‖``
        (from ``MᵀM``; ``Ŵ = M R Ŵ'``). The vocabulary-sized row factor ``M (R f₀)`` (GS: ``[1, vocab, c]``;
        Kronecker: ``[r, vocab, n₂]``) is a :class:`...checkpoint_io.RowBlocks` in the output's dtype, made
        from the checkpoint's rows when it is written (220 MB in float32 for a 49152 × 1117 factor)."""
        s, (row, dim) = term.structure, term.structure.row_factor
        RF = s.map_rows(self.R, term.factors[row])
        shape = tuple(RF.shape[:dim]) + (self.n_rows,) + tuple(RF.shape[dim + 1 :])
        lifted = RowBlocks(shape, self.row_dtype, lambda: (s.map_rows(B, RF) for _, B in self._blocks()[1]), dim)
        factors = tuple(lifted if j == row else f.cpu() for j, f in enumerate(term.factors))
        D = Q.to(self.R) - self.R @ s.dense(term.factors)
        err = float(
            torch.sqrt((D * (self.plain @ D)).sum().clamp_min(0)) / torch.sqrt(self.plain.trace()).clamp_min(1e-300)
        )
        return factors, err

    def rows(self, term: Term, Q: torch.Tensor):
        """``idx -> Ŵ Qᵀ`` (``term`` lifted) at the rows ``idx`` (any shape): what sequential calibration runs on."""
        W_red = term.structure.dense(term.factors)  # Ŵ = M R Ŵ'

        def take(idx: torch.Tensor) -> torch.Tensor:
            uniq, inverse = torch.unique(idx.reshape(-1), return_inverse=True)
            B = self._map(global_rows(self.globals, self.key, uniq))
            out = ((B @ self.R) @ W_red) @ Q.to(B).T
            return out[inverse].reshape(*idx.shape, out.shape[-1])

        return take


def _ridge(G: torch.Tensor, damping: float) -> torch.Tensor:
    """The dampening ``δ mean(diag G)`` (a 0-d tensor)."""
    return damping * G.diagonal().mean().clamp_min(1e-12)


def damped(G: torch.Tensor, damping: float, in_place: bool = False) -> torch.Tensor:
    """``G + δ mean(diag G) I``, which keeps every weighted problem well posed: a copy, or G itself changed
    (``in_place``: the caller owns G)."""
    out = G if in_place else G.clone()
    out.diagonal().add_(_ridge(G, damping))
    return out


def _take(stats: CalibrationStats, names: tuple[str, ...], i: int, consume: bool) -> list:
    """Entry ``i`` of each of the statistics ``names``, dropped from ``stats`` when consumed."""
    taken = [getattr(stats, name)[i] for name in names]
    if consume:
        for name in names:
            getattr(stats, name)[i] = None
    return taken


def matched_target(
    m: MatrixPlan,
    M: torch.Tensor,
    stats: CalibrationStats,
    damping: float,
    consume: bool = False,
    rows_gram: bool = False,
    reader_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """On the partly compressed model's inputs X̂, the matrix that best reproduces the original outputs X M
    (readers act on the other side) and, for writers, also undoes the stream's drift D = H − Ĥ before them;
    least squares ridge-regularised towards M, so that X̂ = X gives M back. Readers: ``(X̂ᵀX̂ + δI)⁻¹ (X̂ᵀX + δI) M``
    (``reader_map``: A, where the caller made it); writers: ``(X̂ᵀX̂ + δI)⁻¹ (X̂ᵀ(X M + D) + δ M)``. Returns the
    target and a writer's row weight ``X̂ᵀX̂ + δI``. ``consume``: a writer's statistics are dropped from ``stats``
    and turned into the moments and right-hand side in place (one ``[4d, 4d]`` matrix held). ``rows_gram`` (with
    ``consume``, a reducible writer): the row weight is ``M'ᵀ (X̂ᵀX̂ + δI) M'`` (``[d, d]``, all its solve needs),
    M is freed once the right-hand side is made, and on the CPU the system is solved in place."""
    if m.role == "reader":  # M Aᵀ (a segment's readers share its moments: nothing is consumed)
        if reader_map is None:
            reader_map = reader_weights(m.segment, stats, damping, M.device, matched=True, consume=False)[1]
        return M @ reader_map.T, None
    G, T = stats.writer_moments(m.segment, consume)
    G = G.to(M.device)
    rhs = T.to(M.device, copy=not consume).add_(M, alpha=float(_ridge(G, damping)))
    del T
    Gd = damped(G, damping, in_place=consume)
    del G
    if not (consume and rows_gram):
        return torch.linalg.solve(Gd, rhs), Gd
    del M
    cpu = Gd.device.type == "cpu" and Gd.dtype == rhs.dtype == torch.float64
    if cpu and Gd.is_contiguous() and rhs.is_contiguous():
        return _cholesky_in_place(Gd, rhs, m.name)
    target = torch.linalg.solve(Gd, rhs)
    del Gd
    return target, target.T @ rhs  # M'ᵀ Gd M' = M'ᵀ rhs


def _cholesky_in_place(A: torch.Tensor, B: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, XᵀAX)`` with ``X = A⁻¹ B``, for a symmetric positive definite float64 CPU ``A`` (C-ordered,
    like ``B``), destroying both: ``A``'s memory receives its Cholesky factor L and ``B``'s becomes
    ``Z = L⁻¹B`` (``ZᵀZ = XᵀAX``) and then X (``dtrsm`` on ``Bᵀ``, ``B``'s buffer read in Fortran order)."""
    # A is symmetric: its C-ordered buffer read as a Fortran-ordered matrix is A itself
    L, info = dpotrf(A.numpy().T, lower=1, clean=0, overwrite_a=1)
    if info != 0:
        raise ValueError(
            f"{name}: the damped input moments are not positive definite (LAPACK info {info}); raise --damping"
        )
    Bt = B.numpy().T  # Bᵀ, Fortran-ordered
    Bt = dtrsm(1.0, L, Bt, side=1, lower=1, trans_a=1, overwrite_b=1)  # Bᵀ L⁻ᵀ = Zᵀ, in place
    Z = torch.from_numpy(Bt.T)
    P = Z.T @ Z
    del Z
    Bt = dtrsm(1.0, L, Bt, side=1, lower=1, trans_a=0, overwrite_b=1)  # Bᵀ L⁻ᵀ L⁻¹ = Xᵀ, in place
    return torch.from_numpy(Bt.T), P


def reader_weights(
    segment: int, stats: CalibrationStats, damping: float, device, matched: bool, consume: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Segment ``segment``'s column weight ``X̂ᵀX̂ + δI`` and (``matched``) its readers' map
    ``A = (X̂ᵀX̂ + δI)⁻¹ (X̂ᵀX + δI)`` (``[d, d]``): each reader's matched target is ``M Aᵀ``, so a
    vocabulary-sized head can be matched a block of rows at a time. ``consume``: made in place from the
    moments, which are dropped from ``stats``: two ``[d, d]`` matrices held through the segment, not four."""
    G, *cross = _take(stats, ("normed", "normed_cross") if matched else ("normed",), segment, consume)
    G = G.to(device)
    if not matched:
        return damped(G, damping, in_place=consume), None
    rhs = cross[0].to(device=device, copy=not consume)
    rhs.diagonal().add_(_ridge(G, damping))
    Gd = damped(G, damping, in_place=consume)
    return Gd, torch.linalg.solve(Gd, rhs)


Tensors = dict[str, torch.Tensor]


def _matrix_of(m: MatrixPlan, layers: list[Tensors], globals_: Tensors) -> torch.Tensor:
    if m.canon == "embed":
        return globals_["embed.weight"]
    if m.canon == "lm_head":
        return globals_["lm_head.weight"]
    W = layers[m.layer][f"{m.canon}.weight"]
    return W if m.role == "reader" else W.T


def _reducible(m: MatrixPlan) -> bool:
    """Whether ``m``'s term is solved on its Gram root (:meth:`Term.reducible`; shape and structure only)."""
    return Term(m.name, torch.empty(m.structure.shape, device="meta"), m.structure).reducible()


class _Weighting:
    """The weights of one segment's terms at one stage: its readers share one column weight (its damped
    normalised-stream moments) and, matched, one map A; a writer's row weight is its damped input moments."""

    def __init__(self, run, stage: str, segment: int, consume: bool):
        stats = run.stats
        self.stats, self.stage, self.segment, self.damping = stats, stage, segment, run.options.damping
        self.device, self.consume = run.device, consume
        # the token counts D on the rows, as the Gram (√(D+1))²
        self.token_gram = None if stats is None else st.Gram(diag=(stats.token_counts + 1.0).to(run.device))
        self.weighted = stage == "w" and stats is not None and stats.normed is not None
        self.matched = self.weighted and stats.normed_cross is not None
        self._column = self._map = None

    def column_weight(self) -> torch.Tensor:
        """The readers' column weight, made with their map A where matched (consumed: both from the segment's
        moments in place)."""
        if self._column is None:
            self._column, self._map = reader_weights(
                self.segment, self.stats, self.damping, self.device, self.matched, self.consume
            )
        return self._column

    def reader_map(self) -> torch.Tensor | None:
        """The readers' map A (``None`` unless matched)."""
        self.column_weight()
        return self._map

    def token_rows(self, m: MatrixPlan) -> bool:
        """The embedding (stages F, W) and head (stage F): weighted by the token counts on their rows."""
        if self.token_gram is None or self.stage not in ("f", "w"):
            return False
        return m.canon == "embed" or (m.canon == "lm_head" and self.stage == "f")

    def tall_term(self, m: MatrixPlan, globals_, row_dtype) -> Term:
        """A tall embedding or head, weighted as :meth:`term`; a head's matched target a block of rows at a time."""
        col = right = None
        if self.weighted and m.canon == "lm_head":
            col, right = self.column_weight(), self.reader_map()
        token = self.token_gram.diag if self.token_rows(m) else None
        return TallTerm.reduced(m, globals_, token, self.device, row_dtype, right, col)

    def term(self, m: MatrixPlan, layers, globals_) -> Term:
        """``m``'s term: its matrix (or matched target) with its row or column weight."""
        stats, device, consume = self.stats, self.device, self.consume
        row_weight, reduced = None, False  # a writer's damped input moments, or (reduced) only Mᵀ G M of them
        if self.matched and m.canon != "embed":
            reduced = consume and m.role == "writer" and _reducible(m)  # M handed over: freed once used
            M, row_weight = matched_target(
                m,
                _matrix_of(m, layers, globals_).to(device),
                stats,
                self.damping,
                consume=consume,
                rows_gram=reduced,
                reader_map=self.reader_map() if m.role == "reader" else None,
            )
        else:
            M = _matrix_of(m, layers, globals_).to(device)
            if self.weighted and m.canon in ("o", "down"):
                G, _ = stats.writer_moments(m.segment, consume)
                row_weight = damped(G.to(device), self.damping, in_place=consume)
                del G
        term = Term(m.name, M, m.structure)
        del M
        if self.token_rows(m):
            term.row_gram = self.token_gram
        if self.weighted and m.role == "reader" and term.row_gram is None:
            term.col_gram = self.column_weight()
        elif row_weight is not None and reduced:
            term.set_rows_gram(row_weight)
        elif row_weight is not None:
            term.row_gram = st.Gram(matrix=row_weight)
            del row_weight
            if consume and term.reducible():  # its solve needs Mᵀ G M only: the [k, k] G goes now
                term.release_row_weight()
        return term


def each_term(run, layers: list[Tensors], globals_: Tensors, stage: str, segment: int, row_dtype=None, consume=False):
    """``(MatrixPlan, Term)`` of each compressed matrix of ``segment``, weighted for ``stage`` by ``run.stats``, on
    ``run.device``, made one at a time when asked for (unbalanced: λ = 1). A tall matrix's row factor is lifted into
    ``row_dtype``. ``consume``: the statistics are dropped from ``run.stats`` once their terms are built."""
    weighting = _Weighting(run, stage, segment, consume)
    for m in run.plan.matrices:
        if not m.compressed or m.segment != segment:
            continue
        if TallTerm.applies(m):
            yield m, weighting.tall_term(m, globals_, row_dtype)
        else:
            yield m, weighting.term(m, layers, globals_)


def segment_terms(
    run, layers: list[Tensors], globals_: Tensors, stage: str, segment: int, row_dtype=None, consume=False
) -> list[Term]:
    """The terms of :func:`each_term`, balanced (stage ``none`` is not)."""
    pairs = list(each_term(run, layers, globals_, stage, segment, row_dtype, consume))
    terms = [t for _, t in pairs]
    if stage != "none":
        balance(terms, [t for m, t in pairs if m.role == "reader"])
    return terms
