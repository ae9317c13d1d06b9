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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter
from ..devices import Placement, exact_float64, resolve, to_model
from .memory import release_free_memory, return_large_blocks_at_once
from .statistics import FINAL_SITES, Accumulator, LayerStats, StatsRequest, base_site, capture_sites

Tensors = dict[str, torch.Tensor]


class _Stop(Exception):
    """Raised by the last catcher: the rest of the model (final norm, head) is not run."""


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer ``index`` during the embedding pass: records the arguments the
    model passes to the layer and hands its input on unchanged. Attribute lookups the model's
    forward makes on its layers (e.g. ``attention_type``) fall through to the real layer."""

    def __init__(self, index: int, layer: torch.nn.Module, record: dict, last: bool):
        super().__init__()
        object.__setattr__(self, "_layer", layer)
        self.index, self.record, self.last = index, record, last

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, hidden_states, *args, **kwargs):
        if self.index == 0:
            self.record["input"] = hidden_states
        self.record[self.index] = (args, kwargs)
        if self.last:
            raise _Stop
        return hidden_states


def _rotary_on_host(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Make every rotary-embedding module under ``module`` compute its tables on the host and hand
    them to the caller's device; returns the modules patched (undo with :func:`_undo_rotary`).

    transformers computes the cos/sin tables in float32 whatever the model's dtype, and float32
    ``cos``/``sin`` differ between the CPU and CUDA by an ulp or so (~1e-7 relative): a float64
    calibration on a GPU would then not give the CPU's float64 statistics. Computed on the host,
    the tables are the CPU's bit for bit on every device (they are small: positions x head dim)."""
    patched = []
    for m in module.modules():
        if not type(m).__name__.endswith("RotaryEmbedding") or "forward" in m.__dict__:
            continue
        original = type(m).forward.__get__(m)

        def forward(*args, _original=original, **kwargs):
            dev = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            host = lambda v: v.cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
            out = _original(*map(host, args), **{k: host(v) for k, v in kwargs.items()})
            back = lambda v: v.to(dev) if isinstance(v, torch.Tensor) and dev is not None else v  # noqa: E731
            return tuple(back(o) for o in out) if isinstance(out, tuple) else back(out)

        m.forward = forward
        patched.append(m)
    return patched


def _undo_rotary(patched: list[torch.nn.Module]) -> None:
    for m in patched:
        m.__dict__.pop("forward", None)


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class Activations:
    """The hidden states of every calibration batch at one place of the model: per batch a
    ``[batch, seq, hidden]`` tensor on ``home`` (the device, or the CPU when they do not fit)."""

    batches: list[torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.batches)


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
        equal the CPU's to float64 rounding (:func:`_rotary_on_host`, :func:`hf_symmetry.devices.exact_float64`)."""
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
            _rotary_on_host(layer)  # families whose layers hold their own rotary module
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
        host_rotary = _rotary_on_host(model) if self.exact else []
        try:
            for batch in tqdm(batches, desc="calibration: embed", disable=not self.progress, unit="batch", leave=False):
                record: dict = {}
                for i in range(len(originals)):
                    layers[i] = _Catcher(i, originals[i], record, last=(i == len(originals) - 1))
                try:
                    with torch.no_grad(), self.precision():
                        model(input_ids=to_model(batch, model), use_cache=False)
                except _Stop:
                    pass
                finally:
                    for i in range(len(originals)):
                        layers[i] = originals[i]
                if "input" not in record:
                    raise RuntimeError(f"{type(model).__name__}: the forward never reached its first layer")
                embedded.append(record.pop("input").detach())
                record_per_batch.append(record)
        finally:
            _undo_rotary(host_rotary)
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


@dataclass
class LayerStep:
    """One layer of a run, yielded once its statistics are collected (see
    :meth:`CalibrationRun.layers`)."""

    index: int
    module: torch.nn.Module  # the original layer, on the device
    stats: LayerStats | None
    run: "CalibrationRun" = field(repr=False)
    replacement: torch.nn.Module | None = None
    #: per batch, the original model's activations at the sites asked for with ``keep_original``
    #: (and ``layer_out``), from the pass that built this step: :meth:`collect` takes its ``cross``
    #: sites from them once the original layer is released
    original_acts: list[Tensors] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Drop the original layer now (its outputs are already computed and handed on): its weights
        are then freed before the caller's own work on this layer, not when the next layer is built;
        so is the original stream's input to it (one ``tokens × hidden`` copy), unless kept.
        :meth:`collect` still works for ``cross`` statistics at the sites kept with
        :meth:`CalibrationRun.layers`' ``keep_original`` (``layer_in`` among them where needed)."""
        self.module = None
        if self.run.original is not None:
            self.run.original = Activations([])  # handed on from this layer's outputs as before

    def replace(self, module: torch.nn.Module) -> None:
        """Hand on the outputs of ``module`` (the converted layer, called like the original with
        the same arguments) instead of the original layer's."""
        self.replacement = module

    def collect(self, request: StatsRequest, module: torch.nn.Module | None = None) -> LayerStats:
        """Statistics of ``module`` (default: the original layer) on this layer's inputs (the
        converted stream; the original stream's sites for ``cross`` come from the original layer, or
        from those kept with ``keep_original`` once it is released)."""
        if self.module is None and (module is None or (request.original_sites() and self.original_acts is None)):
            raise RuntimeError(
                f"layer {self.index} was released: collect needs a module to run, and cross "
                "statistics the original stream's sites kept with keep_original"
            )
        return self.run._collect(
            self.index,
            module or self.module,
            request,
            keep_outputs=False,
            original_module=self.module,
            original_acts=self.original_acts,
        )[0]

    def tensors(self) -> Tensors:
        """This layer's checkpoint tensors (original dtypes)."""
        return self.run.engine.layer_tensors(self.index)


class CalibrationRun:
    """The state of one pass: the activations entering the next layer (and, with
    ``carry_original``, the original model's), and each layer's recorded arguments."""

    def __init__(
        self, engine: CalibrationEngine, batches, records: list[dict], acts: Activations, carry_original: bool
    ):
        self.engine, self.records = engine, records
        self.tokens = int(sum(b.numel() for b in batches))
        self.stream = acts
        self.original = Activations(list(acts.batches)) if carry_original else None
        self.next_layer = 0

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.engine.device, non_blocking=True)

    def _home(self, like: Activations, t: torch.Tensor) -> torch.Tensor:
        return t if like.batches and like.batches[0].device == t.device else t.to(like.batches[0].device)

    def _new_stats(self, index, request) -> tuple[LayerStats, Accumulator]:
        stats = LayerStats(index)
        return stats, Accumulator(request, stats, self.engine.adapter.eps, self.engine.stats_device)

    def _collect(self, *args, **kwargs):
        with torch.no_grad(), self.engine.precision():
            return self._collect_batches(*args, **kwargs)

    def _collect_batches(
        self,
        i: int,
        module,
        request: StatsRequest,
        keep_outputs: bool,
        original_module=None,
        original_acts: list[Tensors] | None = None,
        keep_original: tuple[str, ...] = (),
        converted_outputs: bool = True,
    ):
        """Run batch by batch: statistics of ``request`` and (``keep_outputs``) the outputs of
        ``module`` on the converted stream and of ``original_module`` on the original stream (default
        ``module``; ``None`` where ``original_acts`` holds the original stream's sites instead).
        ``keep_original``: also return, per batch, the original stream's activations at these sites
        and its output (``layer_out``). ``converted_outputs=False``: ``module``'s outputs on the
        converted stream are not needed (the caller replaces the layer): it is not run there unless
        ``request`` reads a site inside it."""
        adapter = self.engine.adapter
        stats, acc = self._new_stats(i, request)
        sites = {base_site(s) for s in request.sites()}
        osites = {base_site(s) for s in request.original_sites()}
        if original_module is None and original_acts is None:
            original_module = module
        need_original = self.original is not None and (bool(osites) or keep_outputs)
        if need_original and original_module is None:
            missing = osites - set(original_acts[0]) - ({"layer_in"} if self.original.batches else set())
            if missing:
                raise RuntimeError(
                    f"layer {i} was released and the original stream's {sorted(missing)} were "
                    "not kept (CalibrationRun.layers' keep_original)"
                )
        outs, oouts, kept = [], [], []
        site_modules = adapter.site_modules()
        for b, x in enumerate(self.stream.batches):
            args, kwargs = self.records[b][i]
            x_dev = self._to_device(x)
            oacts = None
            if need_original:
                if original_module is None:
                    oacts = {s: self._to_device(t) for s, t in original_acts[b].items()}
                    if self.original.batches:  # (the input is dropped with the released layer)
                        oacts.setdefault("layer_in", self._to_device(self.original.batches[b]))
                else:
                    xo = self._to_device(self.original.batches[b])
                    with capture_sites(original_module, site_modules, osites | set(keep_original)) as got:
                        yo = _first(original_module(xo, *args, **kwargs))
                    oacts = dict(got, layer_in=xo, layer_out=yo)
                    if keep_outputs:
                        oouts.append(self._home(self.original, yo))
                    if keep_original:
                        kept.append(
                            {
                                s: oouts[-1]
                                if s == "layer_out" and keep_outputs
                                else self._home(self.original, oacts[s])
                                for s in (*keep_original, "layer_out")
                            }
                        )
            if not converted_outputs and sites <= {"layer_in"}:
                acc.add({"layer_in": x_dev}, oacts)
                del oacts
                continue
            with capture_sites(module, site_modules, sites) as got:
                y = _first(module(x_dev, *args, **kwargs))
            acc.add(dict(got, layer_in=x_dev, layer_out=y), oacts)
            if keep_outputs and converted_outputs:
                outs.append(self._home(self.stream, y))
            del got, oacts
        return stats, outs, oouts, kept

    def layers(
        self,
        request: StatsRequest,
        stop: int | None = None,
        only: set[int] | None = None,
        keep_original: tuple[str, ...] = (),
        replaced: bool = False,
    ) -> Iterator[LayerStep]:
        """Walk layers ``next_layer .. stop-1``: build each, collect ``request`` (on layers in
        ``only``, default all), yield the step, then hand the outputs on (the replacement's, if
        the caller set one). ``keep_original`` (with ``carry_original``): the original stream's
        activations at these sites are kept on the step (:attr:`LayerStep.original_acts`, one
        ``tokens × width`` tensor per site), so that it can release the original layer and still
        collect cross statistics against them. ``replaced``: the caller replaces every layer
        (:meth:`LayerStep.replace`), so the original layer is not run on the converted stream (its
        outputs there would be thrown away) unless ``request`` reads a site inside it."""
        engine = self.engine
        stop = engine.adapter.n_layers if stop is None else stop
        bar = tqdm(range(self.next_layer, stop), desc="calibration", unit="layer", disable=not engine.progress)
        for i in bar:
            release_free_memory()  # the previous layer's temporaries, before this layer is built
            module = engine.layer_module(i)
            want = request if (only is None or i in only) else StatsRequest()
            stats, outs, oouts, kept = self._collect(
                i,
                module,
                want,
                keep_outputs=True,
                original_module=module,
                keep_original=keep_original if self.original is not None else (),
                converted_outputs=not replaced,
            )
            step = LayerStep(
                i, module, stats if (only is None or i in only) else None, self, original_acts=kept or None
            )
            del module  # the step holds the layer: a caller that sets step.module = None frees it now
            yield step
            if replaced and step.replacement is None:
                raise RuntimeError(f"layer {i} was not replaced (CalibrationRun.layers(replaced=True))")
            if step.replacement is not None:
                with torch.no_grad(), engine.precision():  # a generator body is outside any decorator's no_grad
                    outs = [
                        self._home(
                            self.stream,
                            _first(
                                step.replacement(self._to_device(x), *self.records[b][i][0], **self.records[b][i][1])
                            ),
                        )
                        for b, x in enumerate(self.stream.batches)
                    ]
            self.stream = Activations(outs)
            if self.original is not None:
                self.original = Activations(oouts)
            self.next_layer = i + 1
            # the caller's loop variable still holds this step while the next layer is built: let
            # go of its layers, so one layer is in memory at a time
            step.module = step.replacement = step.original_acts = None
            del step, outs, oouts, kept

    def final(self, request: StatsRequest) -> LayerStats:
        with torch.no_grad(), self.engine.precision():
            return self._final(request)

    def _final(self, request: StatsRequest) -> LayerStats:
        """Statistics after the last layer: sites ``final_in`` (the stream) and ``head_in`` (the final
        norm's output; the stream itself for families without a final norm)."""
        engine = self.engine
        if self.next_layer != engine.adapter.n_layers:
            raise RuntimeError(
                f"final statistics need all {engine.adapter.n_layers} layers run (next layer: {self.next_layer})"
            )
        bad = {base_site(s) for s in request.sites() | request.original_sites()} - set(FINAL_SITES)
        if bad:
            raise ValueError(f"after the last layer only {FINAL_SITES} exist, not {sorted(bad)}")
        norm = engine.final_norm_module()
        stats, acc = self._new_stats(None, request)
        for b, x in enumerate(self.stream.batches):
            x = self._to_device(x)
            acts = {"final_in": x, "head_in": norm(x) if norm is not None else x}
            oacts = None
            if self.original is not None and (request.cross or request.drift):
                xo = self._to_device(self.original.batches[b])
                oacts = {"final_in": xo, "head_in": norm(xo) if norm is not None else xo}
            acc.add(acts, oacts)
        return stats
