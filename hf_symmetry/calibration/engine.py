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

Where it lives: this module builds the empty model, materialises layers and runs the embedding pass
(steps 1-2; :class:`CalibrationEngine`); :mod:`.capture` holds the layer catcher and the host-side
rotary tables that pass uses; :mod:`.run` the layer-by-layer loop (step 3 and the sequential mode:
:class:`CalibrationRun`, :class:`LayerStep`, :class:`Activations`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter
from ..devices import Placement, exact_float64, resolve, to_model
from .capture import Catcher, Stop, rotary_on_host, undo_rotary
from .memory import return_large_blocks_at_once
from .run import Activations, CalibrationRun, LayerStep, Tensors
from .statistics import LayerStats, StatsRequest

__all__ = ["Activations", "CalibrationEngine", "CalibrationResult", "CalibrationRun", "LayerStep"]


@dataclass
class CalibrationResult:
    """Statistics of every layer (``layers[i]``, ``None`` where not collected) and after the last
    layer (``final``, when asked for)."""

    layers: list[LayerStats | None]
    final: LayerStats | None = None
    tokens: int = 0


class CalibrationEngine:
    """Layer-wise calibration over a checkpoint (see the module docstring).

    ``source``: an HF model folder (read with :class:`hf_symmetry.checkpoint.CheckpointReader`)
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
        from ..checkpoint import CheckpointReader

        if isinstance(source, (str, Path)):
            source = CheckpointReader(source)
        self.source = source
        config = dict(config if config is not None else source.config)
        self.config = config
        self.keys = list(source.keys())
        self.adapter = Adapter.from_config(config, self.keys)
        self.placement = placement or resolve("cpu", "float32")
        self.progress = progress
        self.stats_device = None if stats_device is None else torch.device(stats_device)
        if self.stats_device is not None and self.stats_device.type == "mps":
            self.stats_device = torch.device("cpu")  # MPS has no float64
        self.device_activation_fraction = device_activation_fraction
        self.attn_implementation = attn_implementation
        self._skeleton = None
        # a layer's freed activations and temporaries go back to the OS at once, not into the heap's
        # high-water mark (see hf_symmetry.calibration.memory)
        return_large_blocks_at_once()

    # ------------------------------------------------------------------ the empty model
    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def exact(self) -> bool:
        """float64 calibration off the CPU: every float32 step inside the family's modules (rotary
        tables) is computed as the CPU computes it, and TF32/autocast are off, so the statistics
        equal the CPU's to float64 rounding (:func:`.capture.rotary_on_host`,
        :func:`hf_symmetry.devices.exact_float64`)."""
        return self.dtype == torch.float64 and self.device.type != "cpu"

    def precision(self):
        """The context every forward of this engine runs in (:func:`hf_symmetry.devices.exact_float64`
        for float64 placements, nothing otherwise)."""
        return exact_float64(self.device, enabled=self.dtype == torch.float64)

    @property
    def dtype(self) -> torch.dtype:
        return self.placement.dtype

    def hf_config(self):
        """The checkpoint's config as its transformers config class."""
        from transformers import AutoConfig

        from ..modeling import register_auto_classes

        register_auto_classes()

        cfg = {k: v for k, v in self.config.items() if k not in ("transformers_version",)}
        model_type = cfg.pop("model_type")
        hf = AutoConfig.for_model(model_type, **cfg)
        if self.attn_implementation:
            hf._attn_implementation = self.attn_implementation
        return hf

    def skeleton(self) -> torch.nn.Module:
        """The model with every parameter on the meta device (buffers real, on the CPU, computed as
        ``from_pretrained`` computes them)."""
        if self._skeleton is None:
            import transformers
            from accelerate import init_empty_weights

            hf = self.hf_config()
            arch = (getattr(hf, "architectures", None) or [None])[0]
            cls = getattr(transformers, arch, None) if arch else None
            if cls is None:
                cls = (
                    transformers.AutoModelForCausalLM
                    if self.adapter.spec.lm_head
                    and any(k.startswith(self.adapter.spec.lm_head + ".") for k in self.keys)
                    else transformers.AutoModel
                )
                make = lambda: cls.from_config(hf, dtype=self.dtype)  # noqa: E731
            else:
                make = lambda: cls._from_config(hf, dtype=self.dtype)  # noqa: E731
            with init_empty_weights(include_buffers=False):
                model = make()
            # as from_pretrained does: non-persistent buffers (rotary tables, embedding scales) are
            # (re)computed by the model's own _init_weights after construction
            with torch.no_grad():
                for module in model.modules():
                    if next(module.named_buffers(recurse=False), None) is not None:
                        model._init_weights(module)
            self._skeleton = model.eval()
        return self._skeleton

    def _layers_list(self, model) -> torch.nn.ModuleList:
        return model.get_submodule((self.adapter.prefix + self.adapter.spec.layers))

    def _materialise(self, module: torch.nn.Module, prefix: str, values: Tensors | None = None) -> torch.nn.Module:
        """Load ``module``'s parameters (checkpoint keys ``prefix + name``) onto the device in the
        calibration dtype; buffers move to the device too (floating ones keep their dtype).
        ``values``: take the parameters from this dict (checkpoint keys) instead of the checkpoint."""
        from accelerate.utils import set_module_tensor_to_device

        names = [n for n, _ in module.named_parameters()]
        keys = {prefix + n for n in names}
        have = set(self.keys) if values is None else set(values)
        missing = sorted(k for k in keys if k not in have)
        if missing:
            raise ValueError(f"checkpoint lacks {missing[:3]} needed to run {type(module).__name__}")
        for n in names:  # one tensor at a time: the stored copy lives only until it is cast
            value = self.source.get([prefix + n])[prefix + n] if values is None else values[prefix + n]
            set_module_tensor_to_device(module, n, self.device, value=value, dtype=self.dtype)
            del value
        for n, b in list(module.named_buffers()):
            if b.device.type == "meta":
                continue
            set_module_tensor_to_device(module, n, self.device, value=b)
        return module

    def layer_module(self, i: int, values: Tensors | None = None) -> torch.nn.Module:
        """Decoder layer ``i`` as the family's transformers module, weights from the checkpoint (or
        from ``values``, the layer's checkpoint-named tensors, e.g. a converted layer), on the device
        in the calibration dtype, eval mode. The caller owns it (drop it when done)."""
        layer = copy.deepcopy(self._layers_list(self.skeleton())[i])
        if self.exact:
            rotary_on_host(layer)  # families whose layers hold their own rotary module
        return self._materialise(layer, self.adapter.layer_prefix(i), values).eval()

    def final_norm_module(self) -> torch.nn.Module | None:
        """The final norm (``None`` for families without one), materialised like a layer."""
        name = self.adapter.spec.final_norm
        if not name:
            return None
        path = self.adapter.prefix + name
        return self._materialise(copy.deepcopy(self.skeleton().get_submodule(path)), path + ".").eval()

    def layer_tensors(self, i: int) -> Tensors:
        """Layer ``i``'s checkpoint tensors (original dtypes), e.g. for
        :meth:`~hf_symmetry.architectures.adapter.Adapter.read_layer`."""
        prefix = self.adapter.layer_prefix(i)
        return self.source.get([k for k in self.keys if k.startswith(prefix)])

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
        from accelerate.utils import set_module_tensor_to_device

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
