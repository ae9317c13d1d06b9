"""ProcrustesGPT's per-segment problem (DESIGN.md §3, seed 001 §3.2, §5): find an orthogonal Q of a
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
  weighted terms, :mod:`.structured`);
* rotation: given the factors. Without reader covariances the objective is linear in Q, solved by
  orthogonal Procrustes (stage F). With them it is a weighted orthogonal Procrustes problem
  ``min −2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)`` (stage W), solved by Riemannian gradient descent on
  O(d) with Barzilai–Borwein steps, a QR retraction (Q stays orthogonal to round-off) and a
  non-monotone line search whose best iterate is kept — instead of the paper's Cayley + CG.

Tall matrices whose row factor is unconstrained (the embedding, FFN matrices under Kronecker) are
solved on the ``[d, d]`` square root of ``Mᵀ G M`` — the same objective for every Q — and lifted.

Also here: :func:`cayley_encode`, the storage of an orthogonal skip matrix as ``d(d+1)/2`` numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .procrustes import orthogonal_procrustes
from .structured import Dense, Factors, Gram, Structure, limit_threads, weighted_error

Tensor = torch.Tensor


@dataclass
class Term:
    """One matrix of a segment. ``M [k, d]`` in the original (norm-folded) basis; Q acts on its columns."""
    name: str
    M: Tensor
    structure: Structure
    row_gram: Gram | None = None     # writers, embeddings: ‖X (MQ − Ŵ)‖²
    col_gram: Tensor | None = None   # readers (stage W): ‖(MQ − Ŵ) Qᵀ Σ^{1/2}‖², Σ in the original basis
    weight: float = 1.0              # λ of the paper's balancing
    factors: Factors | None = None

    def __post_init__(self):
        if self.row_gram is not None and self.col_gram is not None:
            raise ValueError(f"{self.name}: a term is weighted on its rows or on its columns, not both")
        self._summary: tuple | None = None
        self._energy: float | None = None

    @property
    def is_dense(self) -> bool:
        return isinstance(self.structure, Dense)

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
        out = Term(self.name, self.M.to(dtype), self.structure, None if self.row_gram is None else self.row_gram.to(dtype),
                   col, self.weight, None if self.factors is None else tuple(f.to(dtype) for f in self.factors))
        out._energy = self._energy
        return out

    def fit(self, Q: Tensor, als_iters: int) -> None:
        """Best structured factors for the rotated matrix ``M Q`` (see the module docstring)."""
        target = self.M @ Q
        if self.is_dense:
            self.factors = (target,)
        elif self.col_gram is None and self.row_gram is None:
            self.factors = self.structure.project(target)   # globally optimal
        else:
            if self.col_gram is None:
                st, gram, tgt, prev = self.structure, self.row_gram, target, self.factors
            else:  # a column weight is a row weight of the transpose
                st, gram, tgt = self.structure.transpose(), Gram(matrix=Q.T @ self.col_gram @ Q), target.T
                prev = None if self.factors is None else self.structure.transpose_factors(self.factors)
            init = st.project(tgt)
            if prev is not None and weighted_error(tgt - st.dense(prev), gram) < weighted_error(tgt - st.dense(init), gram):
                init = prev
            f = st.weighted(tgt, gram, init=init, iters=als_iters)
            self.factors = f if self.col_gram is None else st.transpose_factors(f)
        self._summarise()

    def _summarise(self) -> None:
        """The error as a function of Q for the current factors:
        ``c − 2 tr(QᵀK) (+ tr(Σ Q H Qᵀ) for a column weight)``."""
        W_hat = self.structure.dense(self.factors)
        if self.col_gram is None:
            GW = W_hat if self.row_gram is None else self.row_gram.apply(W_hat)
            self._summary = (self.energy() + float((W_hat * GW).sum()), self.M.T @ GW, None)
        else:
            self._summary = (self.energy(), self.col_gram @ (self.M.T @ W_hat), W_hat.T @ W_hat)

    def error(self, Q: Tensor) -> float:
        c, K, H = self._summary
        e = c - 2 * float((Q * K).sum())
        return e if H is None else e + float(((self.col_gram @ Q @ H) * Q).sum())

    # ---- Gram reduction
    def reducible(self) -> bool:
        """Rows free (the row factor is unconstrained: Kronecker with ``A_s`` of one row, GS with one row
        block, low rank) and more rows than columns: then the problem depends on M only through
        ``Mᵀ G M`` and M can be replaced by its ``[d, d]`` square root."""
        s = self.structure
        rows_free = (s.kind == "kron" and s.a_shape[0] == 1) or (s.kind == "gs" and s.kl == 1) or s.kind == "lowrank"
        return rows_free and self.M.shape[0] > self.M.shape[1]

    def reduced(self) -> tuple["Term", Tensor]:
        """``(term on M' = (Mᵀ G M)^{1/2}, T = M M'⁺)``: the same objective for every Q and every factors
        of the reduced term, whose row factor lifts back by ``T`` (:meth:`lift`). The embedding
        (``[vocab, d]``) and FFN matrices then cost ``O(d³)`` per step instead of ``O(k d²)``."""
        P = self.M.T @ (self.M if self.row_gram is None else self.row_gram.apply(self.M))
        with limit_threads():
            lam, V = torch.linalg.eigh((P + P.T) / 2)
        lam = lam.clamp_min(0)
        root = lam.sqrt()
        inv = torch.where(root > 1e-10 * root.max().clamp_min(1e-300), 1.0 / root, torch.zeros_like(root))
        M_red = (V * root) @ V.T
        T = self.M @ ((V * inv) @ V.T)
        d = self.M.shape[1]
        st = self.structure
        small = {"kron": lambda: type(st)((d, st.shape[1]), st.rank, st.a_shape),
                 "gs": lambda: type(st)((d, st.shape[1]), st.kl, st.kr, st.rank),
                 "lowrank": lambda: type(st)((d, st.shape[1]), st.rank)}[st.kind]()
        red = Term(self.name, M_red, small, None, self.col_gram, self.weight)
        return red, T

    def lift(self, reduced: "Term", T: Tensor) -> None:
        """Factors of the full matrix from those of its reduction (the row factor times T)."""
        f = reduced.factors
        kind = self.structure.kind
        if kind == "kron":
            self.factors = (f[0], torch.einsum("ik,skj->sij", T, f[1]))
        elif kind == "gs":
            self.factors = ((T @ f[0][0])[None], f[1])
        else:
            self.factors = (T @ f[0], f[1])
        self._summarise()


def objective(terms: list[Term], Q: Tensor) -> float:
    return sum(t.weight * t.error(Q) for t in terms if not t.is_dense)


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


def _linear_and_quadratic(terms: list[Term]) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """``K`` and the pairs ``(Σ_p, H_p)`` of ``J(Q) = c − 2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)``."""
    d, dtype = terms[0].M.shape[1], terms[0].M.dtype
    K = torch.zeros(d, d, dtype=dtype)
    quad: dict[int, list] = {}
    for t in terms:
        if t.is_dense:
            continue
        _, Kt, Ht = t._summary
        K += t.weight * Kt
        if Ht is not None:
            entry = quad.setdefault(id(t.col_gram), [t.col_gram, torch.zeros(d, d, dtype=dtype)])
            entry[1] += t.weight * Ht
    return K, [(S, H) for S, H in quad.values()]


def weighted_procrustes(K: Tensor, pairs: list[tuple[Tensor, Tensor]], Q0: Tensor, iters: int = 100,
                        tol: float = 1e-9) -> tuple[Tensor, list[float]]:
    """``argmin_{QᵀQ = I} −2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)`` from ``Q0`` (a weighted orthogonal
    Procrustes problem; no closed form). Riemannian gradient descent on O(d) with a QR retraction
    (the iterate is orthogonal to round-off), alternating Barzilai–Borwein steps and the non-monotone
    line search of Zhang & Hager (as in Wen & Yin's feasible method). The best iterate is returned,
    so the result is never worse than ``Q0``. Returns (Q, best objective so far after each step)."""
    if not pairs:
        with limit_threads():
            return orthogonal_procrustes(K).to(K.dtype), []

    def value_and_grad(Q):
        SQH = sum(S @ Q @ H for S, H in pairs)
        return float(-2 * (Q * K).sum() + (SQH * Q).sum()), 2 * (SQH - K)

    def riemannian(Q, G):
        A = Q.T @ G
        return Q @ ((A - A.T) / 2)

    def retract(Y):
        with limit_threads():
            q, r = torch.linalg.qr(Y)
        sign = torch.sign(torch.diagonal(r))
        return q * torch.where(sign == 0, torch.ones_like(sign), sign)

    Q = Q0.clone()
    f, G = value_and_grad(Q)
    xi = riemannian(Q, G)
    lipschitz = 2 * sum(torch.linalg.matrix_norm(S, 2) * torch.linalg.matrix_norm(H, 2) for S, H in pairs)
    tau = 1.0 / max(float(lipschitz), 1e-300)
    g0 = float((xi * xi).sum())
    ref, weight = f, 1.0          # Zhang–Hager reference value (a weighted mean of past objectives)
    best_f, best_Q = f, Q
    values = [f]
    for it in range(iters):
        g2 = float((xi * xi).sum())
        if g2 <= tol ** 2 * max(g0, 1e-300):
            break
        t = tau
        for _ in range(50):
            Qn = retract(Q - t * xi)
            fn, Gn = value_and_grad(Qn)
            if fn <= ref - 1e-4 * t * g2:
                break
            t *= 0.5
        else:
            break  # no decrease left at this precision: stationary
        xin = riemannian(Qn, Gn)
        s, y = Qn - Q, xin - xi
        sy = float((s * y).sum())
        tau = (float((s * s).sum()) / sy if it % 2 == 0 else sy / max(float((y * y).sum()), 1e-300)) if sy > 0 else 2 * t
        weight_next = 0.85 * weight + 1.0
        ref = (0.85 * weight * ref + fn) / weight_next
        weight = weight_next
        Q, f, xi = Qn, fn, xin
        if f < best_f:
            best_f, best_Q = f, Q
        values.append(best_f)
    return best_Q, values


@dataclass
class SegmentResult:
    Q: Tensor
    trace: list[float] = field(default_factory=list)   # J after every projection and every rotation step


def solve_segment(terms: list[Term], Q0: Tensor, iters: int, als_iters: int = 5, wopp_iters: int = 100,
                  reduce: bool = True, dtype: torch.dtype = torch.float64) -> SegmentResult:
    """Alternate projection and rotation ``iters`` times from ``Q0``, then project once more so that
    the returned factors belong to the returned Q. The recorded objective never increases (up to the
    round-off of ``dtype``).

    ``reduce``: tall row-free terms are solved on their ``[d, d]`` Gram roots (same objective) and
    lifted. ``dtype``: the iterations may run in float32 (1.24x faster on SmolLM2 stage W); Q is then
    re-orthonormalised and the final projection done in float64, so the result is float64-exact."""
    Q = Q0.to(torch.float64).clone()
    work, lifts = [], []
    for t in terms:
        if reduce and not t.is_dense and t.reducible():
            red, T = t.reduced()
            work.append(red)
            lifts.append((t, red, T))
        else:
            work.append(t)
    fast = dtype != torch.float64
    grams: dict = {}
    loop = [t.cast(dtype, grams) for t in work] if fast else work
    Qw = Q.to(dtype)
    trace: list[float] = []
    for _ in range(iters):
        for t in loop:
            t.fit(Qw, als_iters)
        trace.append(objective(loop, Qw))
        if all(t.is_dense for t in loop):
            break
        K, pairs = _linear_and_quadratic(loop)
        Qw, _ = weighted_procrustes(K, pairs, Qw, iters=wopp_iters)
        trace.append(objective(loop, Qw))
    if not fast:
        Q = Qw
    elif iters:
        with limit_threads():
            U, _, Vh = torch.linalg.svd(Qw.to(torch.float64))
        Q = U @ Vh                                 # the nearest orthogonal matrix, in float64
        for t, tw in zip(work, loop):
            t.factors = None if tw.factors is None else tuple(f.to(torch.float64) for f in tw.factors)
    # (no iterations: Q stays Q0 exactly, not its float32 rounding)
    for t in work:
        t.fit(Q, als_iters)
    trace.append(objective(work, Q))
    for t, red, T in lifts:
        t.lift(red, T)
    return SegmentResult(Q, trace)


# ---------------------------------------------------------------------------------------------
# Orthogonal skip matrices
# ---------------------------------------------------------------------------------------------
def cayley_encode(S: Tensor) -> tuple[Tensor, Tensor]:
    """Store an orthogonal ``S [d, d]`` as ``(k, signs)``: ``d(d−1)/2`` entries of a skew-symmetric K
    (upper triangle, row-major) and ``d`` signs with ``S = diag(signs) (I + K)(I − K)⁻¹``.

    The Cayley transform cannot reach orthogonal matrices with eigenvalue −1 (every one with
    det −1, for a start); the sign factor fixes that (seed 001 §5.4 uses Householder reflections).
    Signs are chosen during Gaussian elimination of ``S + D`` so that every pivot has modulus ≥ 1,
    which keeps ``I + D S = D (S + D)`` safely invertible. The inverse is
    ``modeling_compressed_llama.cayley_decode``."""
    M = S.to(torch.float64).numpy().copy()
    d = M.shape[0]
    signs = np.ones(d)
    for i in range(d):
        signs[i] = 1.0 if M[i, i] >= 0 else -1.0
        M[i, i] += signs[i]
        if i + 1 < d:
            M[i + 1:, i:] -= np.outer(M[i + 1:, i] / M[i, i], M[i, i:])
    C = signs[:, None] * S.to(torch.float64).numpy()
    eye = np.eye(d)
    K = np.linalg.solve((C + eye).T, (C - eye).T).T   # (C − I)(C + I)⁻¹
    K = (K - K.T) / 2
    iu = np.triu_indices(d, 1)
    return torch.from_numpy(K[iu].copy()), torch.from_numpy(signs)
