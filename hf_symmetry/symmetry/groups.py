"""Group elements: Haar orthogonals, RoPE commutants, random Hadamards, permutations.

All float64. Randomness comes from ``numpy.random.Generator`` streams keyed by
``(seed, *path)`` so that each layer and component gets an independent, reproducible
stream whatever order the conversion visits them in.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from .layout import HeadLayout


def rng(seed: int, *path: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), *map(int, path)])


def haar_orthogonal(n: int, gen: np.random.Generator) -> torch.Tensor:
    """Uniform (Haar) sample from O(n): QR of a Gaussian with the sign ambiguity removed."""
    if n == 0:
        return torch.zeros(0, 0, dtype=torch.float64)
    q, r = np.linalg.qr(gen.standard_normal((n, n)))
    return torch.from_numpy(q * np.sign(np.diag(r)))


def random_permutation(n: int, gen: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(gen.permutation(n))


def so2_pairs(layout: HeadLayout, angles: torch.Tensor) -> torch.Tensor:
    """The head_dim x head_dim matrix with an SO(2) block of the given angle on each RoPE pair
    (identity elsewhere). With rotate_half, pair (i, j) is rotated like RoPE itself rotates it."""
    R = torch.eye(layout.head_dim, dtype=torch.float64)
    for (i, j), a in zip(layout.rope_pairs(), angles.tolist()):
        c, s = math.cos(a), math.sin(a)
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R


def random_rope_commutant(layout: HeadLayout, gen: np.random.Generator) -> torch.Tensor:
    """A random element of the group of orthogonal maps commuting with every RoPE rotation:
    SO(2) per frequency pair, any orthogonal map on the non-rotary dims, nothing mixing them.
    Without RoPE this is all of O(head_dim)."""
    pairs = layout.rope_pairs()
    R = so2_pairs(layout, torch.from_numpy(gen.uniform(0, 2 * math.pi, len(pairs))))
    nope = layout.nope_dims()
    if len(nope):
        R[nope.unsqueeze(1), nope.unsqueeze(0)] = haar_orthogonal(len(nope), gen)
    return R


def rope_commutant_violation(R: torch.Tensor, layout: HeadLayout) -> float:
    """How far ``R`` is from the RoPE commutant (0 for an allowed QK rotation).

    Sums: non-orthogonality, mixing between different pairs or between rotary and free
    dims, and any pair block that is not a rotation (a reflection turns R_Δ into R_-Δ)."""
    d = layout.head_dim
    R = R.to(torch.float64)
    err = (R.T @ R - torch.eye(d, dtype=torch.float64)).abs().max().item()
    allowed = torch.zeros(d, d, dtype=torch.bool)
    for i, j in layout.rope_pairs():
        for a in (i, j):
            allowed[a, i] = allowed[a, j] = True
        block = R[[i, j]][:, [i, j]]
        # SO(2) blocks look like [[c, -s], [s, c]]
        err = max(err, (block[0, 0] - block[1, 1]).abs().item(), (block[0, 1] + block[1, 0]).abs().item())
    nope = layout.nope_dims()
    allowed[nope.unsqueeze(1), nope.unsqueeze(0)] = True
    err = max(err, R[~allowed].abs().max().item() if (~allowed).any() else 0.0)
    return err


# ---------------------------------------------------------------------- Hadamard


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(n**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = Legendre symbol of (j - i) mod q, for prime q."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if x in squares else -1 for x in range(1, q)])
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley(m: int) -> np.ndarray | None:
    """A Hadamard matrix of order m by Paley I (m = q + 1, q ≡ 3 mod 4) or Paley II
    (m = 2(q + 1), q ≡ 1 mod 4), q prime; None if neither applies."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        S = np.zeros((m, m), dtype=np.int64)
        S[0, 1:], S[1:, 0], S[1:, 1:] = 1, -1, _jacobsthal(q)
        return np.eye(m, dtype=np.int64) + S
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:
        C = np.zeros((q + 1, q + 1), dtype=np.int64)
        C[0, 1:], C[1:, 0], C[1:, 1:] = 1, 1, _jacobsthal(q)
        zero, one = np.array([[1, -1], [-1, -1]]), np.array([[1, 1], [1, -1]])
        return np.kron(C, one) + np.kron(np.eye(q + 1, dtype=np.int64), zero)
    return None


_H2 = np.array([[1, 1], [1, -1]], dtype=np.int64)


@lru_cache(maxsize=16)
def hadamard_factors(n: int, max_factor: int = 64) -> tuple[torch.Tensor, ...]:
    """Kronecker factors (each at most ``max_factor`` wide where possible) of an n x n
    Hadamard matrix Sylvester(2^k) ⊗ Paley(m); ValueError when n has no such construction."""
    twos = (n & -n).bit_length() - 1 if n > 0 else 0
    for k in range(twos, -1, -1):  # the most Sylvester doublings, i.e. the smallest Paley core
        m = n >> k
        base = np.ones((1, 1), dtype=np.int64) if m == 1 else (_H2 if m == 2 else _paley(m))
        if base is not None:
            factors, sylvester = [], np.ones((1, 1), dtype=np.int64)
            for _ in range(k):
                sylvester = np.kron(_H2, sylvester)
                if sylvester.shape[0] == max_factor:
                    factors.append(sylvester)
                    sylvester = np.ones((1, 1), dtype=np.int64)
            factors += [f for f in (sylvester, base) if f.shape[0] > 1]
            for f in factors:  # construction self-check
                if not np.array_equal(f @ f.T, f.shape[0] * np.eye(f.shape[0], dtype=np.int64)):
                    raise AssertionError(f"Hadamard construction failed for n={n}")
            return tuple(torch.from_numpy(f.astype(np.float64)) for f in factors) or (
                torch.ones(1, 1, dtype=torch.float64),
            )
    raise ValueError(
        f"no Hadamard matrix construction for size {n} (need 2^k·m with m-1 or m/2-1 a suitable "
        "prime); use a random orthogonal residual rotation instead"
    )


def hadamard(n: int) -> torch.Tensor:
    """An n x n Hadamard matrix (entries ±1, H Hᵀ = n I), dense."""
    H = torch.ones(1, 1, dtype=torch.float64)
    for f in hadamard_factors(n):
        H = torch.kron(H, f)
    return H


class RandomHadamard:
    """``Q = diag(s) H / √n`` (QuaRot-style), kept in Kronecker-factored form so that
    ``W Q`` costs ``n · Σ factor sizes`` per row instead of ``n²``. Supports the two products
    the residual actions need, ``W @ Q`` and ``Q.T @ W``, and :meth:`dense`."""

    def __init__(self, signs: torch.Tensor, factors: tuple[torch.Tensor, ...]):
        self.signs, self.factors = signs, factors
        self.n = signs.numel()
        self.shape = (self.n, self.n)
        self.dtype = torch.float64

    def right_apply(self, W: torch.Tensor) -> torch.Tensor:
        """``W @ Q`` for W of shape [..., n]."""
        lead = W.shape[:-1]
        X = (W * self.signs).reshape(-1, *(f.shape[0] for f in self.factors))
        for axis, f in enumerate(self.factors, start=1):
            X = torch.movedim(torch.tensordot(X, f, dims=([axis], [0])), -1, axis)
        return (X.reshape(*lead, self.n) / math.sqrt(self.n)).contiguous()

    def dense(self) -> torch.Tensor:
        return self.right_apply(torch.eye(self.n, dtype=torch.float64))

    def __rmatmul__(self, W: torch.Tensor) -> torch.Tensor:
        return self.right_apply(W)

    @property
    def T(self) -> "_Transposed":
        return _Transposed(self)


class _Transposed:
    def __init__(self, Q: RandomHadamard):
        self.Q = Q

    def __matmul__(self, W: torch.Tensor) -> torch.Tensor:
        """``Qᵀ W = (Wᵀ Q)ᵀ`` for W of shape [n, ...] (a vector too)."""
        if W.dim() == 1:
            return self.Q.right_apply(W)
        return self.Q.right_apply(W.T).T.contiguous()


def random_hadamard(n: int, gen: np.random.Generator) -> RandomHadamard:
    """diag(±1) H / √n: orthogonal, spreads every direction evenly (QuaRot-style)."""
    signs = torch.from_numpy(gen.choice([-1.0, 1.0], size=n))
    return RandomHadamard(signs, hadamard_factors(n))
