"""ProcrustesGPT's per-segment problem (docs/math.md §3, ProcrustesGPT §3.2, §5): find an orthogonal Q of a
residual segment and structured approximations of the matrices that touch it, minimising

    Σ_writers λ_w ‖X_w (M_w Q − Ŵ_w)‖²  +  Σ_readers λ_r ‖(M_r Q − Ŵ_r) Qᵀ Σ_r^{1/2}‖²

Every matrix is written as ``M [k, d]`` with the residual dimension on its columns, so that the
rotation always acts as ``M -> M Q`` (readers ``W [out, d]`` as they are, writers as ``Wᵀ``,
embeddings ``E [vocab, d]``). A writer's weight acts on its rows (its input covariance, or token
counts for embeddings); a reader's weight is the covariance ``Σ`` of the normalised residual stream
in the original basis, which the rotation moves to ``Qᵀ Σ Q``.

The solver alternates exact steps, each of which never increases the objective:

* projection: each matrix's structured factors, given Q (closed form for Frobenius, alternating
  least squares started from the better of the previous factors and the Frobenius projection for
  weighted terms, :mod:`.structures`);
* rotation: given the factors. Without reader covariances the objective is linear in Q, solved by
  orthogonal Procrustes (stage F). With them it is a weighted orthogonal Procrustes problem
  ``min −2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)`` (stage W), solved by Riemannian gradient descent on
  O(d) with Barzilai–Borwein steps, a QR retraction (Q stays orthogonal to round-off) and a
  non-monotone line search whose best iterate is kept — instead of the paper's Cayley + CG. The
  readers of one segment share Σ, so this step runs in the eigenbases of Σ and H, where the
  quadratic term is diagonal and a gradient costs ``O(d²)``.

Stopping rule (:func:`solve_segment`): alternations continue until one lowers the objective by less
than ``tol`` relative (or a cap is reached); ``tol = 0`` keeps a fixed count. Alternating
minimisation slows down in flat valleys; ``extrapolate`` then tries a longer step along the last
change of Q (over-relaxation, as line searches accelerate CP-ALS) and keeps it only when its fitted
objective is lower, so monotonicity is kept.

Tall matrices whose row factor is unconstrained (the embedding, FFN matrices under Kronecker) are
solved on the ``[d, d]`` square root of ``Mᵀ G M`` — the same objective for every Q — and lifted.

Also here: :func:`cayley_encode`, the storage of an orthogonal skip matrix as ``d(d+1)/2`` numbers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ..symmetry.procrustes import orthogonal_procrustes
from .linalg import Gram, factorisation_device, limit_threads, symmetric_eigh, weighted_error
from .structures import Dense, Factors, Structure

Tensor = torch.Tensor


@dataclass
class Term:
    """One matrix of a segment. ``M [k, d]`` in the original (norm-folded) basis; Q acts on its columns."""

    name: str
    M: Tensor
    structure: Structure
    row_gram: Gram | None = None  # writers, embeddings: ‖X (MQ − Ŵ)‖²
    col_gram: Tensor | None = None  # readers (stage W): ‖(MQ − Ŵ) Qᵀ Σ^{1/2}‖², Σ in the original basis
    weight: float = 1.0  # λ of the paper's balancing
    factors: Factors | None = None

    def __post_init__(self):
        if self.row_gram is not None and self.col_gram is not None:
            raise ValueError(f"{self.name}: a term is weighted on its rows or on its columns, not both")
        self._summary: tuple | None = None
        self._energy: float | None = None
        self._weight_released = False
        self._rows_gram: Tensor | None = None  # Mᵀ G M once G is released (:meth:`release_row_weight`)

    @property
    def is_dense(self) -> bool:
        return isinstance(self.structure, Dense)

    def release_row_weight(self) -> None:
        """Keep of the row weight G only what a reducible term's solve needs, ``Mᵀ G M`` (``[d, d]``),
        and drop G itself (a writer's ``[4d, 4d]`` input moments): :meth:`reduced` and :meth:`energy`
        use the kept product; the full term's own error can no longer be evaluated (its reduced term's
        is the same). No-op without a row weight."""
        if self.row_gram is None:
            return
        self.set_rows_gram(self.M.T @ self.row_gram.apply(self.M))

    def set_rows_gram(self, P: Tensor) -> None:
        """Weight the rows by a G of which only ``P = Mᵀ G M`` is given (G itself is not needed by a
        reducible term's solve; see :meth:`release_row_weight`)."""
        if not self.reducible():
            raise ValueError(f"{self.name}: only a reducible term can be weighted by Mᵀ G M alone")
        self._rows_gram, self._energy = P, float(P.trace())
        self.row_gram, self._weight_released = None, True

    def energy(self) -> float:
        """The weighted squared norm of M (rotation invariant): the paper's ``‖X W‖²`` for λ."""
        if self._energy is None:
            if self.col_gram is not None:
                self._energy = float((self.M * (self.M @ self.col_gram)).sum())
            else:
                self._energy = weighted_error(self.M, self.row_gram)
        return self._energy

    def cast(self, dtype: torch.dtype, grams: dict) -> "Term":
        """A copy in ``dtype`` (``grams`` shares the cast column weights between the terms of a segment)."""
        col = None
        if self.col_gram is not None:
            col = grams.setdefault(id(self.col_gram), self.col_gram.to(dtype))
        out = Term(
            self.name,
            self.M.to(dtype),
            self.structure,
            None if self.row_gram is None else self.row_gram.to(dtype),
            col,
            self.weight,
            None if self.factors is None else tuple(f.to(dtype) for f in self.factors),
        )
        out._energy = self._energy
        return out

    def fit(self, Q: Tensor, als_iters: int) -> None:
        """Best structured factors for the rotated matrix ``M Q`` (see the module docstring)."""
        if self._weight_released:
            raise RuntimeError(
                f"{self.name}: its row weight was released (release_row_weight): only its reduced term can be fitted"
            )
        target = self.M @ Q
        if self.is_dense:
            self.factors = (target,)
        elif self.col_gram is None and self.row_gram is None:
            self.factors = self.structure.project(target)  # globally optimal
        else:
            if self.col_gram is None:
                st, gram, tgt, prev = self.structure, self.row_gram, target, self.factors
            else:  # a column weight is a row weight of the transpose
                st, gram, tgt = self.structure.transpose(), Gram(matrix=Q.T @ self.col_gram @ Q), target.T
                prev = None if self.factors is None else self.structure.transpose_factors(self.factors)
            if not st.iterative:  # closed form (low rank): no starting point to choose
                f = st.weighted(tgt, gram)
            else:
                init = st.project(tgt)
                if prev is not None and weighted_error(tgt - st.dense(prev), gram) < weighted_error(
                    tgt - st.dense(init), gram
                ):
                    init = prev
                f = st.weighted(tgt, gram, init=init, iters=als_iters)
            self.factors = f if self.col_gram is None else st.transpose_factors(f)
        self._summary = None  # made when the error is asked for (:meth:`summary`)

    def summary(self) -> tuple:
        """``(c, K, H)`` of the current factors (:meth:`_summarise`), made once per fit."""
        if self._summary is None:
            self._summarise()
        return self._summary

    def _summarise(self) -> None:
        """The error as a function of Q for the current factors:
        ``c − 2 tr(QᵀK) (+ tr(Σ Q H Qᵀ) for a column weight)``."""
        if self._weight_released:
            raise RuntimeError(
                f"{self.name}: its row weight was released (release_row_weight): its error is that of its reduced term"
            )
        W_hat = self.structure.dense(self.factors)
        if self.col_gram is None:
            GW = W_hat if self.row_gram is None else self.row_gram.apply(W_hat)
            self._summary = (self.energy() + float((W_hat * GW).sum()), self.M.T @ GW, None)
        else:
            self._summary = (self.energy(), self.col_gram @ (self.M.T @ W_hat), W_hat.T @ W_hat)

    def error(self, Q: Tensor) -> float:
        return float(self.error_tensor(Q))

    def error_tensor(self, Q: Tensor) -> Tensor:
        """:meth:`error` as a 0-d tensor on Q's device (no host synchronisation)."""
        c, K, H = self.summary()
        e = c - 2 * (Q * K).sum()
        return e if H is None else e + ((self.col_gram @ Q @ H) * Q).sum()

    # ---- Gram reduction
    def reducible(self) -> bool:
        """Rows free (the row factor is unconstrained: Kronecker with ``A_s`` of one row, GS with one row
        block, low rank) and more rows than columns: then the problem depends on M only through
        ``Mᵀ G M`` and M can be replaced by its ``[d, d]`` square root."""
        return self.structure.rows_free and self.M.shape[0] > self.M.shape[1]

    def reduced(self) -> tuple["Term", Tensor]:
        """``(term on M' = (Mᵀ G M)^{1/2}, R = M'⁺)``: the same objective for every Q and every factors
        of the reduced term, whose row factor lifts back by ``T = M R`` (:meth:`lift`). The embedding
        (``[vocab, d]``) and FFN matrices then cost ``O(d³)`` per step instead of ``O(k d²)``; ``T``
        (as large as M) is never formed: the lift computes ``M (R f)``."""
        if self._rows_gram is not None:
            return self.reduced_from_gram(self._rows_gram)
        if self._weight_released:  # its Mᵀ G M went to the reduced term solve_segment made
            raise RuntimeError(f"{self.name}: its row weight was released and already reduced")
        P = self.M.T @ (self.M if self.row_gram is None else self.row_gram.apply(self.M))
        return self.reduced_from_gram(P)

    def reduced_from_gram(self, P: Tensor) -> tuple["Term", Tensor]:
        """:meth:`reduced` from ``P = Mᵀ G M`` alone: the reduced term and ``R`` with ``T = M R`` (for
        callers that accumulate P and apply R a block of rows of M at a time; only M's shape is used)."""
        lam, V = symmetric_eigh(P)
        lam = lam.clamp_min(0)
        root = lam.sqrt()
        inv = torch.where(root > 1e-7 * root.max().clamp_min(1e-300), 1.0 / root, torch.zeros_like(root))
        M_red = (V * root) @ V.T
        R = (V * inv) @ V.T
        red = Term(self.name, M_red, self.structure.with_rows(self.M.shape[1]), None, self.col_gram, self.weight)
        return red, R

    def lift(self, reduced: "Term", R: Tensor) -> None:
        """Factors of the full matrix from those of its reduction (the row factor times ``T = M R``,
        applied as ``M (R f)``)."""
        s, (i, _) = self.structure, self.structure.row_factor
        self.factors = tuple(
            s.map_rows(self.M, s.map_rows(R, f)) if j == i else f for j, f in enumerate(reduced.factors)
        )
        self._summary = None  # made when an error is asked for (the reduced term's is the same)


def objective(terms: list[Term], Q: Tensor) -> float:
    """``Σ λ_t err_t(Q)`` over the compressed terms, summed on the device in term order and fetched
    once (one host synchronisation per evaluation, not one per term)."""
    total = 0
    for t in terms:
        if not t.is_dense:
            total = total + t.weight * t.error_tensor(Q)
    return total if isinstance(total, int) else float(total)


def balance(terms: list[Term], readers: list[Term]) -> None:
    """The paper's λ: readers' terms get ``λ = Σ‖X_out W_out‖² / Σ‖X_in W_in‖²`` (compressed terms only),
    so writers and readers count alike."""
    writers = [t for t in terms if t not in readers and not t.is_dense]
    compressed_readers = [t for t in readers if not t.is_dense]
    if not writers or not compressed_readers:
        return
    lam = sum(t.energy() for t in writers) / max(sum(t.energy() for t in compressed_readers), 1e-300)
    for t in compressed_readers:
        t.weight *= lam


@dataclass
class Summary:
    """The objective as a function of Q for fixed factors, summed over terms (:meth:`add`):
    ``J(Q) = const − 2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)``, one pair per shared column weight ``Σ_p``
    (:meth:`value`), and with ``at`` the sum of the terms' errors at that Q (:attr:`J`)."""

    K: Tensor
    const: float = 0.0
    quad: dict = field(default_factory=dict)  # id(Σ_p) -> [Σ_p, H_p]
    J: float = 0.0
    dense_only: bool = True

    def add(self, t: Term, at: Tensor | None = None) -> None:
        """Add term ``t`` (its current factors; dense terms add nothing)."""
        if t.is_dense:
            return
        c, Kt, Ht = t.summary()
        self.K += t.weight * Kt
        self.const += t.weight * c
        if Ht is not None:
            entry = self.quad.setdefault(id(t.col_gram), [t.col_gram, torch.zeros_like(self.K)])
            entry[1] += t.weight * Ht
        if at is not None:
            self.J += t.weight * t.error(at)
        self.dense_only = False

    @property
    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(S, H) for S, H in self.quad.values()]

    def value(self, Q: Tensor) -> float:
        e = self.const - 2 * float((Q * self.K).sum())
        for S, H in self.quad.values():
            e += float(((S @ Q @ H) * Q).sum())
        return e


def _linear_and_quadratic(terms: list[Term]) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """``K`` and the pairs ``(Σ_p, H_p)`` of ``J(Q) = c − 2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)``."""
    M = terms[0].M
    summary = Summary(torch.zeros(M.shape[1], M.shape[1], dtype=M.dtype, device=M.device))
    for t in terms:
        summary.add(t)
    return summary.K, summary.pairs


def _eigh(A: Tensor) -> tuple[Tensor, Tensor]:
    """torch's ``eigh`` of the symmetric part, where :func:`.linalg.factorisation_device` places it."""
    where = factorisation_device(A)
    with limit_threads():
        lam, V = torch.linalg.eigh(((A + A.T) / 2).to(where))
    return lam.to(A.device), V.to(A.device)


def _retract(Y: Tensor) -> Tensor:
    """The QR retraction onto O(d): the Q factor of ``Y`` with R's diagonal made positive."""
    with limit_threads():
        q, r = torch.linalg.qr(Y)
    sign = torch.sign(torch.diagonal(r))
    return q * torch.where(sign == 0, torch.ones_like(sign), sign)


def over_relaxed(Q: Tensor, Q_prev: Tensor, beta: float) -> Tensor:
    """``Q + β (Q − Q_prev)`` retracted onto O(d): a longer step along the last change of Q (the
    over-relaxation of :func:`solve_segment`'s ``extrapolate``)."""
    return _retract(Q + beta * (Q - Q_prev))


def nearest_orthogonal(Y: Tensor) -> Tensor:
    """The orthogonal matrix nearest to ``Y`` (its polar factor ``U Vᵀ``), in float64: float32
    iterations' rotation made orthogonal to float64 round-off."""
    with limit_threads():
        U, _, Vh = torch.linalg.svd(Y.to(torch.float64))
    return U @ Vh


def _descent(value_and_grad, X0: Tensor, lipschitz: float, iters: int, tol: float) -> tuple[Tensor, list[float]]:
    """Riemannian gradient descent on O(d) from ``X0`` for ``value_and_grad(X) -> (f, Euclidean ∇f)``: a QR
    retraction (the iterate is orthogonal to round-off), alternating Barzilai–Borwein steps and the
    non-monotone line search of Zhang & Hager (as in Wen & Yin's feasible method). Stops after ``iters``
    steps or when the Riemannian gradient falls below ``tol`` times its first norm. Returns the best
    iterate and the best objective after each step."""

    def riemannian(X, G):
        A = X.T @ G
        return X @ ((A - A.T) / 2)

    X = X0.clone()
    f, G = value_and_grad(X)
    xi = riemannian(X, G)
    tau = 1.0 / max(float(lipschitz), 1e-300)
    g0 = float((xi * xi).sum())
    ref, weight = f, 1.0  # Zhang–Hager reference value (a weighted mean of past objectives)
    best_f, best_X = f, X
    values = [f]
    g2 = g0
    for it in range(iters):
        if g2 <= tol**2 * max(g0, 1e-300):
            break
        t = tau
        for _ in range(50):
            Xn = _retract(X - t * xi)
            fn, Gn = value_and_grad(Xn)
            if fn <= ref - 1e-4 * t * g2:
                break
            t *= 0.5
        else:
            break  # no decrease left at this precision: stationary
        xin = riemannian(Xn, Gn)
        s, y = Xn - X, xin - xi
        # the step's scalars and the next gradient norm in one transfer (one host synchronisation on a GPU)
        sy, ss, yy, g2 = torch.stack([(s * y).sum(), (s * s).sum(), (y * y).sum(), (xin * xin).sum()]).tolist()
        tau = (ss / sy if it % 2 == 0 else sy / max(yy, 1e-300)) if sy > 0 else 2 * t
        weight_next = 0.85 * weight + 1.0
        ref = (0.85 * weight * ref + fn) / weight_next
        weight = weight_next
        X, f, xi = Xn, fn, xin
        if f < best_f:
            best_f, best_X = f, X
        values.append(best_f)
    return best_X, values


def weighted_procrustes(
    K: Tensor,
    pairs: list[tuple[Tensor, Tensor]],
    Q0: Tensor,
    iters: int = 100,
    tol: float = 1e-9,
    eig_cache: dict | None = None,
) -> tuple[Tensor, list[float]]:
    """``argmin_{QᵀQ = I} −2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)`` from ``Q0`` (a weighted orthogonal
    Procrustes problem; no closed form) by :func:`_descent`. The best iterate is returned, so the result
    is never worse than ``Q0``. Returns (Q, best objective so far after each step).

    One pair (the readers of one residual segment share its covariance Σ) is solved in the eigenbases
    of ``Σ = U diag(s) Uᵀ`` and ``H = V diag(h) Vᵀ``: with ``Q = U P Vᵀ`` the quadratic term is
    ``Σ_ij s_i h_j P_ij²``, so a gradient costs ``O(d²)`` instead of two ``d³`` products. ``eig_cache``
    keeps Σ's decomposition between calls (Σ does not change while the factors do)."""
    if not pairs:
        with limit_threads():
            return orthogonal_procrustes(K).to(K.dtype), []
    if len(pairs) > 1:

        def value_and_grad(Q):
            SQH = sum(S @ Q @ H for S, H in pairs)
            return float(-2 * (Q * K).sum() + (SQH * Q).sum()), 2 * (SQH - K)

        lipschitz = 2 * sum(float(torch.linalg.matrix_norm(S, 2) * torch.linalg.matrix_norm(H, 2)) for S, H in pairs)
        return _descent(value_and_grad, Q0, lipschitz, iters, tol)
    ((S, H),) = pairs
    cache = {} if eig_cache is None else eig_cache
    key = (id(S), S.dtype)
    if key not in cache:
        cache[key] = (S, *_eigh(S))  # S itself is kept so that its id cannot be reused
    _, s, U = cache[key]
    h, V = _eigh(H)
    W = s.clamp_min(0)[:, None] * h.clamp_min(0)[None, :]
    Kt = U.T @ K @ V

    def value_and_grad_p(P):
        WP = W * P
        return float((P * (WP - 2 * Kt)).sum()), 2 * (WP - Kt)

    P, values = _descent(value_and_grad_p, U.T @ Q0 @ V, 2 * float(W.max()), iters, tol)
    return U @ P @ V.T, values


@dataclass
class SegmentResult:
    Q: Tensor
    trace: list[float] = field(default_factory=list)  # J after every projection and every rotation step
    alternations: int = 0  # projection/rotation alternations run
    converged: bool = False  # stopped by the tolerance (not by the cap)


def solve_segment(terms: list[Term], Q0: Tensor, schedule: Alternation) -> SegmentResult:
    """Alternate projection and rotation from ``Q0``, then project once more so that the returned factors
    belong to the returned Q. The recorded objective never increases (up to the round-off of ``dtype``).

    ``schedule`` (:class:`Alternation`) holds the settings below.

    Stopping rule: at most ``iters`` alternations; with ``tol > 0`` it stops as soon as one alternation
    lowers the objective by less than ``tol`` relative to its value before (``tol = 0``: exactly
    ``iters`` alternations, the fixed count). Each rotation step runs at most ``wopp_iters`` descent
    steps and stops earlier when the Riemannian gradient falls below ``wopp_tol`` times its first norm.
    ``extrapolate``: from the second alternation on, also try ``Q + β (Q − Q_prev)`` (retracted, β adapted)
    before each projection and keep it when its fitted objective is lower (one more projection per
    alternation; on SmolLM2 stage W it lowers the objective reached in a given number of alternations).
    Defaults (``tol=0``, no extrapolation) are the previous fixed-count behaviour.

    ``reduce``: tall row-free terms are solved on their ``[d, d]`` Gram roots (same objective) and
    lifted. ``keep_weights=False``: a reduced term's row weight is dropped from it once its reduction is
    made (nothing in the solve needs it again: for callers that read only the factors, e.g. a writer's
    ``[4d, 4d]`` input moments). ``dtype``: the iterations may run in float32 (faster); Q is then
    re-orthonormalised and the final projection done in float64, so the result is float64-exact.
    Everything runs on the device of the terms' matrices."""
    if schedule.iters < 0 or schedule.tol < 0 or schedule.wopp_iters < 0:
        raise ValueError(
            f"iters, tol and wopp_iters must be >= 0, got {schedule.iters}, {schedule.tol}, {schedule.wopp_iters}"
        )
    device = terms[0].M.device if terms else Q0.device
    # one CPU thread: the matrices are at most d x d after the Gram reduction, where torch's thread pool
    # is slower than one thread, and on shared cores even small products are 10-100x slower with it
    with limit_threads(1) if device.type == "cpu" else contextlib.nullcontext():
        return _solve(terms, Q0.to(device=device, dtype=torch.float64).clone(), schedule)


def work_term(t: Term, keep_weights: bool = True) -> tuple[Term, Tensor | None]:
    """The term the alternation fits in place of ``t`` and ``R`` to lift it back (:meth:`Term.lift`):
    a reducible term's ``[d, d]`` Gram root (``keep_weights=False``: its row weight dropped from ``t``
    first, :meth:`Term.release_row_weight`), or ``t`` itself and ``None``."""
    if t.is_dense or not t.reducible():
        return t, None
    if not keep_weights:
        t.release_row_weight()
    red, R = t.reduced()
    t._rows_gram = None  # (the reduced term holds what it gave)
    return red, R


@dataclass(frozen=True)
class Alternation:
    """The settings of one :func:`solve_segment` run (see there)."""

    iters: int
    als_iters: int = 5
    wopp_iters: int = 100
    reduce: bool = True
    dtype: torch.dtype = torch.float64
    tol: float = 0.0
    wopp_tol: float = 1e-9
    extrapolate: bool = False
    keep_weights: bool = True


def _solve(terms, Q, schedule: Alternation) -> SegmentResult:
    iters, als_iters, wopp_iters, reduce, dtype = (
        schedule.iters,
        schedule.als_iters,
        schedule.wopp_iters,
        schedule.reduce,
        schedule.dtype,
    )
    tol, wopp_tol, extrapolate, keep_weights = (
        schedule.tol,
        schedule.wopp_tol,
        schedule.extrapolate,
        schedule.keep_weights,
    )
    work, lifts = [], []
    for t in terms:
        w, R = work_term(t, keep_weights) if reduce else (t, None)
        work.append(w)
        if R is not None:
            lifts.append((t, w, R))
    fast = dtype != torch.float64 and iters > 0  # no iterations: nothing to run in float32
    grams: dict = {}
    loop = [t.cast(dtype, grams) for t in work] if fast else work
    Qw = Q.to(dtype) if fast else Q
    trace: list[float] = []
    eig_cache: dict = {}
    before = None
    alternations, converged = 0, False
    Q_prev, beta = None, 1.0
    for _ in range(iters):
        for t in loop:
            t.fit(Qw, als_iters)
        J = objective(loop, Qw)
        if extrapolate and Q_prev is not None:
            # Over-relaxation (as line searches accelerate CP-ALS): try going further along the last
            # rotation step, Q + β (Q − Q_prev) retracted onto O(d); keep it only if its fitted objective is lower
            saved = [(t.factors, t._summary) for t in loop]
            Qc = over_relaxed(Qw, Q_prev, beta)
            for t in loop:
                t.fit(Qc, als_iters)
            Jc = objective(loop, Qc)
            if Jc < J:
                Qw, J, beta = Qc, Jc, min(2 * beta, 8.0)
            else:
                for t, (f, summary) in zip(loop, saved):
                    t.factors, t._summary = f, summary
                beta = max(beta / 2, 0.25)
        trace.append(J)
        if before is None:
            before = trace[-1]
        if all(t.is_dense for t in loop):
            break
        K, pairs = _linear_and_quadratic(loop)
        Q_prev = Qw
        Qw, _ = weighted_procrustes(K, pairs, Qw, iters=wopp_iters, tol=wopp_tol, eig_cache=eig_cache)
        trace.append(objective(loop, Qw))
        alternations += 1
        if tol > 0 and before - trace[-1] <= tol * abs(before):
            converged = True
            break
        before = trace[-1]
    if not fast:
        Q = Qw
    elif iters:
        Q = nearest_orthogonal(Qw)
        for t, tw in zip(work, loop):
            t.factors = None if tw.factors is None else tuple(f.to(torch.float64) for f in tw.factors)
    # (no iterations: Q stays Q0 exactly, not its float32 rounding)
    for t in work:
        t.fit(Q, als_iters)
    final = 0.0  # objective(work, Q), each term's summary dropped once counted (fetched once)
    for t in work:
        if not t.is_dense:
            final = final + t.weight * t.error_tensor(Q)
        t._summary = None
    trace.append(float(final))
    for t, red, R in lifts:
        t.lift(red, R)
    return SegmentResult(Q, trace, alternations, converged)


# ---------------------------------------------------------------------------------------------
# Orthogonal skip matrices
# ---------------------------------------------------------------------------------------------
def cayley_encode(S: Tensor) -> tuple[Tensor, Tensor]:
    """Store an orthogonal ``S [d, d]`` as ``(k, signs)``: ``d(d−1)/2`` entries of a skew-symmetric K
    (upper triangle, row-major) and ``d`` signs with ``S = diag(signs) (I + K)(I − K)⁻¹``.

    The Cayley transform cannot reach orthogonal matrices with eigenvalue −1 (every one with
    det −1, for a start); the sign factor fixes that (ProcrustesGPT §5.4 uses Householder reflections).
    Signs are chosen during Gaussian elimination of ``S + D`` so that every pivot has modulus ≥ 1,
    which keeps ``I + D S = D (S + D)`` safely invertible. The inverse is
    ``modeling_compressed_llama.cayley_decode``. Runs on the CPU (one LU-like sweep, for storage); returns CPU
    tensors."""
    M = S.detach().to(device="cpu", dtype=torch.float64).numpy().copy()
    d = M.shape[0]
    signs = np.ones(d)
    for i in range(d):
        signs[i] = 1.0 if M[i, i] >= 0 else -1.0
        M[i, i] += signs[i]
        if i + 1 < d:
            M[i + 1 :, i:] -= np.outer(M[i + 1 :, i] / M[i, i], M[i, i:])
    C = signs[:, None] * S.detach().to(device="cpu", dtype=torch.float64).numpy()
    eye = np.eye(d)
    K = np.linalg.solve((C + eye).T, (C - eye).T).T  # (C − I)(C + I)⁻¹
    K = (K - K.T) / 2
    iu = np.triu_indices(d, 1)
    return torch.from_numpy(K[iu].copy()), torch.from_numpy(signs)
