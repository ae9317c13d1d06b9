"""Fused attention maps and their rank reduction (FaRR, docs/math.md §5).

Per KV group ``g`` the two linear paths of attention fuse into one map ``M = A @ B`` whose
inner dimension is the head dim:

* value path: ``A = [W_O^{h1}; W_O^{h2}; ...]`` (the O column blocks of the group's query heads,
  stacked as rows), ``B = W_V^g``. Each row block of ``M`` is one head's ``W_O^h W_V^g``.
* score path (exact only on dims RoPE leaves alone, and without QK-norm): per query head the
  augmented query map ``Q̃_h = [W_Q^h | b_Q^h]`` (``d_h × (d+1)``), ``A = [Q̃_{h1}ᵀ; Q̃_{h2}ᵀ; ...]``,
  ``B = W_K^g``; the score is ``[x_i; 1]ᵀ (Q̃_hᵀ W_K^g) x_j``. The key bias is left out on purpose:
  it adds ``q_i · b_K`` to every score of query i, a constant per softmax row, so it never matters
  (:func:`drop_key_bias`).

One basis per group (SVD of the stacked map) because GQA shares V and K across the group.
Truncating the SVD to rank r and splitting it back with ``√Σ`` on each side gives a layer whose
group head dim is r, with no extra matmul. Everything here works on canonical float64 layers
(see :mod:`hf_symmetry.architectures.adapter`) and returns new dicts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from ..symmetry.actions import NotASymmetry
from ..symmetry.layout import HeadLayout

Tensors = dict[str, torch.Tensor]
MapKind = Literal["vo", "qk"]
Basis = Literal["fused", "input", "output"]
# Relative slack when comparing cumulative energy with τ, so τ = 1 keeps every non-zero σ
# instead of failing on the last ulp of a float64 sum.
_ENERGY_SLACK = 1e-12


# ---------------------------------------------------------------------- fused maps
@dataclass(frozen=True)
class FusedPair:
    """``M = A @ B`` for one KV group: ``A`` is ``[blocks * m, k]`` (output side, one row block per
    query head), ``B`` is ``[k, n]`` (input side); ``k`` is the head dim the reduction shrinks."""

    A: torch.Tensor
    B: torch.Tensor
    blocks: int

    def fused(self) -> torch.Tensor:
        return self.A @ self.B

    def block(self, i: int) -> torch.Tensor:
        """The ``A`` rows of the group's i-th query head."""
        m = self.A.shape[0] // self.blocks
        return self.A[i * m : (i + 1) * m]


def vo_pair(layer: Tensors, layout: HeadLayout, group: int) -> FusedPair:
    """Value path of KV group ``group``: rows ``h`` blocks are ``W_O^h W_V^g``."""
    heads = layout.heads_of_group(group)
    A = torch.cat([layer["o.weight"][:, layout.rows(h)] for h in heads], dim=0)
    return FusedPair(A, layer["v.weight"][layout.rows(group)], len(heads))


def qk_fusion_blocker(layout: HeadLayout) -> str | None:
    """Why ``W_Qᵀ W_K`` is not this layer's score map, or None where QK fusion is exact."""
    if layout.qk_norm:
        return (
            "QK-norm normalises q and k per head before the dot product, so W_Q^T W_K is not the score map; "
            "only V/O can be fused"
        )
    if len(layout.nope_dims()) == 0:
        return (
            f"every query/key dim is rotated by RoPE (rotary dim {layout.rotary_dim} of head dim "
            f"{layout.head_dim}), so W_Q^T W_K depends on the position offset; only V/O can be fused"
        )
    return None


def qk_pair(layer: Tensors, layout: HeadLayout, group: int) -> FusedPair:
    """Score path of KV group ``group`` on the non-rotary dims: row block h is ``Q̃_hᵀ W_K^g``
    with ``Q̃_h = [W_Q^h | b_Q^h]`` (the bias column only when the layer has a query bias)."""
    reason = qk_fusion_blocker(layout)
    if reason:
        raise NotASymmetry(reason)
    dims = layout.nope_dims()
    blocks = []
    for h in layout.heads_of_group(group):
        q = layer["q.weight"][layout.rows(h)][dims]
        if "q.bias" in layer:
            q = torch.cat([q, layer["q.bias"][layout.rows(h)][dims, None]], dim=1)
        blocks.append(q.T)
    return FusedPair(torch.cat(blocks, dim=0), layer["k.weight"][layout.rows(group)][dims], len(blocks))


def group_pairs(layer: Tensors, layout: HeadLayout, path: MapKind) -> list[FusedPair]:
    make = vo_pair if path == "vo" else qk_pair
    return [make(layer, layout, g) for g in range(layout.n_kv_heads)]


# ---------------------------------------------------------------------- SVD and spectra
@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run small LAPACK factorisations on one thread: multi-threaded MKL QR/SVD of a [1728, 64]
    float64 matrix is ~100x slower than single-threaded on small machines (measured: 0.64 s vs
    4 ms on 2 cores), and these matrices are far too small to gain from threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass(frozen=True)
class FusedSVD:
    """Thin SVD ``A @ B = U diag(S) Vh`` with ``k`` singular values (``k`` = inner dim)."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor


def canonical_signs(U: torch.Tensor, Vh: torch.Tensor | None = None):
    """Singular vectors with a fixed sign: each column of ``U`` has its largest-magnitude entry
    positive (the matching row of ``Vh`` flips with it, so ``U diag(S) Vh`` is unchanged). An SVD
    fixes each pair only up to sign, and LAPACK on the CPU and cuSOLVER on a GPU choose differently:
    with this convention the factors a conversion writes are the same on every device."""
    pick = U.abs().argmax(0)
    s = torch.sign(U.gather(0, pick[None, :]))[0]
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (U * s[None, :], None if Vh is None else Vh * s[:, None])


def fused_svd(pair: FusedPair) -> FusedSVD:
    """SVD of ``A @ B`` without forming it: ``A = Q_a R_a``, ``Bᵀ = Q_b R_b``, then the SVD of the
    ``k × k`` core ``R_a R_bᵀ``. Cheaper and more accurate than an SVD of the ``d × d`` product."""
    A, B = pair.A.to(torch.float64), pair.B.to(torch.float64)
    k = A.shape[1]
    with single_threaded():
        if A.shape[0] < k or B.shape[1] < k:  # tall-skinny assumption fails: do it directly
            U, S, Vh = torch.linalg.svd(A @ B, full_matrices=False)
            U, Vh = canonical_signs(U[:, :k], Vh[:k])
            return FusedSVD(U, S[:k], Vh)
        Qa, Ra = torch.linalg.qr(A)
        Qb, Rb = torch.linalg.qr(B.T.contiguous())
        Uc, S, Vch = torch.linalg.svd(Ra @ Rb.T)
    U, Vh = canonical_signs(Qa @ Uc, Vch @ Qb.T)
    return FusedSVD(U, S, Vh)


def check_tau(tau: float) -> float:
    if not 0.0 < float(tau) <= 1.0:
        raise ValueError(f"energy threshold τ must be in (0, 1], got {tau}")
    return float(tau)


def cumulative_energy(S: torch.Tensor) -> torch.Tensor:
    """Fraction of ``Σ σ²`` kept by the top 1, 2, ... singular values (all zeros for a zero map)."""
    e = S.to(torch.float64) ** 2
    total = e.sum()
    return torch.cumsum(e, 0) / total if total > 0 else torch.zeros_like(e)


def effective_rank(S: torch.Tensor, tau: float) -> int:
    """Smallest r whose top-r singular values carry at least a fraction ``τ`` of the energy
    ``Σ σ²``; 0 for a zero map. ``τ = 1`` gives the numerical rank."""
    tau = check_tau(tau)
    cum = cumulative_energy(S)
    if cum.numel() == 0 or cum[-1] == 0:
        return 0
    hits = torch.nonzero(cum >= tau - _ENERGY_SLACK)
    return int(hits[0]) + 1 if hits.numel() else int(cum.numel())


def kept_energy(S: torch.Tensor, rank: int) -> float:
    """Fraction of the energy the top ``rank`` singular values keep (1 for a zero map)."""
    cum = cumulative_energy(S)
    if cum.numel() == 0 or cum[-1] == 0:
        return 1.0
    return 1.0 if rank >= cum.numel() else (float(cum[rank - 1]) if rank > 0 else 0.0)


def stable_rank(S: torch.Tensor) -> float:
    """``‖M‖_F² / ‖M‖_2²`` (0 for a zero map): a soft count of the significant directions."""
    top = float(S.max()) if S.numel() else 0.0
    return float((S.to(torch.float64) ** 2).sum()) / top**2 if top > 0 else 0.0


def alignment(pair: FusedPair, S: torch.Tensor | None = None) -> float:
    """``‖A B‖_F² / Σ_i σ_i(A)² σ_i(B)²`` in [0, 1]. The denominator is the most energy the product
    of two factors with these spectra can have (von Neumann's trace inequality), reached when
    ``A``'s right and ``B``'s left singular vectors line up. Low values mean the fused map is
    weaker (and often lower-rank) than either factor because their head-space subspaces disagree."""
    with single_threaded():
        sa = torch.linalg.svdvals(pair.A.to(torch.float64))
        sb = torch.linalg.svdvals(pair.B.to(torch.float64))
    k = min(sa.numel(), sb.numel())
    bound = float((sa[:k] ** 2 * sb[:k] ** 2).sum())
    fused = float((S**2).sum()) if S is not None else float(pair.fused().pow(2).sum())
    return fused / bound if bound > 0 else 0.0


@dataclass(frozen=True)
class GroupSpectrum:
    """Spectrum of one KV group's stacked fused map, with diagnostics when ``detail`` was asked."""

    group: int
    heads: list[int]
    S: torch.Tensor
    factor_S: tuple[torch.Tensor, torch.Tensor] | None = None  # σ(A) (output side), σ(B) (input side)
    alignment: float | None = None
    head_S: list[torch.Tensor] | None = None  # per query head (GQA: W_O^h W_V^g alone)


def group_spectra(
    layer: Tensors, layout: HeadLayout, path: MapKind, detail: bool = False, weights: "InputWeights | None" = None
) -> list[GroupSpectrum]:
    out = []
    for g, pair in enumerate(group_pairs(layer, layout, path)):
        if weights is not None:
            pair = weigh(pair, path, weights)
        S = fused_svd(pair).S
        if not detail:
            out.append(GroupSpectrum(g, list(layout.heads_of_group(g)), S))
            continue
        with single_threaded():
            factors = (torch.linalg.svdvals(pair.A), torch.linalg.svdvals(pair.B))
        heads = None
        if pair.blocks > 1:
            heads = [fused_svd(FusedPair(pair.block(i), pair.B, 1)).S for i in range(pair.blocks)]
        out.append(GroupSpectrum(g, list(layout.heads_of_group(g)), S, factors, alignment(pair, S), heads))
    return out


# ---------------------------------------------------------------------- splitting back
def balanced_split(svd: FusedSVD, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` truncation split as ``A' = U_r √Σ_r`` (``[m, r]``), ``B' = √Σ_r Vh_r`` (``[r, n]``);
    ``A' B'`` is the best rank-r approximation of the fused map (Eckart–Young)."""
    root = svd.S[:rank].sqrt()
    return svd.U[:, :rank] * root[None, :], root[:, None] * svd.Vh[:rank]


def factor_basis_split(
    pair: FusedPair, rank: int, side: Literal["input", "output"]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline: keep the head-space directions that matter most to ONE factor (its own SVD), not
    to the fused map: ``P`` = top-r left singular vectors of ``B`` (``side="input"``: W_V or W_K) or
    right singular vectors of ``A`` (``side="output"``: W_O or Q̃); returns ``(A P, Pᵀ B)``. Same
    shapes and parameter count as :func:`balanced_split`."""
    with single_threaded():
        if side == "input":
            P = torch.linalg.svd(pair.B, full_matrices=False)[0][:, :rank]
        else:
            P = torch.linalg.svd(pair.A, full_matrices=False)[2][:rank].T
    P = canonical_signs(P)[0]
    return pair.A @ P, P.T @ pair.B


# ---------------------------------------------------------------------- exact bias rewrites
def fold_value_bias(layer: Tensors, layout: HeadLayout) -> Tensors:
    """Move ``b_V`` into ``b_O``: head h adds ``Σ_j α_ij (W_O^h b_V^g) = W_O^h b_V^g`` because each
    softmax row sums to 1, so ``b_O <- b_O + Σ_h W_O^h b_V^{g(h)}`` and ``b_V`` goes away."""
    if "v.bias" not in layer:
        return dict(layer)
    out = dict(layer)
    bv = out.pop("v.bias")
    per_head = torch.cat([bv[layout.rows(layout.kv_group(h))] for h in range(layout.n_heads)])
    W_O = out["o.weight"]
    out["o.bias"] = out.get("o.bias", torch.zeros(W_O.shape[0], dtype=W_O.dtype)) + W_O @ per_head
    return out


def drop_key_bias(layer: Tensors, layout: HeadLayout) -> Tensors:
    """Remove ``b_K``: it adds ``q_i · b_K`` to every score of query i, the same for every key, and
    softmax is invariant to a per-row constant. Not so under RoPE (the term then depends on the
    key's position) or QK-norm."""
    if layout.rotary_dim or layout.qk_norm:
        raise NotASymmetry("the key bias can only be dropped without RoPE and QK-norm")
    return {k: v for k, v in layer.items() if k != "k.bias"}


# ---------------------------------------------------------------------- activation-aware metric
@dataclass(frozen=True)
class InputWeights:
    """Activation-aware metric (beyond the seed's data-free FaRR). With ``C = E[x xᵀ]`` the second
    moment of the attention input on calibration text, the value map is measured as
    ``‖M C^{1/2}‖_F = √E‖M x‖²`` and the score map as ``‖C̃^{1/2} M C^{1/2}‖_F`` with
    ``C̃ = E[[x;1][x;1]ᵀ]`` on the query side (it carries the bias column). Truncating the weighted
    map and unweighting minimises the expected output error on such inputs, still at rank r."""

    root: torch.Tensor
    inv_root: torch.Tensor
    root_aug: torch.Tensor | None
    inv_root_aug: torch.Tensor | None

    @classmethod
    def from_moments(
        cls, gram: torch.Tensor, mean: torch.Tensor, floor: float = 1e-10, augmented: bool = True
    ) -> "InputWeights":
        """``gram = E[x xᵀ]``, ``mean = E[x]``. Eigenvalues below ``floor · λ_max`` are lifted to it, so
        directions the data never visits still count a little (and the inverse stays bounded).
        ``augmented=False`` skips the query side's ``C̃`` roots (``None``; the value path never reads them)."""
        gram, mean = gram.to(torch.float64), mean.to(torch.float64)
        if not augmented:
            return cls(*_sym_roots(gram, floor), None, None)
        aug = torch.cat([torch.cat([gram, mean[:, None]], 1), torch.cat([mean, mean.new_ones(1)])[None]], 0)
        return cls(*_sym_roots(gram, floor), *_sym_roots(aug, floor))


def _sym_roots(C: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    with single_threaded():
        lam, Q = torch.linalg.eigh((C + C.T) / 2)
    lam = lam.clamp_min(floor * float(lam.max()))
    return (Q * lam.sqrt()) @ Q.T, (Q / lam.sqrt()) @ Q.T


def _side_root(w: InputWeights, n: int, inverse: bool = False) -> torch.Tensor:
    plain, aug = (w.inv_root, w.inv_root_aug) if inverse else (w.root, w.root_aug)
    return plain if plain.shape[0] == n else aug


def weigh(pair: FusedPair, path: MapKind, w: InputWeights) -> FusedPair:
    """The pair whose product is the weighted map (see :class:`InputWeights`)."""
    B = pair.B @ w.root
    if path == "vo":
        return FusedPair(pair.A, B, pair.blocks)
    m = pair.A.shape[0] // pair.blocks
    R = _side_root(w, m)
    return FusedPair(torch.cat([R @ pair.block(i) for i in range(pair.blocks)]), B, pair.blocks)


def unweigh(A: torch.Tensor, B: torch.Tensor, blocks: int, path: MapKind, w: InputWeights):
    """Undo :func:`weigh` on split factors ``A [blocks*m, r]``, ``B [r, n]``."""
    B = B @ w.inv_root
    if path == "vo":
        return A, B
    m = A.shape[0] // blocks
    R = _side_root(w, m, inverse=True)
    return torch.cat([R @ A[i * m : (i + 1) * m] for i in range(blocks)]), B


# ---------------------------------------------------------------------- reduction
@dataclass(frozen=True)
class PathReduction:
    rank: int
    kept_energy: list[float]  # per KV group, of the stacked fused map (weighted when calibrated)
    spectra: list[torch.Tensor]  # per KV group, the fused singular values


def _split(pair: FusedPair, path: MapKind, rank: int, basis: Basis, weights: InputWeights | None):
    """(A', B', σ, kept energy) of one group's rank-``rank`` truncation."""
    if basis not in ("fused", "input", "output"):
        raise ValueError(f"unknown basis {basis!r}; choose fused, input or output")
    if weights is not None:
        if basis != "fused":
            raise ValueError("calibrated (activation-aware) truncation uses the fused basis only")
        svd = fused_svd(weigh(pair, path, weights))
        A, B = unweigh(*balanced_split(svd, rank), pair.blocks, path, weights)
        return A, B, svd.S, kept_energy(svd.S, rank)
    svd = fused_svd(pair)
    if basis == "fused":
        return (*balanced_split(svd, rank), svd.S, kept_energy(svd.S, rank))
    A, B = factor_basis_split(pair, rank, basis)
    total = float((svd.S**2).sum())  # baselines: measure what the factor split actually keeps
    err = float((pair.fused() - A @ B).pow(2).sum())
    return A, B, svd.S, (1.0 - err / total if total > 0 else 1.0)


def reduce_vo(
    layer: Tensors, layout: HeadLayout, rank: int, basis: Basis = "fused", weights: InputWeights | None = None
) -> tuple[Tensors, PathReduction]:
    """Value/output head dim -> ``rank`` in every KV group (one basis per group). ``b_V`` is folded
    into ``b_O`` first. The result's ``v.weight`` is ``[n_kv * rank, d]``, ``o.weight`` ``[d, n_heads * rank]``."""
    _check_rank(rank, layout.head_dim)
    layer = fold_value_bias(layer, layout)
    v_rows, o_cols, kept, spectra = [None] * layout.n_kv_heads, [None] * layout.n_heads, [], []
    for g in range(layout.n_kv_heads):
        pair = vo_pair(layer, layout, g)
        A, B, S, k = _split(pair, "vo", rank, basis, weights)
        v_rows[g] = B
        m = A.shape[0] // pair.blocks
        for i, h in enumerate(layout.heads_of_group(g)):
            o_cols[h] = A[i * m : (i + 1) * m]
        kept.append(k)
        spectra.append(S)
    out = dict(layer)
    out["v.weight"] = torch.cat(v_rows, dim=0)
    out["o.weight"] = torch.cat(o_cols, dim=1)
    return out, PathReduction(rank, kept, spectra)


def reduce_qk(
    layer: Tensors, layout: HeadLayout, rank: int, basis: Basis = "fused", weights: InputWeights | None = None
) -> tuple[Tensors, PathReduction]:
    """Query/key head dim -> ``rank`` in every KV group; only where QK fusion is exact and every
    head dim is non-rotary (a partially rotary head would need a mixed [rotary | reduced] layout).
    ``b_K`` is dropped (exact, see :func:`drop_key_bias`); ``b_Q`` rides along as the bias column."""
    reason = qk_fusion_blocker(layout)
    if reason or layout.rotary_dim:
        raise NotASymmetry(reason or "QK reduction of partially rotary heads is not supported")
    _check_rank(rank, layout.head_dim)
    layer = drop_key_bias(layer, layout)
    has_bias = "q.bias" in layer
    q_rows, k_rows, kept, spectra = [None] * layout.n_heads, [None] * layout.n_kv_heads, [], []
    for g in range(layout.n_kv_heads):
        pair = qk_pair(layer, layout, g)
        A, B, S, k = _split(pair, "qk", rank, basis, weights)
        k_rows[g] = B
        m = A.shape[0] // pair.blocks
        for i, h in enumerate(layout.heads_of_group(g)):
            q_rows[h] = A[i * m : (i + 1) * m].T  # [rank, d (+1)]
        kept.append(k)
        spectra.append(S)
    out = dict(layer)
    q = torch.cat(q_rows, dim=0)
    out["q.weight"] = q[:, :-1].contiguous() if has_bias else q
    if has_bias:
        out["q.bias"] = q[:, -1].contiguous()
    out["k.weight"] = torch.cat(k_rows, dim=0)
    return out, PathReduction(rank, kept, spectra)


def _check_rank(rank: int, head_dim: int) -> None:
    if not 1 <= rank <= head_dim:
        raise ValueError(f"rank must be between 1 and the head dim {head_dim}, got {rank}")
