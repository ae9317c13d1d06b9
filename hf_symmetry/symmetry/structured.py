"""Structured matrix classes for ProcrustesGPT compression (docs/math.md §3, ProcrustesGPT §4, App. A/B/D).

Every class describes a set of ``[m, n]`` matrices (``nn.Linear`` orientation ``[out, in]``) by factors,
and provides

* ``project(W)``: the Frobenius-optimal member (closed form, by SVD);
* ``weighted(W, gram, init)``: a member minimising the row-weighted error ``tr((W − Ŵ)ᵀ G (W − Ŵ))``
  (``G = XᵀX`` of a layer's inputs, or a diagonal of token counts) by alternating *exact*
  least-squares steps started from ``init`` — each step minimises the objective over one factor (or
  one block), so the error never increases;
* ``dense(factors)``: the reconstructed matrix (for errors and tests; the model's forward never
  forms it — see ``hf_symmetry.modeling.modeling_compressed_llama``);
* ``params()``: the parameter count from the factor shapes;
* ``transpose()`` / ``transpose_factors``: the same class for ``Wᵀ``, so a column weight is handled
  as a row weight of the transpose.

Classes: :class:`Kron` (sum of Kronecker products, Van Loan rearrangement), :class:`GS`
(block-diagonal · shuffle · block-diagonal, per-block truncated SVD), :class:`LowRank` and
:class:`Dense`. SliceGPT's zero-block class is handled at the model level (the residual width
shrinks), see :mod:`hf_symmetry.conversion.compress`.

Everything works in the dtype of its inputs (float64 for results; the segment solver may iterate in
float32 and finish in float64, see :func:`..segments.solve_segment`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
Factors = tuple[Tensor, ...]

_RCOND = 1e-12  # relative eigenvalue cut-off of the pseudo-inverses in the exact LS steps (float64)


def _rcond(dtype: torch.dtype) -> float:
    return _RCOND if dtype == torch.float64 else 1e-6


@contextlib.contextmanager
def limit_threads(n: int = 1):
    """Run torch on ``n`` threads inside the block. The solver's matrices are small or medium
    (at most ``d x d`` after the Gram reduction): there torch's thread pool is slower than one thread
    for LAPACK decompositions, and on shared cores its spinning makes even small matmuls 10-100x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _host_lapack(A: Tensor) -> bool:
    """Whether ``A`` is decomposed by SciPy's LAPACK (a CPU float32/float64 matrix, not a batch)."""
    return A.device.type == "cpu" and A.dim() == 2 and A.dtype in (torch.float32, torch.float64) and A.numel() > 0


def svd(A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.svd(A, full_matrices=False)``. A CPU matrix goes to SciPy's LAPACK ``gesdd``,
    measured on a 1536² float64 matrix (one thread) at a third of torch's transient memory (43 against
    123 MB, outputs included) in the same time; batches and other devices stay on torch."""
    if not _host_lapack(A):
        with limit_threads():
            return torch.linalg.svd(A, full_matrices=False)
    import scipy.linalg

    U, S, Vh = scipy.linalg.svd(A.detach().numpy(), full_matrices=False, check_finite=False, lapack_driver="gesdd")
    return torch.from_numpy(U), torch.from_numpy(S), torch.from_numpy(Vh)


def symmetric_eigh(A: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of the symmetric part ``(A + Aᵀ) / 2``: SciPy's LAPACK
    ``syevd`` on the CPU (measured on 1536², one thread: 37 against torch's 58 MB transient, 0.73 against
    0.89 s), torch's ``eigh`` elsewhere."""
    S = (A + A.T) / 2
    if not _host_lapack(S):
        with limit_threads():
            return torch.linalg.eigh(S)
    import scipy.linalg

    lam, V = scipy.linalg.eigh(S.numpy(), overwrite_a=True, check_finite=False, driver="evd")
    return torch.from_numpy(lam), torch.from_numpy(V)


# ---------------------------------------------------------------------------------------------
# Row weights
# ---------------------------------------------------------------------------------------------
class Gram:
    """A row weighting ``err(D) = ‖X D‖²_F = tr(Dᵀ G D)``, ``G = XᵀX``: a dense PSD matrix
    (covariance of a layer's inputs) or a diagonal (token counts of an embedding)."""

    def __init__(self, matrix: Tensor | None = None, diag: Tensor | None = None):
        if (matrix is None) == (diag is None):
            raise ValueError("Gram needs exactly one of matrix= or diag=")
        self.matrix = matrix
        self.diag = diag
        if self.matrix is not None and (self.matrix.dim() != 2 or self.matrix.shape[0] != self.matrix.shape[1]):
            raise ValueError(f"Gram matrix must be square, got {tuple(self.matrix.shape)}")

    @classmethod
    def identity(cls, m: int, dtype: torch.dtype = torch.float64) -> "Gram":
        return cls(diag=torch.ones(m, dtype=dtype))

    def to(self, dtype: torch.dtype) -> "Gram":
        return Gram(matrix=self.matrix.to(dtype)) if self.diag is None else Gram(diag=self.diag.to(dtype))

    @property
    def size(self) -> int:
        return (self.matrix if self.matrix is not None else self.diag).shape[0]

    @property
    def is_diag(self) -> bool:
        return self.diag is not None

    def apply(self, D: Tensor) -> Tensor:
        """``G @ D`` for ``D`` of shape ``[m, ...]``."""
        if self.diag is not None:
            return self.diag.reshape(-1, *([1] * (D.dim() - 1))) * D
        return (self.matrix @ D.reshape(D.shape[0], -1)).reshape(D.shape)

    def error(self, D: Tensor) -> float:
        return float((D * self.apply(D)).sum())

    def dense(self) -> Tensor:
        return torch.diag(self.diag) if self.diag is not None else self.matrix

    def block(self, rows: slice) -> "Gram":
        if self.diag is not None:
            return Gram(diag=self.diag[rows])
        return Gram(matrix=self.matrix[rows, rows])

    def apply_cols(self, rows: slice, D: Tensor) -> Tensor:
        """``G[:, rows] @ D`` (the change of ``G R`` when rows ``rows`` of ``R`` change by ``D``)."""
        if self.diag is not None:
            out = torch.zeros(self.size, D.shape[1], dtype=D.dtype, device=D.device)
            out[rows] = self.diag[rows, None] * D
            return out
        return self.matrix[:, rows] @ D

    def solve(self, rhs: Tensor) -> Tensor:
        """A minimum-norm solution of ``G Z = rhs`` (rhs in the range of G)."""
        if self.diag is not None:
            d = self.diag
            inv = torch.where(d > _rcond(d.dtype) * d.abs().max().clamp_min(1e-30), 1.0 / d, torch.zeros_like(d))
            return inv[:, None] * rhs
        return psd_solve(self.matrix, rhs)

    def roots(self) -> tuple[Tensor, Tensor]:
        """``(X, X⁺)`` with ``X = G^{1/2}`` symmetric (dense) — for the closed-form weighted low rank."""
        if self.diag is not None:
            s = self.diag.clamp_min(0).sqrt()
            inv = torch.where(s > _rcond(s.dtype) ** 0.5 * s.max().clamp_min(1e-30), 1.0 / s, torch.zeros_like(s))
            return torch.diag(s), torch.diag(inv)
        lam, V = symmetric_eigh(self.matrix)
        lam = lam.clamp_min(0)
        s = lam.sqrt()
        inv = torch.where(s > _rcond(s.dtype) ** 0.5 * s.max().clamp_min(1e-30), 1.0 / s, torch.zeros_like(s))
        return (V * s) @ V.T, (V * inv) @ V.T

    def rotated(self, Q: Tensor) -> "Gram":
        """The Gram of the rotated inputs ``X Q``: ``Qᵀ G Q``."""
        return Gram(matrix=Q.T @ self.dense() @ Q)


def psd_solve(C: Tensor, D: Tensor) -> Tensor:
    """``C⁺ D`` for symmetric PSD ``C`` (eigenvalues below ``1e-12 λ_max`` treated as zero): the
    minimum-norm solution of normal equations, whose right-hand side is always in C's range."""
    lam, V = symmetric_eigh(C)
    cut = _rcond(C.dtype) * lam.abs().max().clamp_min(1e-30)
    inv = torch.where(lam > cut, 1.0 / lam, torch.zeros_like(lam))
    return V @ (inv[:, None] * (V.T @ D))


def weighted_error(D: Tensor, gram: Gram | None = None) -> float:
    """``‖D‖²_F`` or ``tr(Dᵀ G D)``."""
    return float((D * D).sum()) if gram is None else gram.error(D)


def truncated_svd(R: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """The top ``r`` singular triplets of ``R`` (or of every matrix in a batch)."""
    U, S, Vh = svd(R)
    return U[..., :r], S[..., :r], Vh[..., :r, :]


# ---------------------------------------------------------------------------------------------
# Classes
# ---------------------------------------------------------------------------------------------
def _check_divides(what: str, part: int, whole: int, matrix: tuple[int, int]) -> None:
    if part <= 0 or whole % part:
        raise ValueError(f"{what} {part} does not divide {whole} (matrix {matrix[0]}x{matrix[1]})")


@dataclass(frozen=True)
class Dense:
    """No structure (a matrix left as it is, e.g. V in the paper)."""
    shape: tuple[int, int]

    kind = "dense"

    def params(self) -> int:
        return self.shape[0] * self.shape[1]

    def project(self, W: Tensor) -> Factors:
        return (W.clone(),)

    def weighted(self, W: Tensor, gram: Gram | None, init: Factors | None = None, iters: int = 0) -> Factors:
        return (W.clone(),)

    def dense(self, f: Factors) -> Tensor:
        return f[0]

    def transpose(self) -> "Dense":
        return Dense((self.shape[1], self.shape[0]))

    def transpose_factors(self, f: Factors) -> Factors:
        return (f[0].T,)

    def spec(self) -> dict:
        return {"type": "dense"}


@dataclass(frozen=True)
class LowRank:
    """``W = U V``, ``U [m, r]``, ``V [r, n]``."""
    shape: tuple[int, int]
    rank: int

    kind = "lowrank"

    def __post_init__(self):
        m, n = self.shape
        if not 1 <= self.rank <= min(m, n):
            raise ValueError(f"low rank {self.rank} must be in [1, {min(m, n)}] for a {m}x{n} matrix")

    def params(self) -> int:
        return self.rank * (self.shape[0] + self.shape[1])

    def project(self, W: Tensor) -> Factors:
        U, S, Vh = truncated_svd(W, self.rank)
        sq = S.sqrt()
        return U * sq, sq[:, None] * Vh

    def weighted(self, W: Tensor, gram: Gram | None, init: Factors | None = None, iters: int = 0) -> Factors:
        """Closed form (the ALS fixed point): ``Ŵ = X⁺ [X W]_r`` with ``X = G^{1/2}``."""
        if gram is None:
            return self.project(W)
        X, Xinv = gram.roots()
        U, S, Vh = truncated_svd(X @ W, self.rank)
        sq = S.sqrt()
        return Xinv @ (U * sq), sq[:, None] * Vh

    def dense(self, f: Factors) -> Tensor:
        return f[0] @ f[1]

    def transpose(self) -> "LowRank":
        return LowRank((self.shape[1], self.shape[0]), self.rank)

    def transpose_factors(self, f: Factors) -> Factors:
        return f[1].T, f[0].T

    def spec(self) -> dict:
        return {"type": "lowrank", "rank": self.rank}


@dataclass(frozen=True)
class Kron:
    """``W = Σ_{s<r} A_s ⊗ B_s`` with ``A_s [m1, n1]``, ``B_s [m2, n2]``, ``m = m1 m2``, ``n = n1 n2``
    (``(A ⊗ B)[i1 m2 + i2, j1 n2 + j2] = A[i1, j1] B[i2, j2]``). Factors ``A [r, m1, n1]``,
    ``B [r, m2, n2]``; parameters ``r (m1 n1 + m2 n2)``."""
    shape: tuple[int, int]
    rank: int
    a_shape: tuple[int, int]

    kind = "kron"

    def __post_init__(self):
        m, n = self.shape
        m1, n1 = self.a_shape
        _check_divides("Kronecker factor rows", m1, m, self.shape)
        _check_divides("Kronecker factor columns", n1, n, self.shape)
        if not 1 <= self.rank <= self.max_rank:
            raise ValueError(f"Kronecker rank {self.rank} must be in [1, {self.max_rank}] for factors "
                             f"{self.a_shape} ⊗ {self.b_shape}")

    @property
    def b_shape(self) -> tuple[int, int]:
        return self.shape[0] // self.a_shape[0], self.shape[1] // self.a_shape[1]

    @property
    def max_rank(self) -> int:
        (m1, n1), (m2, n2) = self.a_shape, self.b_shape
        return min(m1 * n1, m2 * n2)

    def params(self) -> int:
        (m1, n1), (m2, n2) = self.a_shape, self.b_shape
        return self.rank * (m1 * n1 + m2 * n2)

    def rearrange(self, W: Tensor) -> Tensor:
        """Van Loan's rearrangement ``R[(i1, j1), (i2, j2)] = W[i1 m2 + i2, j1 n2 + j2]``, under which
        ``Σ A_s ⊗ B_s`` becomes ``Σ vec(A_s) vec(B_s)ᵀ``: the Kronecker rank is the matrix rank of R."""
        (m1, n1), (m2, n2) = self.a_shape, self.b_shape
        return W.reshape(m1, m2, n1, n2).permute(0, 2, 1, 3).reshape(m1 * n1, m2 * n2)

    def project(self, W: Tensor) -> Factors:
        (m1, n1), (m2, n2), r = self.a_shape, self.b_shape, self.rank
        U, S, Vh = truncated_svd(self.rearrange(W), r)
        sq = S.sqrt()
        return (U * sq).T.reshape(r, m1, n1).contiguous(), (sq[:, None] * Vh).reshape(r, m2, n2)

    def dense(self, f: Factors) -> Tensor:
        A, B = f
        (m1, n1), (m2, n2) = self.a_shape, self.b_shape
        return torch.einsum("sac,sbd->abcd", A, B).reshape(m1 * m2, n1 * n2)

    def weighted(self, W: Tensor, gram: Gram | None, init: Factors | None = None, iters: int = 10) -> Factors:
        """Alternating exact least squares in A and B (ProcrustesGPT, App. A / Alg. 4)."""
        A, B = init if init is not None else self.project(W)
        if gram is None:
            gram = Gram(diag=torch.ones(self.shape[0], dtype=W.dtype, device=W.device))
        for _ in range(iters):
            A = self._solve_a(W, gram, B)
            B = self._solve_b(W, gram, A)
        return A, B

    def _solve_a(self, W: Tensor, gram: Gram, B: Tensor) -> Tensor:
        (m1, n1), (m2, n2), r = self.a_shape, self.b_shape, self.rank
        if m1 == 1:
            # rows live in B only: C[s,t] = <B_s, G B_t>, D[s,a] = <G B_s, W_a> (W_a: a-th column block)
            Bt = B.permute(1, 0, 2)                                  # [m2, r, n2]
            GB = gram.apply(Bt.reshape(m2, r * n2)).reshape(m2, r, n2)
            C = torch.einsum("isj,itj->st", Bt, GB)
            D = torch.einsum("isj,iaj->sa", GB, W.reshape(m2, n1, n2))
            return psd_solve(C, D).reshape(r, 1, n1)
        G4 = gram.dense().reshape(m1, m2, m1, m2)
        BBt = torch.einsum("sij,tkj->stik", B, B)                    # B_s B_tᵀ
        C = torch.einsum("aibk,stik->satb", G4, BBt).reshape(r * m1, r * m1)
        T = gram.apply(W).reshape(m1, m2, n1, n2)
        D = torch.einsum("sij,aibj->sab", B, T).reshape(r * m1, n1)
        return psd_solve(C, D).reshape(r, m1, n1)

    def _solve_b(self, W: Tensor, gram: Gram, A: Tensor) -> Tensor:
        (m1, n1), (m2, n2), r = self.a_shape, self.b_shape, self.rank
        if m1 == 1:
            # The weight acts on B's rows only, so it cancels from the normal equations
            # G (Σ_a A[s,a] W_a − Σ_t (A Aᵀ)[s,t] B_t) = 0.
            A2 = A.reshape(r, n1)
            rhs = torch.einsum("sa,iaj->sij", A2, W.reshape(m2, n1, n2)).reshape(r, m2 * n2)
            return psd_solve(A2 @ A2.T, rhs).reshape(r, m2, n2)
        G4 = gram.dense().reshape(m1, m2, m1, m2)
        AAt = torch.einsum("sij,tkj->stik", A, A)                    # A_s A_tᵀ
        C = torch.einsum("ickd,stik->sctd", G4, AAt).reshape(r * m2, r * m2)
        T = gram.apply(W).reshape(m1, m2, n1, n2)
        D = torch.einsum("sij,icje->sce", A, T).reshape(r * m2, n2)
        return psd_solve(C, D).reshape(r, m2, n2)

    def transpose(self) -> "Kron":
        return Kron((self.shape[1], self.shape[0]), self.rank, (self.a_shape[1], self.a_shape[0]))

    def transpose_factors(self, f: Factors) -> Factors:
        return f[0].transpose(1, 2), f[1].transpose(1, 2)

    def spec(self) -> dict:
        return {"type": "kron", "rank": self.rank, "a_shape": list(self.a_shape)}


@dataclass(frozen=True)
class GS:
    """Group-and-shuffle ``W = L · P · R`` (Gorbunov et al. 2024; Monarch-like): ``R`` block-diagonal
    with ``kr`` blocks ``[kl·b, n/kr]``, ``P`` the shuffle that routes ``b`` channels from every R-block
    to every L-block, ``L`` block-diagonal with ``kl`` blocks ``[m/kl, kr·b]``. Equivalently, block
    ``(i, j)`` of W (an ``m/kl × n/kr`` tile) is the rank-``b`` product
    ``L_i[:, j-th b columns] · R_j[i-th b rows, :]``. Factors ``L [kl, m/kl, kr b]``,
    ``R [kr, kl b, n/kr]``; parameters ``b (kr m + kl n)``."""
    shape: tuple[int, int]
    kl: int
    kr: int
    rank: int  # b, the rank of every tile

    kind = "gs"

    def __post_init__(self):
        m, n = self.shape
        _check_divides("GS row blocks", self.kl, m, self.shape)
        _check_divides("GS column blocks", self.kr, n, self.shape)
        if not 1 <= self.rank <= min(m // self.kl, n // self.kr):
            raise ValueError(f"GS tile rank {self.rank} must be in [1, {min(m // self.kl, n // self.kr)}] "
                             f"for {self.kl}x{self.kr} tiles of a {m}x{n} matrix")

    @property
    def tile(self) -> tuple[int, int]:
        return self.shape[0] // self.kl, self.shape[1] // self.kr

    def params(self) -> int:
        return self.rank * (self.kr * self.shape[0] + self.kl * self.shape[1])

    def tiles(self, W: Tensor) -> Tensor:
        """``[kl, kr, m/kl, n/kr]``: tile (i, j) of W."""
        (bl, br) = self.tile
        return W.reshape(self.kl, bl, self.kr, br).permute(0, 2, 1, 3)

    def project(self, W: Tensor) -> Factors:
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        U, S, Vh = truncated_svd(self.tiles(W), b)                   # [kl, kr, bl, b], [kl, kr, b], ...
        sq = S.sqrt()
        L = (U * sq[..., None, :]).permute(0, 2, 1, 3).reshape(kl, bl, kr * b)
        R = (sq[..., :, None] * Vh).permute(1, 0, 2, 3).reshape(kr, kl * b, br)
        return L.contiguous(), R.contiguous()

    def dense(self, f: Factors) -> Tensor:
        L, R = f
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        return torch.einsum("ipjc,jicq->ipjq", L.reshape(kl, bl, kr, b),
                            R.reshape(kr, kl, b, br)).reshape(kl * bl, kr * br)

    def weighted(self, W: Tensor, gram: Gram | None, init: Factors | None = None, iters: int = 10) -> Factors:
        """Alternating exact least squares (ProcrustesGPT App. B): all R blocks at once (they decouple
        for a row weight), then the L blocks one at a time (a row weight couples them; each block's
        subproblem ``G_ii Δ H_ii = rhs`` is solved exactly, so every update is a descent step)."""
        L, R = init if init is not None else self.project(W)
        L, R = L.clone(), R.clone()
        if gram is None:
            gram = Gram(diag=torch.ones(self.shape[0], dtype=W.dtype, device=W.device))
        for _ in range(iters):
            R = self._solve_r(W, gram, L)
            L = self._solve_l(W, gram, L, R)
        return L, R

    def _solve_r(self, W: Tensor, gram: Gram, L: Tensor) -> Tensor:
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        L4 = L.reshape(kl, bl, kr, b)
        blocks = []
        for j in range(kr):
            Z = torch.block_diag(*[L4[i, :, j, :] for i in range(kl)])       # [m, kl b]: the inputs R_j feeds
            GZ = gram.apply(Z)
            blocks.append(psd_solve(Z.T @ GZ, GZ.T @ W[:, j * br:(j + 1) * br]))
        return torch.stack(blocks)

    def _solve_l(self, W: Tensor, gram: Gram, L: Tensor, R: Tensor) -> Tensor:
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        L = L.clone()
        R4 = R.reshape(kr, kl, b, br)
        res = W - self.dense((L, R))
        g_res = gram.apply(res)
        for i in range(kl):
            rows = slice(i * bl, (i + 1) * bl)
            Z = torch.block_diag(*[R4[j, i] for j in range(kr)])             # [kr b, n]: what L_i multiplies
            delta = gram.block(rows).solve(g_res[rows] @ Z.T)
            delta = psd_solve(Z @ Z.T, delta.T).T
            L[i] += delta
            update = delta @ Z
            res[rows] -= update
            g_res -= gram.apply_cols(rows, update)
        return L

    def transpose(self) -> "GS":
        return GS((self.shape[1], self.shape[0]), self.kr, self.kl, self.rank)

    def transpose_factors(self, f: Factors) -> Factors:
        return f[1].transpose(1, 2).contiguous(), f[0].transpose(1, 2).contiguous()

    def spec(self) -> dict:
        return {"type": "gs", "blocks": [self.kl, self.kr], "rank": self.rank}


Structure = Dense | LowRank | Kron | GS
KINDS = ("dense", "lowrank", "kron", "gs")


def from_spec(spec: dict, shape: tuple[int, int]) -> Structure:
    """The structure a config entry (``{"type": ..., ...}``) describes for an ``[out, in]`` matrix."""
    kind = spec.get("type")
    if kind == "dense":
        return Dense(shape)
    if kind == "lowrank":
        return LowRank(shape, int(spec["rank"]))
    if kind == "kron":
        return Kron(shape, int(spec["rank"]), tuple(spec["a_shape"]))
    if kind == "gs":
        kl, kr = spec["blocks"]
        return GS(shape, int(kl), int(kr), int(spec["rank"]))
    raise ValueError(f"unknown structure type {kind!r}; choose one of {', '.join(KINDS)}")


def error(structure: Structure, W: Tensor, f: Factors, gram: Gram | None = None) -> float:
    """The (row-weighted) squared error of the factors ``f`` against ``W``."""
    return weighted_error(W - structure.dense(f), gram)
