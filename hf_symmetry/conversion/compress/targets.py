"""The solvers' weights from the calibration statistics, GPTQ-style damped (:func:`damped`), and, when
sequential calibration matches the original model, each matrix's target on the partly compressed model's
inputs (:func:`matched_target`): readers share one map A per segment, writers solve their own damped
system."""

from __future__ import annotations

import torch
from scipy.linalg.blas import dtrsm
from scipy.linalg.lapack import dpotrf

from .moments import CalibrationStats
from .plan import MatrixPlan


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
