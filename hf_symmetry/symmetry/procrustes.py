"""Closed-form solvers for matching one model to another inside its symmetry orbit. docs/math.md §2.

Every solver maximises an inner product ``<g·source, anchor>`` (equivalently minimises the squared
distance, since the group acts by isometries or the objective is written out in full), takes
float64 statistics and returns the group element; applying it is the job of
:mod:`hf_symmetry.symmetry.actions`, so matching and the random transforms of ``rotate`` share one
implementation of every action.

Convention: for weights whose head rows move as ``W -> Rᵀ W``, the cross matrix is
``M = W_source W_anchorᵀ`` and the best R maximises ``tr(Rᵀ M)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from .groups import so2_pairs
from .layout import HeadLayout


def orthogonal_procrustes(M: torch.Tensor) -> torch.Tensor:
    """``argmax_{R ∈ O(n)} tr(Rᵀ M) = U Vᵀ`` for ``M = U Σ Vᵀ`` (Schönemann 1966): globally optimal."""
    U, _, Vh = torch.linalg.svd(M.to(torch.float64))
    return U @ Vh


def pair_angles(M: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """Per RoPE pair (i, j), the SO(2) angle maximising ``c (M_ii + M_jj) + s (M_ji - M_ij)``, which is
    that pair's share of ``tr(Rᵀ M)`` for the block ``[[c, -s], [s, c]]`` of :func:`groups.so2_pairs`."""
    return torch.tensor(
        [math.atan2(M[j, i] - M[i, j], M[i, i] + M[j, j]) for i, j in layout.rope_pairs()], dtype=torch.float64
    )


def commutant_procrustes(M: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """``argmax tr(Rᵀ M)`` over the orthogonal maps that commute with RoPE in ``layout``: the exact
    per-pair SO(2) optimum on the rotary dims and full Procrustes on the non-rotary ones (all of
    O(head_dim) without RoPE). The objective splits over these blocks, so this is the global optimum."""
    M = M.to(torch.float64)
    R = so2_pairs(layout, pair_angles(M, layout))
    nope = layout.nope_dims()
    if len(nope):
        rows, cols = nope.unsqueeze(1), nope.unsqueeze(0)
        R[rows, cols] = orthogonal_procrustes(M[rows, cols])
    return R


def quartic_scale(xx: float, xy: float, yy: float, yz: float) -> float:
    """``argmin_{a ≠ 0} ||a X - X'||² + ||Y / a - Y'||²`` from ``xx = ||X||²``, ``xy = <X, X'>``,
    ``yy = ||Y||²``, ``yz = <Y, Y'>`` (Zhang et al. 2025, eq. 12).

    The objective tends to +∞ at 0 and ±∞, so its minimum is a real root of the stationarity
    condition ``xx a⁴ - xy a³ + yz a - yy = 0``; roots are polished by Newton steps and the one
    with the lowest objective wins (1 is kept as a candidate, so the result never does worse)."""
    if xx <= 0 or yy <= 0:
        return 1.0  # one side is zero: the objective is monotone in a, nothing sensible to choose

    def objective(a: float) -> float:
        return xx * a * a - 2 * xy * a + yy / (a * a) - 2 * yz / a

    def newton(a: float) -> float:
        for _ in range(3):
            p = ((xx * a - xy) * a * a + yz) * a - yy
            dp = (4 * xx * a - 3 * xy) * a * a + yz
            if dp == 0:
                break
            a -= p / dp
        return a

    roots = np.roots([xx, -xy, 0.0, yz, -yy])
    scale = max(abs(r) for r in roots)
    candidates = [newton(float(r.real)) for r in roots if abs(r.imag) <= 1e-7 * scale and r.real != 0]
    return min(candidates + [1.0], key=objective)


def match_permutation(similarity: torch.Tensor) -> torch.Tensor:
    """``perm`` maximising ``Σ_j similarity[j, perm[j]]`` (Hungarian / LAPJV, exact): slot j of the
    anchor receives source unit ``perm[j]`` — the convention of :func:`actions.permute_ffn`."""
    rows, cols = linear_sum_assignment(similarity.to(torch.float64).numpy(), maximize=True)
    perm = np.empty_like(cols)
    perm[rows] = cols
    return torch.from_numpy(perm)
