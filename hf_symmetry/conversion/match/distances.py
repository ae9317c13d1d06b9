"""How far a model is from the anchor: squared Frobenius distances per component (QK, VO, FFN, norms,
embeddings), before and after matching, in total and per layer (:class:`MatchDistances`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

Tensors = dict[str, torch.Tensor]

COMPONENTS = ("qk", "vo", "ffn", "norms", "embeddings")
_LAYER_COMPONENT = {"q": "qk", "k": "qk", "v": "vo", "o": "vo", "gate": "ffn", "up": "ffn", "down": "ffn"}


def component_of(key: str, is_global: bool = False) -> str:
    return "embeddings" if is_global else _LAYER_COMPONENT.get(key.split(".")[0], "norms")


def _sq(t: torch.Tensor) -> float:
    v = t.reshape(-1)
    return torch.dot(v, v).item()  # BLAS: much faster than pow().sum() on large tensors


def squared_distances(anchor: Tensors, source: Tensors, is_global: bool = False) -> dict[str, float]:
    """Squared Frobenius distance per component over the tensors both dicts hold."""
    out = dict.fromkeys(COMPONENTS, 0.0)
    seen: dict[tuple[int, int], float] = {}  # a tied head aliases the embedding: one subtraction
    for key in sorted(anchor.keys() & source.keys()):  # sorted: the sums do not depend on the hash seed
        a, s = anchor[key], source[key]
        if (id(a), id(s)) not in seen:
            seen[id(a), id(s)] = _sq(a.to(torch.float64) - s.to(torch.float64))
        out[component_of(key, is_global)] += seen[id(a), id(s)]
    return out


def squared_norms(tensors: Tensors, is_global: bool = False) -> dict[str, float]:
    out = dict.fromkeys(COMPONENTS, 0.0)
    seen: dict[int, float] = {}
    for key, t in tensors.items():
        if id(t) not in seen:
            seen[id(t)] = _sq(t.to(torch.float64))
        out[component_of(key, is_global)] += seen[id(t)]
    return out


@dataclass
class MatchDistances:
    """Squared distances to the anchor per component, before and after matching, and the anchor's
    squared norms (for relative figures)."""

    before: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    after: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    anchor: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    layers: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # i -> (before, after, anchor)

    def add(
        self, anchor: Tensors, before: Tensors, after: Tensors, is_global: bool = False, layer: int | None = None
    ) -> None:
        d_before = squared_distances(anchor, before, is_global)
        d_after = d_before if after is before else squared_distances(anchor, after, is_global)
        rows = (
            d_before,
            d_after,
            squared_norms({k: anchor[k] for k in sorted(anchor.keys() & after.keys())}, is_global),
        )
        for total, new in zip((self.before, self.after, self.anchor), rows):
            for k, v in new.items():
                total[k] += v
        if layer is not None:
            self.layers[layer] = tuple(sum(r.values()) for r in rows)

    def per_layer(self) -> list[dict]:
        """Relative distance ``‖source − anchor‖ / ‖anchor‖`` of each layer, before and after."""
        return [
            {
                "layer": i,
                "relative_before": math.sqrt(b / n) if n > 0 else 0.0,
                "relative_after": math.sqrt(a / n) if n > 0 else 0.0,
            }
            for i, (b, a, n) in sorted(self.layers.items())
        ]

    def summary(self) -> dict:
        """Per component and in total: squared distance before/after, reduction, relative distance
        after (``‖source − anchor‖ / ‖anchor‖``)."""
        rows = {}
        for comp in (*COMPONENTS, "total"):
            b = sum(self.before.values()) if comp == "total" else self.before[comp]
            a = sum(self.after.values()) if comp == "total" else self.after[comp]
            n = sum(self.anchor.values()) if comp == "total" else self.anchor[comp]
            if comp != "total" and n == 0 and b == 0:
                continue
            rows[comp] = {
                "before": b,
                "after": a,
                "reduction": (1 - a / b) if b > 0 else 0.0,
                "relative_before": math.sqrt(b / n) if n > 0 else 0.0,
                "relative_after": math.sqrt(a / n) if n > 0 else 0.0,
            }
        return rows
