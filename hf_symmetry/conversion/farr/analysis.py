"""The analysis pass: each layer's fused maps and their singular values, one layer in memory at a
time (data-free: pre-norm γ folded; with input weights: measured on the module's actual input)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...solvers import fused
from ...symmetry.actions import fold_layer_norms
from ..layer_parts import ffn_modules, module_of, read_part, stand_ins
from ..stream import Tensors, TensorSource, partition_keys
from .target import qk_fusable


def prepare_layer(layer: Tensors, adapter: Adapter) -> Tensors:
    """Fold the pre-norms' γ (and β) into their readers, so the fused maps act on the normalised
    stream. Post-LN encoders read the residual stream itself: nothing to fold."""
    return fold_layer_norms(layer) if adapter.spec.norm_position == "pre" else layer


@dataclass
class LayerAnalysis:
    layer: int
    spectra: dict[str, list[fused.GroupSpectrum]]  # only the paths FaRR can reduce in this layer
    touchable: dict[str, int]  # parameters of the original projections of each of those paths


_PATH_TENSORS = {"vo": ("v.weight", "v.bias", "o.weight", "o.bias"), "qk": ("q.weight", "q.bias", "k.weight", "k.bias")}


def analyze(
    source: TensorSource,
    adapter: Adapter,
    paths: tuple[str, ...],
    detail: bool = False,
    progress: bool = True,
    weights=None,
    device: torch.device | str = "cpu",
) -> list[LayerAnalysis]:
    """Spectra of every layer's fused maps, one layer in memory at a time (SVDs on ``device``). With
    ``weights`` (calibration; ``weights[i]`` is layer i's :class:`fused.InputWeights`), the maps are
    measured on the module's actual input, so γ is not folded."""
    _, per_layer, _ = partition_keys(adapter, source.keys())
    shapes, ffn = source.shapes(), ffn_modules(adapter)
    out = []
    for i in tqdm(range(adapter.n_layers), desc="fused spectra", disable=not progress, unit="layer"):
        # the attention and the norms (γ folds into q/k/v); the FFN is never read
        keys = [k for k in per_layer[i] if module_of(adapter, i, k) not in ffn]
        layer = read_part(adapter, i, stand_ins(per_layer[i], shapes), source.get(keys), torch.float64)
        out.append(
            analyze_layer(i, layer, adapter, paths, detail, weights_to(weights[i], device) if weights else None, device)
        )
        del layer
    return out


def analyze_layer(
    i: int,
    layer: Tensors,
    adapter: Adapter,
    paths: tuple[str, ...],
    detail: bool = False,
    w: fused.InputWeights | None = None,
    device: torch.device | str = "cpu",
) -> LayerAnalysis:
    """Spectra of layer ``i``'s fused maps (canonical tensors), computed on ``device`` (with ``w`` there
    too), returned on the CPU."""
    layer = prepare_layer(layer, adapter) if w is None else layer
    touchable = {p: sum(layer[k].numel() for k in _PATH_TENSORS[p] if k in layer) for p in paths}
    layer = {k: v.to(device) for k, v in layer.items()}
    layout = adapter.layer_layout(i)
    here = [p for p in paths if p == "vo" or qk_fusable(layout)]
    spectra = {p: [_spectrum_to_cpu(g) for g in fused.group_spectra(layer, layout, p, detail, w)] for p in here}
    return LayerAnalysis(i, spectra, {p: touchable[p] for p in here})


def _spectrum_to_cpu(g: fused.GroupSpectrum) -> fused.GroupSpectrum:
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return dataclasses.replace(
        g,
        S=cpu(g.S),
        factor_S=None if g.factor_S is None else tuple(map(cpu, g.factor_S)),
        head_S=None if g.head_S is None else [cpu(t) for t in g.head_S],
    )


def weights_to(w: fused.InputWeights, device) -> fused.InputWeights:
    return fused.InputWeights(
        *(None if t is None else t.to(device) for t in (w.root, w.inv_root, w.root_aug, w.inv_root_aug))
    )
