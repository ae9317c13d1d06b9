"""Structured matrix classes for ProcrustesGPT compression (docs/math.md §3, ProcrustesGPT §4, App. A/B/D).

Every class describes a set of ``[m, n]`` matrices (``nn.Linear`` orientation ``[out, in]``) by factors,
and provides

* ``project(W)``: the Frobenius-optimal member (closed form, by SVD);
* ``weighted(W, gram, init)``: a member minimising the row-weighted error ``tr((W − Ŵ)ᵀ G (W − Ŵ))``
  (``G = XᵀX`` of a layer's inputs, or a diagonal of token counts) by alternating *exact*
  least-squares steps started from ``init`` — each step minimises the objective over one factor (or
  one block), so the error never increases;
* ``dense(factors)``: the reconstructed matrix (for errors and tests; the model's forward never
  forms it — see ``hf_symmetry.modeling.structured_linear``);
* ``params()``: the parameter count from the factor shapes;
* ``transpose()`` / ``transpose_factors``: the same class for ``Wᵀ``, so a column weight is handled
  as a row weight of the transpose;
* ``rows_free`` / ``with_rows`` / ``map_rows``: whether the factor holding the rows is unconstrained,
  and then the same class on fewer rows and the map of that factor by a matrix on the left — what the
  Gram reduction of a tall matrix and its lift back need (:meth:`..segments.Term.reduced`);
* ``module_tensors(factors)``: the parameters of the matching module of the compressed model family;
* ``sized(shape, keep)``: the member of the class keeping about ``keep`` of a dense matrix's parameters;
* ``entry()`` / :func:`from_entry`: the config entry and back. ``kind``, the class's serialised name (a
  config's ``"type"``, the ``--structure`` choice), is mapped to the class in :data:`CLASSES` only.

Classes: :class:`Kron` (sum of Kronecker products, Van Loan rearrangement), :class:`GS`
(block-diagonal · shuffle · block-diagonal, per-block truncated SVD), :class:`LowRank` and
:class:`Dense`. SliceGPT's zero-block class is handled at the model level (the residual width
shrinks), see :mod:`hf_symmetry.conversion.compress`.

Everything works in the dtype of its inputs (float64 for results; the segment solver may iterate in
float32 and finish in float64, see :func:`..segments.solve_segment`). The dense linear algebra they
use (SVD, eigendecompositions, :class:`Gram` row weights, PSD solves) is :mod:`.linalg`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .linalg import (
    Gram,
    psd_solve,
    truncated_svd,
    weighted_error,
)

Tensor = torch.Tensor
Factors = tuple[Tensor, ...]

#: the Kronecker split ``A_s`` of ``1 x q`` tried for the hidden size (:meth:`Kron.plan_factor`)
KRON_Q_CANDIDATES = (2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 18, 20, 24, 32, 48, 64)


# ---------------------------------------------------------------------------------------------
# Classes
# ---------------------------------------------------------------------------------------------
def _check_divides(what: str, part: int, whole: int, matrix: tuple[int, int]) -> None:
    if part <= 0 or whole % part:
        raise ValueError(f"{what} {part} does not divide {whole} (matrix {matrix[0]}x{matrix[1]})")


def _divisors(n: int, candidates) -> list[int]:
    return [q for q in candidates if q <= n and n % q == 0]


class Structure:
    """What every structure class answers; the classes are frozen dataclasses whose first field is
    ``shape`` (``[m, n]``). Class attributes: ``kind`` (the serialised name), ``rotation_helps``
    (whether an orthogonal change of basis of the columns can lower the error: not for low rank, the
    rank of ``M Q`` is that of M), ``iterative`` (whether :meth:`weighted` iterates from a starting
    point instead of being closed form), ``row_factor`` (``(index, dim)``: the factor holding the
    rows and its row dimension, for the classes whose rows can be free) and ``sizing`` (each keyword
    argument of :meth:`sized` the class reads, with the ``compress`` option that sets it). ``kind`` is also
    the ``"type"`` of the matching module class (``hf_symmetry.modeling.structured_linear.LINEAR_CLASSES``)."""

    kind: ClassVar[str]
    rotation_helps: ClassVar[bool] = True
    iterative: ClassVar[bool] = False
    row_factor: ClassVar[tuple[int, int] | None] = None
    sizing: ClassVar[dict[str, str]] = {}

    @property
    def rows_free(self) -> bool:
        """Whether the row factor is unconstrained (any matrix times it stays in the class): a tall
        matrix's problem then depends on M only through ``Mᵀ G M``, and M can be replaced by its
        ``[n, n]`` square root (:meth:`..segments.Term.reduced`), its row factor lifted back by
        :meth:`map_rows`."""
        return False

    def with_rows(self, k: int) -> "Structure":
        """The same structure for a ``[k, n]`` matrix (a rows-free class only)."""
        raise TypeError(f"{type(self).__name__} {self.shape}: its rows are not free")

    def map_rows(self, T: Tensor, f: Tensor) -> Tensor:
        """``T`` (``[k', k]``) applied to the rows of the row factor ``f`` (a rows-free class only)."""
        raise TypeError(f"{type(self).__name__} {self.shape}: its rows are not free")

    @classmethod
    def plan_factor(cls, d: int, keep: float, user: int | None) -> int | None:
        """A split shared by every matrix of a plan, from the hidden size ``d`` (``None``: the class has
        none)."""
        return None


@dataclass(frozen=True)
class Dense(Structure):
    """No structure (a matrix left as it is, e.g. V in the paper). Its rows are not free in the sense
    of :attr:`Structure.rows_free`: a dense matrix is never fitted, so never reduced."""

    shape: tuple[int, int]

    kind = "dense"

    @classmethod
    def from_entry(cls, entry: dict, shape: tuple[int, int]) -> "Dense":
        return cls(shape)

    @classmethod
    def sized(cls, shape: tuple[int, int], keep: float, **_) -> "Dense":
        return cls(shape)

    def at_full_rank(self) -> "Dense":
        return self

    def module_tensors(self, f: Factors) -> dict[str, Tensor]:
        return {"weight": f[0]}

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

    def entry(self) -> dict:
        return {"type": self.kind}


@dataclass(frozen=True)
class LowRank(Structure):
    """``W = U V``, ``U [m, r]``, ``V [r, n]``."""

    shape: tuple[int, int]
    rank: int

    kind = "lowrank"
    rotation_helps = False
    row_factor = (0, 0)

    def __post_init__(self):
        m, n = self.shape
        if not 1 <= self.rank <= min(m, n):
            raise ValueError(f"low rank {self.rank} must be in [1, {min(m, n)}] for a {m}x{n} matrix")

    @classmethod
    def from_entry(cls, entry: dict, shape: tuple[int, int]) -> "LowRank":
        return cls(shape, int(entry["rank"]))

    @classmethod
    def sized(cls, shape: tuple[int, int], keep: float, **_) -> "LowRank":
        k, d = shape
        return cls((k, d), min(max(1, round(keep * k * d / (k + d))), min(k, d)))

    def at_full_rank(self) -> "LowRank":
        return LowRank(self.shape, min(self.shape))

    @property
    def rows_free(self) -> bool:
        return True

    def with_rows(self, k: int) -> "LowRank":
        return LowRank((k, self.shape[1]), self.rank)

    def map_rows(self, T: Tensor, f: Tensor) -> Tensor:
        return T @ f

    def module_tensors(self, f: Factors) -> dict[str, Tensor]:
        return {"lr_u": f[0], "lr_v": f[1]}

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

    def entry(self) -> dict:
        return {"type": self.kind, "rank": self.rank}


@dataclass(frozen=True)
class Kron(Structure):
    """``W = Σ_{s<r} A_s ⊗ B_s`` with ``A_s [m1, n1]``, ``B_s [m2, n2]``, ``m = m1 m2``, ``n = n1 n2``
    (``(A ⊗ B)[i1 m2 + i2, j1 n2 + j2] = A[i1, j1] B[i2, j2]``). Factors ``A [r, m1, n1]``,
    ``B [r, m2, n2]``; parameters ``r (m1 n1 + m2 n2)``."""

    shape: tuple[int, int]
    rank: int
    a_shape: tuple[int, int]

    kind = "kron"
    iterative = True
    row_factor = (1, 1)
    sizing = {"factor": "kron_factor"}

    def __post_init__(self):
        m, n = self.shape
        m1, n1 = self.a_shape
        _check_divides("Kronecker factor rows", m1, m, self.shape)
        _check_divides("Kronecker factor columns", n1, n, self.shape)
        if not 1 <= self.rank <= self.max_rank:
            raise ValueError(
                f"Kronecker rank {self.rank} must be in [1, {self.max_rank}] for factors "
                f"{self.a_shape} ⊗ {self.b_shape}"
            )

    @classmethod
    def from_entry(cls, entry: dict, shape: tuple[int, int]) -> "Kron":
        return cls(shape, int(entry["rank"]), tuple(entry["a_shape"]))

    @classmethod
    def sized(cls, shape: tuple[int, int], keep: float, *, factor: int, **_) -> "Kron":
        """``A_s`` of ``1 x factor`` (the plan's shared split, :meth:`plan_factor`), rank from ``keep``."""
        k, d = shape
        q = factor
        r = min(q, max(1, round(keep * k * d / (q + k * d / q))))
        return cls((k, d), r, (1, q))

    @classmethod
    def plan_factor(cls, d: int, keep: float, user: int | None) -> int:
        """The ``q`` of ``A_s [1, q]`` for every matrix of a plan on hidden size ``d``: ``user``'s when
        given (it must divide d), else the candidate whose rank rounds closest to ``keep``."""
        if user is not None:
            if d % user:
                raise ValueError(
                    f"Kronecker factor {user} does not divide the hidden size {d}: factor shapes must "
                    f"divide the matrix (try one of {_divisors(d, range(2, 65))})"
                )
            return user
        options = _divisors(d, [q for q in KRON_Q_CANDIDATES if q <= max(2, d // 4)])  # A stays the small factor
        if not options:
            raise ValueError(f"no Kronecker factor in {KRON_Q_CANDIDATES} divides the hidden size {d}")
        scored = [(abs(max(1, round(keep * q)) / q - keep), q) for q in options]
        good = [q for err, q in scored if err <= 0.01]
        return good[0] if good else min(scored)[1]

    def at_full_rank(self) -> "Kron":
        return Kron(self.shape, self.max_rank, self.a_shape)

    @property
    def rows_free(self) -> bool:
        """``A_s`` of one row: the rows live in the ``B_s`` only."""
        return self.a_shape[0] == 1

    def with_rows(self, k: int) -> "Kron":
        return Kron((k, self.shape[1]), self.rank, self.a_shape)

    def map_rows(self, T: Tensor, f: Tensor) -> Tensor:
        return torch.einsum("ik,skj->sij", T, f)

    def module_tensors(self, f: Factors) -> dict[str, Tensor]:
        return {"kron_a": f[0].permute(1, 0, 2), "kron_b": f[1].permute(1, 0, 2)}

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
            Bt = B.permute(1, 0, 2)  # [m2, r, n2]
            GB = gram.apply(Bt.reshape(m2, r * n2)).reshape(m2, r, n2)
            C = torch.einsum("isj,itj->st", Bt, GB)
            D = torch.einsum("isj,iaj->sa", GB, W.reshape(m2, n1, n2))
            return psd_solve(C, D).reshape(r, 1, n1)
        G4 = gram.dense().reshape(m1, m2, m1, m2)
        BBt = torch.einsum("sij,tkj->stik", B, B)  # B_s B_tᵀ
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
        AAt = torch.einsum("sij,tkj->stik", A, A)  # A_s A_tᵀ
        C = torch.einsum("ickd,stik->sctd", G4, AAt).reshape(r * m2, r * m2)
        T = gram.apply(W).reshape(m1, m2, n1, n2)
        D = torch.einsum("sij,icje->sce", A, T).reshape(r * m2, n2)
        return psd_solve(C, D).reshape(r, m2, n2)

    def transpose(self) -> "Kron":
        return Kron((self.shape[1], self.shape[0]), self.rank, (self.a_shape[1], self.a_shape[0]))

    def transpose_factors(self, f: Factors) -> Factors:
        return f[0].transpose(1, 2), f[1].transpose(1, 2)

    def entry(self) -> dict:
        return {"type": self.kind, "rank": self.rank, "a_shape": list(self.a_shape)}


@dataclass(frozen=True)
class GS(Structure):
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
    iterative = True
    row_factor = (0, 1)
    sizing = {"blocks": "gs_blocks"}

    def __post_init__(self):
        m, n = self.shape
        _check_divides("GS row blocks", self.kl, m, self.shape)
        _check_divides("GS column blocks", self.kr, n, self.shape)
        if not 1 <= self.rank <= min(m // self.kl, n // self.kr):
            raise ValueError(
                f"GS tile rank {self.rank} must be in [1, {min(m // self.kl, n // self.kr)}] "
                f"for {self.kl}x{self.kr} tiles of a {m}x{n} matrix"
            )

    @classmethod
    def from_entry(cls, entry: dict, shape: tuple[int, int]) -> "GS":
        kl, kr = entry["blocks"]
        return cls(shape, int(kl), int(kr), int(entry["rank"]))

    @classmethod
    def sized(
        cls,
        shape: tuple[int, int],
        keep: float,
        *,
        blocks: tuple[int, int] | None = None,
        embedding: bool = False,
        name: str = "",
        **_,
    ) -> "GS":
        """Tiles ``blocks`` (default: 4, 2 or 1 per side, whichever divides), one row block for an
        embedding or head (its rows free); the tile rank from ``keep``."""
        k, d = shape
        if blocks is None:
            blocks = (next(x for x in (4, 2, 1) if k % x == 0), next(x for x in (4, 2, 1) if d % x == 0))
        kl, kr = (1, blocks[1]) if embedding else tuple(blocks)
        if k % kl or d % kr:
            raise ValueError(
                f"GS blocks ({kl}, {kr}) do not divide {name} ({k}x{d} with the residual dimension on "
                "the columns): factor shapes must divide the matrix"
            )
        b = round(keep * k * d / (kr * k + kl * d))
        return cls((k, d), kl, kr, min(max(1, b), k // kl, d // kr))

    def at_full_rank(self) -> "GS":
        return GS(self.shape, self.kl, self.kr, min(self.tile))

    @property
    def rows_free(self) -> bool:
        """One row block: the left factor ``L [1, m, kr b]`` is unconstrained."""
        return self.kl == 1

    def with_rows(self, k: int) -> "GS":
        return GS((k, self.shape[1]), self.kl, self.kr, self.rank)

    def map_rows(self, T: Tensor, f: Tensor) -> Tensor:
        return (T @ f[0])[None]

    def module_tensors(self, f: Factors) -> dict[str, Tensor]:
        return {"gs_left": f[0], "gs_right": f[1]}

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
        U, S, Vh = truncated_svd(self.tiles(W), b)  # [kl, kr, bl, b], [kl, kr, b], ...
        sq = S.sqrt()
        L = (U * sq[..., None, :]).permute(0, 2, 1, 3).reshape(kl, bl, kr * b)
        R = (sq[..., :, None] * Vh).permute(1, 0, 2, 3).reshape(kr, kl * b, br)
        return L.contiguous(), R.contiguous()

    def dense(self, f: Factors) -> Tensor:
        L, R = f
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        return torch.einsum("ipjc,jicq->ipjq", L.reshape(kl, bl, kr, b), R.reshape(kr, kl, b, br)).reshape(
            kl * bl, kr * br
        )

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
        """Every R block: block j's normal equations ``(Z_jᵀ G Z_j) R_j = Z_jᵀ G W_j``, ``Z_j [m, kl b]``
        the block diagonal of L's j-th column blocks (what R_j feeds). On an accelerator the ``kr``
        problems are solved as one batch (:meth:`_solve_r_batched`: one batched eigendecomposition, no
        per-block launches); on the CPU one at a time, by SciPy's LAPACK (:meth:`_solve_r_blocks`: what
        LAPACK does for a batch anyway, and the bits the outputs had before batching)."""
        if W.device.type == "cpu":
            return self._solve_r_blocks(W, gram, L)
        return self._solve_r_batched(W, gram, L)

    def _solve_r_blocks(self, W: Tensor, gram: Gram, L: Tensor) -> Tensor:
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        L4 = L.reshape(kl, bl, kr, b)
        blocks = []
        for j in range(kr):
            Z = torch.block_diag(*[L4[i, :, j, :] for i in range(kl)])  # [m, kl b]: the inputs R_j feeds
            GZ = gram.apply(Z)
            blocks.append(psd_solve(Z.T @ GZ, GZ.T @ W[:, j * br : (j + 1) * br]))
        return torch.stack(blocks)

    def _solve_r_batched(self, W: Tensor, gram: Gram, L: Tensor) -> Tensor:
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        L4 = L.reshape(kl, bl, kr, b)
        Z = L.new_zeros(kl, bl, kr, kl, b)  # Z[i, p, j, i, c] = L4[i, p, j, c]
        i = torch.arange(kl, device=L.device)
        Z[i, :, :, i, :] = L4
        Z = Z.reshape(kl * bl, kr, kl * b)  # [m, kr, kl b]: Z_j for every j
        GZ = gram.apply(Z)
        C = torch.einsum("mjp,mjq->jpq", Z, GZ)
        D = torch.einsum("mjp,mjc->jpc", GZ, W.reshape(kl * bl, kr, br))
        return psd_solve(C, D)

    def _solve_l(self, W: Tensor, gram: Gram, L: Tensor, R: Tensor) -> Tensor:
        kl, kr, b, (bl, br) = self.kl, self.kr, self.rank, self.tile
        L = L.clone()
        R4 = R.reshape(kr, kl, b, br)
        res = W - self.dense((L, R))
        g_res = gram.apply(res)
        for i in range(kl):
            rows = slice(i * bl, (i + 1) * bl)
            Z = torch.block_diag(*[R4[j, i] for j in range(kr)])  # [kr b, n]: what L_i multiplies
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

    def entry(self) -> dict:
        return {"type": self.kind, "blocks": [self.kl, self.kr], "rank": self.rank}


#: the structure classes by their serialised name (``kind``): the one place a name maps to a class
CLASSES: dict[str, type[Structure]] = {cls.kind: cls for cls in (Dense, LowRank, Kron, GS)}
KINDS = tuple(CLASSES)


def from_entry(entry: dict, shape: tuple[int, int]) -> Structure:
    """The structure a config entry (``{"type": ..., ...}``) describes for an ``[out, in]`` matrix."""
    cls = CLASSES.get(entry.get("type"))
    if cls is None:
        raise ValueError(f"unknown structure type {entry.get('type')!r}; choose one of {', '.join(KINDS)}")
    return cls.from_entry(entry, shape)


def error(structure: Structure, W: Tensor, f: Factors, gram: Gram | None = None) -> float:
    """The (row-weighted) squared error of the factors ``f`` against ``W``."""
    return weighted_error(W - structure.dense(f), gram)
