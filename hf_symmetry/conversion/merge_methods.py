"""Merge rules on tensors (docs/math.md §2). Pure float64 math, no I/O: the pipeline in
:mod:`hf_symmetry.conversion.merge` feeds them one tensor (or one linear layer) at a time.

Weight-only rules follow mergekit's definitions and defaults, so that recipes mean the same
thing in both tools: ``linear``/average (normalised weights), ``task_arithmetic`` (not
normalised, ``lambda``), ``ties`` (magnitude trim to ``density`` per tensor, sign elected by the
weighted sum, disjoint weighted mean, ``lambda``).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _stack(tensors: list[Tensor]) -> Tensor:
    return torch.stack([t.to(torch.float64) for t in tensors])


def _expand(weights: list[float], like: Tensor) -> Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return w.reshape(-1, *([1] * (like.dim() - 1)))


def weighted_average(tensors: list[Tensor], weights: list[float], normalize: bool = True) -> Tensor:
    """``Σ w_i θ_i`` (divided by ``Σ w_i`` when normalising)."""
    x = _stack(tensors)
    w = _expand(weights, x)
    out = (w * x).sum(0)
    return out / w.sum() if normalize else out


def task_arithmetic(base: Tensor, tensors: list[Tensor], weights: list[float], lam: float = 1.0,
                    normalize: bool = False) -> Tensor:
    """``base + λ Σ w_i (θ_i − base)`` (Ilharco et al.); ``normalize`` divides by ``Σ w_i``."""
    b = base.to(torch.float64)
    delta = weighted_average([t.to(torch.float64) - b for t in tensors], weights, normalize)
    return b + lam * delta


def magnitude_trim(delta: Tensor, density: float) -> Tensor:
    """Keep the ``max(1, int(density · n))`` largest-magnitude entries of ``delta`` (TIES' trim)."""
    if density >= 1:
        return delta
    if density <= 0 or delta.numel() == 0:
        return torch.zeros_like(delta)
    k = max(1, int(density * delta.numel()))
    keep = torch.argsort(delta.abs().reshape(-1), descending=True, stable=True)[:k]
    mask = torch.zeros(delta.numel(), dtype=torch.bool)
    mask[keep] = True
    return delta * mask.reshape(delta.shape)


def ties(base: Tensor, tensors: list[Tensor], weights: list[float], densities: list[float], lam: float = 1.0,
         normalize: bool = True) -> Tensor:
    """TIES-merging (Yadav et al.): trim each task vector to its density, elect each entry's sign
    as the sign of the weighted sum of trimmed task vectors (≥ 0 counts as +), then average only
    the task vectors that agree with it, weighted (``Σ w_i τ_i m_i / Σ w_i m_i``)."""
    b = base.to(torch.float64)
    deltas = _stack([magnitude_trim(t.to(torch.float64) - b, d) for t, d in zip(tensors, densities)])
    w = _expand(weights, deltas)
    weighted = deltas * w
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(torch.float64)
    agree = weighted.sign() == elected
    merged = (weighted * agree).sum(0)
    if normalize:
        divisor = (w * agree).sum(0)
        merged = merged / torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    return b + lam * merged


def fisher_average(tensors: list[Tensor], fishers: list[Tensor], weights: list[float], floor: float = 1e-12) -> Tensor:
    """Element-wise ``Σ w_i F_i θ_i / Σ w_i F_i`` (Matena & Raffel) with diagonal Fisher ``F_i``.
    ``floor`` is added to every Fisher entry so that parameters no calibration token touched fall
    back to the weighted average instead of 0/0."""
    x = _stack(tensors)
    w = _expand(weights, x)
    F = _stack(fishers) + floor
    return (w * F * x).sum(0) / (w * F).sum(0)


def regmean(weights: list[Tensor], grams: list[Tensor], model_weights: list[float], alpha: float = 0.9) -> Tensor:
    """RegMean (Jin et al.) for one linear layer ``[out, in]``: the W minimising
    ``Σ_i w_i ‖X_i Wᵀ − X_i W_iᵀ‖²``, i.e. ``Wᵀ = (Σ w_i G̃_i)⁻¹ Σ w_i G̃_i W_iᵀ`` with
    ``G̃ = α G + (1 − α) diag(G)`` (off-diagonals scaled by α, which keeps the sum invertible
    wherever every input channel saw some signal)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"RegMean alpha must be in [0, 1]; got {alpha}")
    lhs, rhs = 0, 0
    for W, G, mw in zip(weights, grams, model_weights):
        G = G.to(torch.float64)
        G = alpha * G + (1 - alpha) * torch.diag(torch.diagonal(G))
        lhs = lhs + mw * G
        rhs = rhs + mw * G @ W.to(torch.float64).T
    try:
        return torch.linalg.solve(lhs, rhs).T
    except torch.linalg.LinAlgError:
        raise ValueError("RegMean: the summed Gram matrix is singular (some input channel never saw signal); "
                         "use alpha < 1 or more calibration tokens") from None
