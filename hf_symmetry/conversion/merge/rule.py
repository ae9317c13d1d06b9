"""The merge rule (:class:`MergeRule`): one merge method (:class:`~.methods.MergeMethod`) applied to
canonical tensors, a layer, the globals or a tensor outside the layout at a time, with the statistics
(Fishers, Grams) it needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...architectures import Adapter
from ..match.residual import with_lm_head
from ..stream import TensorSource, partition_keys
from .methods import MergeMethod
from .tensor_rules import RegMeanSolver
from .recipe import ModelEntry
from .merge_pass import GRAM_OF

Tensors = dict[str, torch.Tensor]


@dataclass
class MergeRule:
    """One merge method applied to canonical tensors. Participants are the merged models, then
    the base (``has_base``). ``fishers`` (per model, tensor sources keyed like the state dict) and
    ``grams`` (per model, canonical keys) must already be in the anchor's frame."""

    method: MergeMethod
    params: dict
    entries: list[ModelEntry]
    has_base: bool
    adapter: Adapter
    fishers: list[TensorSource] | None = None
    grams: list[Tensors] | None = None
    device: torch.device = torch.device("cpu")  # where RegMean's solves run (results come back to the CPU)
    _parts: list | None = field(default=None, repr=False)  # the Fisher sources' keys per layer
    _solvers: dict = field(default_factory=dict, repr=False)  # RegMean: Gram key -> factored system

    @property
    def row_separable(self) -> bool:
        """Whether each row of a tensor is merged on its own (the globals can go a block of rows at a time)."""
        return self.method.row_separable

    def set_grams(self, grams: list[Tensors] | None) -> None:
        self.grams, self._solvers = grams, {}

    @property
    def weights(self) -> list[float]:
        return [e.weight for e in self.entries]

    def combine(self, tensors: list[torch.Tensor], fishers: list[torch.Tensor] | None = None) -> torch.Tensor:
        models, base = (tensors[:-1], tensors[-1]) if self.has_base else (tensors, None)
        return self.method.combine(models, base, self.entries, self.params, fishers)

    def _merge_dict(self, parts: list[Tensors], fishers: list[Tensors] | None, gram_key) -> Tensors:
        out = {}
        for key in parts[0]:
            tensors = [p[key] for p in parts]
            gkey = gram_key(key)
            if self.method.uses_grams and gkey is not None:  # factored once, e.g. for every block of the LM head
                try:
                    if gkey not in self._solvers:
                        self._solvers[gkey] = RegMeanSolver(
                            [g[gkey] for g in self.grams], self.weights, self.params["alpha"], self.device
                        )
                    out[key] = self._solvers[gkey].solve(tensors[: len(self.entries)]).cpu()
                except ValueError as exc:
                    raise ValueError(f"{gkey}: {exc}") from None
            else:
                out[key] = self.combine(tensors, [f[key] for f in fishers] if fishers else None)
        return out

    def _fisher_parts(self) -> list:
        if self._parts is None:
            self._parts = [partition_keys(self.adapter, f.keys()) for f in self.fishers]
        return self._parts

    def layer(self, i: int, layers: list[Tensors]) -> Tensors:
        fishers = None
        if self.method.uses_fishers:
            fishers = [
                self.adapter.read_layer(i, f.get(part[1][i])) for f, part in zip(self.fishers, self._fisher_parts())
            ]
        return self._merge_dict(layers, fishers, lambda key: f"layers.{i}.{GRAM_OF[key]}" if key in GRAM_OF else None)

    def globals(self, gs: list[Tensors]) -> Tensors:
        fishers = None
        if self.method.uses_fishers:
            fishers = [self.adapter.read_globals(f.get(part[0])) for f, part in zip(self.fishers, self._fisher_parts())]
            if "lm_head.weight" in gs[0]:
                fishers = [with_lm_head(f, self.adapter) for f in fishers]
        return self._merge_dict(gs, fishers, lambda key: "head_in" if key == "lm_head.weight" else None)

    def rest(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Tensors outside the adapter's layout (buffers, task heads): merged element-wise;
        integer buffers must agree."""
        if not tensors[0].is_floating_point():
            if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
                raise ValueError(f"integer tensor {key} differs between the inputs; cannot merge it")
            return tensors[0]
        fishers = None
        if self.method.uses_fishers:
            found = [f.get([key])[key] if key in set(f.keys()) else None for f in self.fishers]
            fishers = (
                found if all(f is not None for f in found) else [torch.ones_like(t) for t in tensors[: len(found)]]
            )
        return self.combine(tensors, fishers).to(tensors[0].dtype)
