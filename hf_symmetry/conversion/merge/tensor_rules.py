"""Merge rules on tensors (docs/math.md §2). Pure float64 math, no I/O: the pipeline in
:mod:`hf_symmetry.conversion.merge` feeds them one tensor (or one linear layer) at a time.

Weight-only rules follow mergekit's definitions and defaults, so that recipes mean the same
thing in both tools: ``linear``/average (normalised weights), ``task_arithmetic`` (not
normalised, ``lambda``), ``ties`` (magnitude trim to ``density`` per tensor, sign elected by the
weighted sum, disjoint weighted mean, ``lambda``).
"""

from __future__ import annotations

import functools

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


def task_arithmetic(
    base: Tensor, tensors: list[Tensor], weights: list[float], lam: float = 1.0, normalize: bool = False
) -> Tensor:
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


def ties(
    base: Tensor,
    tensors: list[Tensor],
    weights: list[float],
    densities: list[float],
    lam: float = 1.0,
    normalize: bool = True,
) -> Tensor:
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


def _regularised_(G: Tensor, alpha: float, scale: float, offset: int = 0) -> Tensor:
    """``scale · (α G + (1 − α) diag(G))`` in place (float64; the operations of the textbook form,
    signed zeros included, so results are bitwise those of computing it out of place). ``G`` may be
    the rows ``offset:`` of the Gram (its diagonal then starts at column ``offset``)."""
    diag = torch.diagonal(G, offset=offset)
    d = alpha * diag + (1 - alpha) * diag
    G.mul_(alpha).add_(0.0)
    diag.copy_(d)
    return G.mul_(scale)


def _factor(lhs: Tensor) -> tuple[Tensor, Tensor]:
    """LU factors of the summed Gram (``torch.linalg.solve`` factors the same way, so solving with
    them is bitwise ``solve``). A column-major ``lhs`` (LAPACK's layout) is factored in place: no
    second ``in × in`` matrix."""
    if lhs.dim() == 2 and lhs.mT.is_contiguous():
        pivots = torch.empty(lhs.shape[-1], dtype=torch.int32, device=lhs.device)
        info = torch.empty((), dtype=torch.int32, device=lhs.device)
        LU, pivots, info = torch.linalg.lu_factor_ex(lhs, out=(lhs, pivots, info))
    else:
        LU, pivots, info = torch.linalg.lu_factor_ex(lhs)
    if info.item() > 0:
        raise ValueError(
            "RegMean: the summed Gram matrix is singular (some input channel never saw signal); "
            "use alpha < 1 or more calibration tokens"
        )
    return LU, pivots


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"RegMean alpha must be in [0, 1]; got {alpha}")


def _draining(items: list):
    """The items of a list, each dropped from it as it is handed out."""
    for k in range(len(items)):
        item, items[k] = items[k], None
        yield item


GRAM_BLOCK_ELEMENTS = 1 << 20  # rows of a Gram used (or read from its file) at a time: 8 MB of float64


def _views(G: Tensor):
    """The rows of an in-memory Gram, a block at a time (views)."""
    n = G.shape[0]
    step = max(1, GRAM_BLOCK_ELEMENTS // n)
    for start in range(0, n, step):
        yield start, min(n, start + step), G[start : start + step]


def _stored_blocks(G, alpha: float, scale: float, device):
    """The regularised rows of a stored Gram (``G.rows(start, stop)``), a block at a time."""
    n = G.shape[0]
    step = max(1, GRAM_BLOCK_ELEMENTS // n)
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = G.rows(start, stop).to(device=device, dtype=torch.float64)
        yield start, stop, _regularised_(block, alpha, scale, offset=start)
        del block


def regmean_group(models, model_weights: list[float], alpha: float = 0.9, device=None) -> list[Tensor]:
    """RegMean (Jin et al.) of the linear layers ``[out, in]`` that read one input (q, k and v; gate
    and up; or one layer): for each, the W minimising ``Σ_i w_i ‖X_i Wᵀ − X_i W_iᵀ‖²``, i.e.
    ``Wᵀ = (Σ w_i G̃_i)⁻¹ Σ w_i G̃_i W_iᵀ`` with ``G̃ = α G + (1 − α) diag(G)`` (off-diagonals
    scaled by α, which keeps the sum invertible wherever every input channel saw some signal).

    ``models`` yields, one merged model at a time, ``(G_i, W_i of each layer)`` (the weights as a
    list or any iterable, e.g. read one at a time). Each model's Gram becomes its share of the
    summed Gram in place (it is consumed) and each weight is dropped once used, so memory holds the
    running sums and one model's Gram and one weight, not every model's; the summed Gram is factored
    once for all the layers. Computed on ``device`` (results
    there), in float64.

    A ``G_i`` that is not a tensor is a stored Gram (e.g. a file): it has ``shape`` and
    ``rows(start, stop)``, and is read a block of rows at a time (once for the summed Gram, once
    per weight), so memory never holds it whole; the summed Gram is then built column-major and
    factored in place."""
    _check_alpha(alpha)
    lhs, rhs = None, None
    for (G, Ws), mw in zip(models, model_weights):
        first = rhs is None
        rhs = [] if first else rhs
        n = G.shape[0]
        if isinstance(G, Tensor):
            G = _regularised_(G.to(device=device, dtype=torch.float64), alpha, mw)
            blocks = functools.partial(_views, G)
        else:  # stored: read a block of rows at a time, for the summed Gram now and for each weight
            blocks = functools.partial(_stored_blocks, G, alpha, mw, device)
            if lhs is None:
                lhs = torch.empty((n, n), dtype=torch.float64, device=device).T  # column-major
                for start, stop, block in blocks():
                    lhs[start:stop] = block.add_(0.0)
            else:
                for start, stop, block in blocks():
                    lhs[start:stop].add_(block)
        for k, W in enumerate(_draining(Ws) if isinstance(Ws, list) else Ws):
            W = W.to(device=device, dtype=torch.float64)
            # G̃ Wᵀ a block of rows at a time: the temporaries are blocks, not a second right-hand side
            r = torch.empty((n, W.shape[0]), dtype=torch.float64, device=device) if first else rhs[k]
            for start, stop, block in blocks():
                if first:
                    r[start:stop] = block @ W.T
                else:
                    r[start:stop].add_(block @ W.T)
            if first:
                rhs.append(r.add_(0.0))
            del W, r
        if isinstance(G, Tensor):
            lhs = G.add_(0.0) if lhs is None else lhs.add_(G)
        del G, blocks
    LU, pivots = _factor(lhs)
    del lhs
    out = []
    for k in range(len(rhs)):
        r, rhs[k] = rhs[k], None
        out.append(torch.linalg.lu_solve(LU, pivots, r).T)
        del r
    return out


def regmean(weights: list[Tensor], grams: list[Tensor], model_weights: list[float], alpha: float = 0.9) -> Tensor:
    """RegMean of one linear layer (:func:`regmean_group` with one layer; ``grams`` are not modified)."""
    return regmean_group(((G.to(torch.float64, copy=True), [W]) for W, G in zip(weights, grams)), model_weights, alpha)[
        0
    ]


class RegMeanSolver:
    """RegMean of one linear layer given a block of its output rows at a time (a vocabulary-sized
    LM head): the summed Gram is factored once, each block of rows is solved with it. Holds every
    model's regularised Gram (``in × in``), so it suits layers with a small input width."""

    def __init__(self, grams: list[Tensor], model_weights: list[float], alpha: float = 0.9, device=None):
        _check_alpha(alpha)
        self.device = device
        self.grams = [
            _regularised_(G.to(device=device, dtype=torch.float64, copy=True), alpha, mw)
            for G, mw in zip(grams, model_weights)
        ]
        lhs = None
        for G in self.grams:
            lhs = G.clone().add_(0.0) if lhs is None else lhs.add_(G)
        self.LU, self.pivots = _factor(lhs)

    def solve(self, weights: list[Tensor]) -> Tensor:
        """The merged rows for the models' rows ``weights`` (each ``[rows, in]``)."""
        rhs = None
        for G, W in zip(self.grams, weights):
            t = G @ W.to(device=self.device, dtype=torch.float64).T
            rhs = t.add_(0.0) if rhs is None else rhs.add_(t)
        return torch.linalg.lu_solve(self.LU, self.pivots, rhs).T
