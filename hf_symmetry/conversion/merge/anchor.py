"""The anchor every other input is matched to (:func:`choose_anchor`): the recipe's, else the base, else
the input nearest the mean of all inputs (:func:`distances_to_mean`)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ..match.residual import with_lm_head
from ..stream import TensorSource, partition_keys

Tensors = dict[str, torch.Tensor]


def distances_to_mean(sources: list[TensorSource], adapter: Adapter, progress: bool = True) -> list[float]:
    """``‖θ_j − mean‖²`` of every input (one streaming pass)."""
    parts = [partition_keys(adapter, s.keys()) for s in sources]
    out = [0.0] * len(sources)

    def accumulate(dicts: list[Tensors]) -> None:
        for key in dicts[0]:
            mean = sum(d[key].to(torch.float64) for d in dicts) / len(dicts)
            for j, d in enumerate(dicts):
                out[j] += (d[key].to(torch.float64) - mean).pow(2).sum().item()

    accumulate([with_lm_head(adapter.read_globals(s.get(p[0])), adapter) for s, p in zip(sources, parts)])
    for i in tqdm(range(adapter.n_layers), desc="anchor", disable=not progress, unit="layer"):
        accumulate([adapter.read_layer(i, s.get(p[1][i])) for s, p in zip(sources, parts)])
    return out


def choose_anchor(
    sources: list[TensorSource],
    names: list[str],
    adapter: Adapter,
    anchor: str,
    has_base: bool,
    n_models: int,
    progress: bool,
) -> tuple[int, dict]:
    """The recipe's anchor, else the base, else the model nearest the mean (the first of two:
    both are equally far from their mean)."""
    if anchor != "auto":
        return names.index(anchor), {}
    if has_base:
        return len(sources) - 1, {}
    if n_models == 2:
        return 0, {}
    d = distances_to_mean(sources[:n_models], adapter, progress)
    return min(range(n_models), key=d.__getitem__), dict(zip(names, d))
