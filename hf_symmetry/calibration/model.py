"""The checkpoint as calibration sees it (step 1 and the layers of step 3 of
:mod:`hf_symmetry.calibration.engine`): its adapter, the calibration device and dtype, where statistics
accumulate, the family's model instantiated empty, and its decoder layers and final norm built one at a
time on the device from the checkpoint's tensors (:class:`CalibrationModel`).

The engine (:class:`~.engine.CalibrationEngine`, which adds the embedding pass) and the layer-by-layer
loop (:class:`~.run.CalibrationRun`) both read it, so neither imports the other."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from transformers import AutoConfig

from ..architectures import Adapter
from ..checkpoint_io import CheckpointReader
from ..devices import Placement, default_placement, exact_float64
from ..modeling import register_auto_classes
from .capture import rotary_on_host

Tensors = dict[str, torch.Tensor]


class CalibrationModel:
    """A checkpoint's family modules on the calibration device, one layer at a time.

    ``source``: an HF model folder (read with :class:`hf_symmetry.checkpoint_io.CheckpointReader`)
    or any tensor source with ``keys()``/``get(names)`` together with its ``config`` (dict).
    ``placement``: the checked device and calibration dtype (default CPU float32). ``stats_device``:
    where statistics accumulate (``None``: where the activations are). ``progress``: show progress bars."""

    def __init__(
        self,
        source,
        config: dict | None = None,
        placement: Placement | None = None,
        progress: bool = True,
        stats_device: torch.device | str | None = "cpu",
        attn_implementation: str | None = None,
    ):
        if isinstance(source, (str, Path)):
            source = CheckpointReader(source)
        self.source = source
        config = dict(config if config is not None else source.config)
        self.config = config
        self.keys = list(source.keys())
        self.adapter = Adapter.from_config(config, self.keys)
        self.placement = placement or default_placement()
        self.progress = progress
        self.stats_device = None if stats_device is None else torch.device(stats_device)
        if self.stats_device is not None and self.stats_device.type == "mps":
            self.stats_device = torch.device("cpu")  # MPS has no float64
        self.attn_implementation = attn_implementation
        self._skeleton = None

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
