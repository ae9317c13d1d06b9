"""The layer-wise calibration engine: statistics of a checkpoint's activations with one decoder
layer in memory at a time, on any device.

How it runs (the scheme of GPTQ, SliceGPT and ProcrustesGPT):

1. The model is instantiated *empty* (accelerate's ``init_empty_weights``: parameters on the meta
   device, buffers such as rotary frequencies real), so the family's own transformers classes are
   used and nothing is hand-written. Only the input embeddings (token, position, token-type
   embeddings and their norm) are read from the checkpoint.
2. Every decoder layer is swapped for a catcher, and the calibration batches are run through the
   model's own forward: it embeds the tokens and builds the rotary tables and attention masks
   exactly as in an ordinary forward; the catchers record, per batch and layer, the arguments the
   model passes to each layer, and the first layer's input (the embeddings).
3. Layer by layer: the layer's weights are read from the checkpoint (``CheckpointReader`` or any
   tensor source), the layer is built as the family's decoder-layer module on the device, every
   batch runs through it with its recorded arguments while forward hooks feed the statistics
   collector (:mod:`hf_symmetry.calibration.statistics`), and the outputs are handed on as the
   next layer's inputs. The layer is then dropped.

Memory: one layer's weights, the calibration activations (``tokens × hidden`` in the calibration
dtype, twice while a layer runs; on the device when they fit, else in host memory and moved per
batch), the embeddings while step 2 runs, and the statistics the caller keeps.

**Sequential mode.** :meth:`CalibrationRun.layers` yields a :class:`LayerStep` per layer once its
statistics are collected; :meth:`LayerStep.replace` gives the converted layer (any module that
takes the same arguments), whose outputs are then handed on instead of the original layer's, so
layer ``k+1``'s statistics come from the model whose layers ``≤ k`` are converted.
:meth:`LayerStep.collect` re-collects statistics with a partly converted module on the same inputs
(for schemes finer than a layer). With ``carry_original=True`` the original model's stream is
carried alongside, for cross moments against the original (``StatsRequest.cross``) and targets.

Typical use::

    engine = CalibrationEngine("path/to/model", placement=devices.resolve("auto", "float32"))
    result = engine.collect(token_batches(ids, 512), StatsRequest(grams=("attn_in",)))
    result.layers[3].grams["attn_in"]          # Σ xᵀx of layer 3's attention input, float64

    run = engine.start(batches, carry_original=True)
    for step in run.layers(StatsRequest(grams=("normed:layer_in",), cross=(("o_in", "o_in"),))):
        step.replace(convert(step.index, step.module, step.stats))
    final = run.final(StatsRequest(grams=("head_in",)))

Where it lives: :mod:`.model` builds the empty model and materialises layers on the device
(:class:`~.model.CalibrationModel`); this module runs the embedding pass (step 2;
:class:`CalibrationEngine`, a :class:`~.model.CalibrationModel`); :mod:`.capture` holds the layer
catcher and the host-side rotary tables that pass uses; :mod:`.run` the layer-by-layer loop (step 3 and
the sequential mode: :class:`CalibrationRun`, :class:`LayerStep`, :class:`Activations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from accelerate.utils import set_module_tensor_to_device
from tqdm.auto import tqdm

from ..devices import Placement, to_model
from .capture import Catcher, Stop, rotary_on_host, undo_rotary
from .memory import return_large_blocks_at_once
from .model import CalibrationModel
from .run import Activations, CalibrationRun, LayerStep
from .statistics import LayerStats, StatsRequest

__all__ = ["CalibrationEngine", "CalibrationResult"]


@dataclass
class CalibrationResult:
    """Statistics of every layer (``layers[i]``, ``None`` where not collected) and after the last
    layer (``final``, when asked for)."""

    layers: list[LayerStats | None]
    final: LayerStats | None = None
    tokens: int = 0


class CalibrationEngine(CalibrationModel):
    """Layer-wise calibration over a checkpoint (see the module docstring).

    ``source``: an HF model folder (read with :class:`hf_symmetry.checkpoint_io.CheckpointReader`)
    or any tensor source with ``keys()``/``get(names)`` (e.g. an in-memory state dict wrapped in
    :class:`hf_symmetry.conversion.stream.DictSource`) together with its ``config`` (dict).
    ``placement``: the checked device and calibration dtype (:func:`hf_symmetry.devices.resolve`;
    default CPU float32). ``stats_device``: where statistics accumulate (default: the CPU, so the
    caller's statistics never take device memory; pass the device for GPU-side solvers).
    ``device_activation_fraction``: share of the free device memory calibration activations may
    take before they are kept in host memory instead (CUDA only)."""

    def __init__(
        self,
        source,
        config: dict | None = None,
        placement: Placement | None = None,
        progress: bool = True,
        stats_device: torch.device | str | None = "cpu",
        device_activation_fraction: float = 0.5,
        attn_implementation: str | None = None,
    ):
        super().__init__(source, config, placement, progress, stats_device, attn_implementation)
        self.device_activation_fraction = device_activation_fraction
        # a layer's freed activations and temporaries go back to the OS at once, not into the heap's
        # high-water mark (see hf_symmetry.calibration.memory)
        return_large_blocks_at_once()

    # ------------------------------------------------------------------ running
    def start(self, batches: list[torch.Tensor], carry_original: bool = False) -> "CalibrationRun":
        """Embed ``batches`` (``[batch, seq]`` token ids, :func:`~hf_symmetry.calibration.data.token_batches`)
        with the model's own forward, recording each layer's arguments; returns the run, positioned
        before layer 0."""
        if not batches:
            raise ValueError("no calibration batches")
        model = self.skeleton()
        layers = self._layers_list(model)
        originals = list(layers)
        record_per_batch: list[dict] = []
        embed_keys = self.adapter.input_global_keys(self.keys)
        embedded = []
        # materialise the input-side globals of the skeleton in place, and drop them afterwards

        params = dict(model.named_parameters())
        token_key = f"{self.adapter.prefix}{self.adapter.spec.embed}.weight"
        loaded = []
        if token_key in embed_keys and hasattr(self.source, "get_rows") and self.device.type == "cpu":
            # only the rows of the calibration tokens are read (and ever looked up); the others stay
            # untouched pages of an uninitialised tensor, so host memory holds a few thousand rows,
            # not the vocabulary
            used = torch.unique(torch.cat([b.reshape(-1) for b in batches]))
            shape = params[token_key].shape
            table = torch.empty(shape, dtype=self.dtype)
            table[used] = self.source.get_rows(token_key, used).to(self.dtype)
            set_module_tensor_to_device(model, token_key, self.device, value=table)
            loaded.append(token_key)
            embed_keys = [k for k in embed_keys if k != token_key]
        tensors = self.source.get(embed_keys)
        for k, t in tensors.items():
            if k in params:
                set_module_tensor_to_device(model, k, self.device, value=t, dtype=self.dtype)
                loaded.append(k)
        del tensors
        moved = []
        for n, b in list(model.named_buffers()):
            if b.device.type != "meta" and not n.startswith(self.adapter.prefix + self.adapter.spec.layers + "."):
                moved.append((n, b))
                set_module_tensor_to_device(model, n, self.device, value=b)
        host_rotary = rotary_on_host(model) if self.exact else []
        try:
            for batch in tqdm(batches, desc="calibration: embed", disable=not self.progress, unit="batch", leave=False):
                record: dict = {}
                for i in range(len(originals)):
                    layers[i] = Catcher(i, originals[i], record, last=(i == len(originals) - 1))
                try:
                    with torch.no_grad(), self.precision():
                        model(input_ids=to_model(batch, model), use_cache=False)
                except Stop:
                    pass
                finally:
                    for i in range(len(originals)):
                        layers[i] = originals[i]
                if "input" not in record:
                    raise RuntimeError(f"{type(model).__name__}: the forward never reached its first layer")
                embedded.append(record.pop("input").detach())
                record_per_batch.append(record)
        finally:
            undo_rotary(host_rotary)
            for k in loaded:  # back to meta: the embeddings are not kept
                set_module_tensor_to_device(model, k, "meta")
            for n, b in moved:
                set_module_tensor_to_device(model, n, "cpu", value=b.cpu())
        return CalibrationRun(self, batches, record_per_batch, self._place(embedded), carry_original)

    def _place(self, acts: list[torch.Tensor]) -> Activations:
        """Keep activations on the device when they fit in its budget, else in host memory."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            size = sum(t.numel() * t.element_size() for t in acts)
            if 3 * size > self.device_activation_fraction * free:  # inputs, outputs and one spare
                return Activations([t.to("cpu") for t in acts])
        return Activations(acts)

    def collect(
        self,
        batches: list[torch.Tensor],
        request: StatsRequest,
        final: StatsRequest | None = None,
        on_layer: Callable[["LayerStep"], torch.nn.Module | None] | None = None,
        carry_original: bool = False,
        layers: list[int] | None = None,
    ) -> CalibrationResult:
        """Statistics of every layer (or of ``layers``; the loop still runs up to the last of them)
        and, with ``final``, after the last layer. ``on_layer(step)`` may return the converted layer
        (sequential mode, see :meth:`LayerStep.replace`)."""
        run = self.start(batches, carry_original=carry_original)
        out: list[LayerStats | None] = [None] * self.adapter.n_layers
        stop = self.adapter.n_layers if layers is None or final is not None else max(layers) + 1
        for step in run.layers(request, stop=stop, only=None if layers is None else set(layers)):
            out[step.index] = step.stats
            if on_layer is not None:
                new = on_layer(step)
                if new is not None:
                    step.replace(new)
        result = CalibrationResult(out, tokens=run.tokens)
        if final is not None:
            result.final = run.final(final)
        return result
