"""Rank selection: per layer and path, from the spectra, either the largest per-group effective rank
at τ or a global parameter budget spent greedily on the increments that keep the most relative
energy per parameter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...solvers import fused
from .analysis import LayerAnalysis
from .options import FarrOptions
from .target import FarrTarget


@dataclass
class RankPlan:
    ranks: dict[str, list[int | None]]  # path -> rank per layer (None: the layer keeps that path whole)
    touchable_before: int  # parameters of the rewritten projections, original
    touchable_after: int  # ... and in the FaRR model

    @property
    def kept_fraction(self) -> float:
        return self.touchable_after / self.touchable_before


def ranks_for_tau(analysis: list[LayerAnalysis], path: str, tau: float) -> list[int | None]:
    """Per layer: the largest per-group effective rank at τ (at least 1); None where the layer's
    ``path`` cannot be reduced."""
    return [
        max([1] + [fused.effective_rank(g.S, tau) for g in a.spectra[path]]) if path in a.spectra else None
        for a in analysis
    ]


def plan_ranks(analysis: list[LayerAnalysis], options: FarrOptions, target: FarrTarget) -> RankPlan:
    paths = options.paths
    before = sum(a.touchable.get(p, 0) for a in analysis for p in paths)
    if options.tau is not None:
        ranks = {p: ranks_for_tau(analysis, p, options.tau) for p in paths}
    else:
        ranks = _ranks_for_budget(analysis, paths, target, int(options.params_fraction * before), before)
    after = sum(target.path_params(p, r) for p in paths for r in ranks[p] if r is not None)
    return RankPlan(ranks, before, after)


def _ranks_for_budget(
    analysis: list[LayerAnalysis], paths: tuple[str, ...], target: FarrTarget, budget: int, before: int
) -> dict[str, list[int]]:
    """Greedy on the marginal gain per parameter. A rank increment r -> r+1 of a layer's path gains
    the mean over its groups of ``σ_{r+1}² / Σσ²`` (relative energy, so every layer counts alike) and
    costs a fixed number of parameters; gains fall with r, so taking increments in order of gain per
    parameter keeps each layer's choice a prefix."""
    ranks = {p: [1 if p in a.spectra else None for a in analysis] for p in paths}
    spent = sum(target.path_params(p, 1) for p in paths for r in ranks[p] if r is not None)
    if spent > budget:
        raise ValueError(
            f"the parameter budget ({budget:,} of {before:,}) removes everything: the smallest FaRR model "
            f"(rank 1 in every layer) keeps {spent:,} ({spent / before:.2%}); raise --params-fraction"
        )
    units = []
    for a in analysis:
        for p in a.spectra:
            cost = target.path_params(p, 2) - target.path_params(p, 1)
            for r in range(1, target.head_dim):
                gain = sum(_rel_energy(g.S, r) for g in a.spectra[p]) / len(a.spectra[p])
                if gain > 0:
                    units.append((-gain / cost, a.layer, p, r, cost))
    closed: set[tuple[int, str]] = set()
    for _, layer, p, r, cost in sorted(units):
        if (layer, p) in closed or ranks[p][layer] != r:
            continue
        if spent + cost > budget:
            closed.add((layer, p))  # later increments of this layer would break the prefix
            continue
        ranks[p][layer] = r + 1
        spent += cost
    return ranks


def _rel_energy(S: torch.Tensor, index: int) -> float:
    total = float((S**2).sum())
    return float(S[index] ** 2) / total if total > 0 and index < S.numel() else 0.0
