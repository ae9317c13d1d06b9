"""The dense linear algebra of the structured solvers (:mod:`.structures`, :mod:`.segments`): SVD and
symmetric eigendecompositions (SciPy's LAPACK for CPU matrices), the row weightings :class:`Gram`,
pseudo-inverse solves of PSD normal equations (one matrix or a batch), and the thread limit the small
problems run under.

Where the factorisations run (:func:`factorisation_device`): on the matrix's own device, except small
ones of a matrix on an accelerator, which run on the CPU (order at most :data:`HOST_LINALG_MAX`, set by
``HF_SYMMETRY_HOST_LINALG_MAX``); the results go back to the matrix's device. The large work (Gram
accumulation, layer forwards, big products) stays where the tensors are.

Everything works in the dtype of its inputs (float64 for results)."""

from __future__ import annotations

import contextlib
import os

import scipy.linalg
import torch

Tensor = torch.Tensor

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


#: The largest order (``A.shape[-1]``) of a matrix on an accelerator whose dense factorisation
#: (eigendecomposition, SVD) runs on the CPU instead, its results moved back; 0 keeps every one on the
#: device. Default 128, by reasoning (no GPU was at hand to measure the device side): the CPU's
#: one-thread float64 ``syevd`` took 0.1 ms at order 32, 1.5 ms at 128, 11 ms at 256 and 70 ms at 576
#: (SVD about twice that; a loaded 2-core VM, ``benchmarks/results/small_linalg.json``), while a float64
#: cuSOLVER call costs a few milliseconds of launches and a host synchronisation (its error check)
#: whatever the order, so up to about 128 the host wins even with the two copies, and beyond a few
#: hundred the device's flops do. Re-measure with ``benchmarks/bench_small_linalg.py`` on the GPU at
#: hand and set ``HF_SYMMETRY_HOST_LINALG_MAX``.
HOST_LINALG_MAX = int(os.environ.get("HF_SYMMETRY_HOST_LINALG_MAX", "128"))


def factorisation_device(A: Tensor, host_max: int | None = None) -> torch.device:
    """Where a dense factorisation of ``A`` (a matrix or a batch of them) runs: ``A``'s device, except
    that a matrix of order at most ``host_max`` (default :data:`HOST_LINALG_MAX`) on an accelerator is
    factorised on the CPU."""
    limit = HOST_LINALG_MAX if host_max is None else host_max
    if A.device.type == "cpu" or A.shape[-1] > limit:
        return A.device
    return torch.device("cpu")


def _host_lapack(A: Tensor) -> bool:
    """Whether ``A`` is decomposed by SciPy's LAPACK (a CPU float32/float64 matrix, not a batch)."""
    return A.device.type == "cpu" and A.dim() == 2 and A.dtype in (torch.float32, torch.float64) and A.numel() > 0


def svd(A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.svd(A, full_matrices=False)``. A CPU matrix goes to SciPy's LAPACK ``gesdd``,
    measured on a 1536² float64 matrix (one thread) at a third of torch's transient memory (43 against
    123 MB, outputs included) in the same time; batches and other devices stay on torch. Where it runs:
    :func:`factorisation_device`."""
    where = factorisation_device(A)
    if where != A.device:
        return tuple(t.to(A.device) for t in svd(A.to(where)))
    if not _host_lapack(A):
        with limit_threads():
            return torch.linalg.svd(A, full_matrices=False)

    U, S, Vh = scipy.linalg.svd(A.detach().numpy(), full_matrices=False, check_finite=False, lapack_driver="gesdd")
    return torch.from_numpy(U), torch.from_numpy(S), torch.from_numpy(Vh)


def symmetric_eigh(A: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of the symmetric part ``(A + Aᵀ) / 2``: SciPy's LAPACK
    ``syevd`` on the CPU (measured on 1536², one thread: 37 against torch's 58 MB transient, 0.73 against
    0.89 s), torch's ``eigh`` elsewhere (a batch: one batched call). Where it runs: :func:`factorisation_device`."""
    where = factorisation_device(A)
    if where != A.device:
        return tuple(t.to(A.device) for t in symmetric_eigh(A.to(where)))
    S = (A + A.mT) / 2
    if not _host_lapack(S):
        with limit_threads():
            return torch.linalg.eigh(S)

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
    minimum-norm solution of normal equations, whose right-hand side is always in C's range. ``C``
    ``[..., n, n]`` and ``D`` ``[..., n, k]`` may be batches: one batched eigendecomposition solves them."""
    lam, V = symmetric_eigh(C)
    cut = _rcond(C.dtype) * lam.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    inv = torch.where(lam > cut, 1.0 / lam, torch.zeros_like(lam))
    return V @ (inv[..., :, None] * (V.mT @ D))


def weighted_error(D: Tensor, gram: Gram | None = None) -> float:
    """``‖D‖²_F`` or ``tr(Dᵀ G D)``."""
    return float((D * D).sum()) if gram is None else gram.error(D)


def truncated_svd(R: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """The top ``r`` singular triplets of ``R`` (or of every matrix in a batch)."""
    U, S, Vh = svd(R)
    return U[..., :r], S[..., :r], Vh[..., :r, :]
