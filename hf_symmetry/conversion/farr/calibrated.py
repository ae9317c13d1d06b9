"""The calibrated analysis: the layer-wise calibration engine measures each layer's attention input,
whose moments become that layer's activation-aware metric (:class:`fused.InputWeights`) and its
spectra (:func:`calibrated_analysis`); :class:`LayerWeights` keeps the metrics for the reduction
pass, on disk one layer at a time. :func:`attention_input_moments` gives the raw moments."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...calibration import CalibrationEngine, StatsRequest, token_batches
from ...devices import linalg_device
from ...solvers import fused
from ..layer_parts import attention_modules, module_of, read_part, stand_ins
from ..stream import DictSource, partition_keys
from .analysis import LayerAnalysis, analyze_layer


class LayerWeights:
    """Each layer's activation-aware metric (:class:`fused.InputWeights`), from the calibration pass
    to the reduction pass: in safetensors files in ``folder`` (one layer in memory at a time), or
    in memory when ``folder`` is None (the in-memory API). ``weights[i]`` reads layer i's."""

    _FIELDS = ("root", "inv_root", "root_aug", "inv_root_aug")

    def __init__(self, folder: str | Path | None = None):
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._memory: dict[int, fused.InputWeights] = {}
        self._layers: set[int] = set()

    @classmethod
    def from_moments(
        cls, moments: dict[int, tuple[torch.Tensor, torch.Tensor]], augmented: bool, device: torch.device | str = "cpu"
    ) -> "LayerWeights":
        """In memory, from per layer ``(E[xxᵀ], E[x])`` (:func:`attention_input_moments`), moved to ``device``;
        ``augmented``: with the bias-augmented metric the score path needs."""
        weights = cls()
        for i, m in moments.items():
            weights.put(i, fused.InputWeights.from_moments(*(t.to(device) for t in m), augmented=augmented))
        return weights

    def _file(self, i: int) -> Path:
        return self.folder / f"layer-{i:05d}.safetensors"

    def put(self, i: int, w: fused.InputWeights) -> None:
        tensors = {f: getattr(w, f).cpu().contiguous() for f in self._FIELDS if getattr(w, f) is not None}
        if self.folder is None:
            self._memory[i] = fused.InputWeights(**{f: tensors.get(f) for f in self._FIELDS})
        else:
            save_file(tensors, self._file(i))
        self._layers.add(i)

    def __getitem__(self, i: int) -> fused.InputWeights:
        if self.folder is None:
            return self._memory[i]

        tensors = load_file(self._file(i))
        return fused.InputWeights(**{f: tensors.get(f) for f in self._FIELDS})

    def __len__(self) -> int:
        return len(self._layers)

    def close(self) -> None:
        """Delete the files (the folder)."""
        self._memory.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def calibrated_analysis(
    model,
    ids: torch.Tensor,
    paths: tuple[str, ...],
    placement=None,
    progress: bool = False,
    detail: bool = False,
    store: LayerWeights | None = None,
    window: int = 512,
) -> list[LayerAnalysis]:
    """The calibrated first pass, in one run of the layer-wise calibration engine: per layer, the
    attention input's moments ``E[x xᵀ]``, ``E[x]`` over ``ids`` (windows of ``window`` tokens)
    become its :class:`fused.InputWeights` (eigendecompositions in float64 on ``placement``'s
    device), then that layer's fused spectra; with ``store`` the weights are kept there for the
    reduction pass. Nothing but the spectra outlives a layer.

    ``model``: an HF model folder, an in-memory model, or the :class:`CalibrationEngine` of a tensor source
    (which then sets the placement and progress)."""
    engine = model if isinstance(model, CalibrationEngine) else _engine(model, None, placement, progress)
    device = linalg_device(engine.placement)
    engine.stats_device = device
    adapter = engine.adapter
    _, per_layer, _ = partition_keys(adapter, engine.keys)
    window = min(window, engine.config.get("max_position_embeddings") or window)
    run = engine.start(token_batches(ids, window))
    shapes = engine.source.shapes()
    out = []
    for step in run.layers(StatsRequest(grams=("v_in",), sums=("v_in",))):
        step.release()  # its outputs are handed on: free the engine's layer before this layer's work
        i = step.index
        w = fused.InputWeights.from_moments(
            step.stats.second_moment("v_in"), step.stats.mean("v_in"), augmented="qk" in paths
        )
        del step
        # only the attention's tensors are read (the rest of the layer stands in on the meta device)
        keys = [k for k in per_layer[i] if module_of(adapter, i, k) in attention_modules(adapter)]
        layer = {
            k: t
            for k, t in read_part(
                adapter, i, stand_ins(per_layer[i], shapes), engine.source.get(keys), torch.float64
            ).items()
            if k.split(".")[0] in ("q", "k", "v", "o")
        }
        out.append(analyze_layer(i, layer, adapter, paths, detail, w, device))
        if store is not None:
            store.put(i, w)
        del w, layer
    return out


def _engine(model, config, placement, progress):
    if isinstance(model, (str, Path)) or config is not None:
        return CalibrationEngine(model, config, placement=placement, progress=progress)
    return CalibrationEngine(
        DictSource(model.state_dict()), model.config.to_dict(), placement=placement, progress=progress
    )


def attention_input_moments(
    model, ids: torch.Tensor, window: int = 512, placement=None, progress: bool = False, config: dict | None = None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(E[x xᵀ], E[x])`` of the attention input x (what q/k/v read: the pre-norm's
    output, γ included, or the residual stream of post-LN encoders) over ``ids`` in windows of
    ``window`` tokens, in float64.

    ``model``: an HF model folder (the calibration engine reads one layer at a time; the model is
    never loaded whole), a tensor source with its ``config``, or an in-memory model.
    ``placement``: device and calibration dtype (:func:`hf_symmetry.devices.resolve`)."""
    engine = _engine(model, config, placement, progress)
    window = min(window, engine.config.get("max_position_embeddings") or window)
    result = engine.collect(token_batches(ids, window), StatsRequest(grams=("v_in",), sums=("v_in",)))
    return {i: (s.second_moment("v_in"), s.mean("v_in")) for i, s in enumerate(result.layers)}
