"""Where calibration and the heavy linear algebra run: ``--device`` and ``--calib-dtype``.

:func:`parse_device` is the one reading of a ``--device`` string, and every command calls it (through
:func:`resolve` when a calibration dtype comes with it). ``auto`` has one meaning: the current CUDA
device when torch sees a GPU, else the CPU; ``cuda``, ``cuda:N``, ``mps`` and ``cpu`` name one device.
A CUDA device always carries its index (``auto`` and ``cuda`` become ``cuda:<torch.cuda.current_device()>``),
so ``torch.cuda.set_device``, memory queries and device comparisons all work on what it returns. The
:class:`DeviceRequest` it returns also says whether the user left the choice to hf_symmetry
(:attr:`DeviceRequest.spread`): a whole model loaded for evaluation may then be spread by accelerate over
the GPUs, the CPU and disk when it does not fit the device (:attr:`DeviceRequest.device_map`), and
``heal`` under several processes trains each on its own GPU. :func:`parse_device` takes a
:class:`DeviceRequest` back unchanged, so a command reads ``--device`` once and hands the result on.
:func:`resolve` checks a device/dtype pair before any work and raises :class:`DeviceError` (a
``ValueError``) with one line naming what is wrong: an unknown device, a device this machine does not
have, or a calibration dtype the device cannot compute in. The placement of a library call given none
is named once: :data:`DEFAULT_DEVICE` (:func:`default_placement`). Nothing here allocates more than a
one-element probe tensor.

The model's device is the source of truth for what enters a model: :func:`to_model` moves a tensor
(token ids, an attention mask, an activation) to the device of the module that consumes it, the
input embedding's for a whole model (so accelerate device maps and offload work), and
:func:`exact_float64` keeps a float64 path free of TF32 and autocast on CUDA.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
CALIB_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# float64 is accepted by the library API (exactness tests), not offered on the command line
_ALL_DTYPES = {**CALIB_DTYPES, "float64": torch.float64}


class DeviceError(ValueError):
    """A device or calibration dtype that cannot be used on this machine."""


@dataclass(frozen=True)
class Placement:
    """A checked device and the dtype calibration activations and layer weights use on it."""

    device: torch.device
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.device} ({str(self.dtype).removeprefix('torch.')})"


#: the placement of a library call given none (the command line's ``--device`` default is ``auto``)
DEFAULT_DEVICE = "cpu"


@dataclass(frozen=True)
class DeviceRequest:
    """A ``--device`` read by :func:`parse_device`: the one device it names, and whether the user left
    the choice to hf_symmetry (``auto``)."""

    device: torch.device
    auto: bool

    @property
    def spread(self) -> bool:
        """Whether a whole model loaded for evaluation may be spread by accelerate over the GPUs, the CPU
        and disk when it does not fit :attr:`device`: only when the user left the choice to ``auto``; a
        named device holds the whole model."""
        return self.auto

    @property
    def device_map(self) -> str:
        """What a whole model loaded for evaluation is given as ``device_map``: ``"auto"`` when it may be
        spread (:attr:`spread`), else the named device."""
        return "auto" if self.spread else str(self.device)


def parse_device(name: str | torch.device | DeviceRequest | None = "auto") -> DeviceRequest:
    """The one reading of a ``--device`` string (or a ``torch.device``; None means ``auto``), checked
    against this machine (see the module docstring); raises :class:`DeviceError`. A
    :class:`DeviceRequest` (already read) comes back unchanged."""
    if isinstance(name, DeviceRequest):
        return name
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return DeviceRequest(_current_cuda() if torch.cuda.is_available() else torch.device("cpu"), auto=True)
    return DeviceRequest(_named_device(name), auto=False)


def _named_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m:
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {name}: CUDA is not available here (torch {torch.__version__}"
                f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu or auto"
            )
        if m.group(1) is None:
            return _current_cuda()
        index = int(m.group(1))
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
            )
        return torch.device("cuda", index)
    if name == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError("--device mps: the Apple MPS backend is not available here; use --device cpu or auto")
        return torch.device("mps")
    raise DeviceError(f"unknown device {name!r}: choose {DEVICE_CHOICES}")


def _current_cuda() -> torch.device:
    """``cuda:<current index>``: the device torch's bare ``cuda`` means (under torchrun/accelerate each
    process sets its own); never an index-less ``cuda``, which ``torch.cuda.set_device`` refuses."""
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The calibration dtype ``name`` (``float32``/``bfloat16``; ``float64`` from the API), checked to
    work on ``device`` by a one-element matmul."""
    if isinstance(name, torch.dtype):
        dtype = name
        name = str(dtype).removeprefix("torch.")
    else:
        if name not in _ALL_DTYPES:
            raise DeviceError(f"unknown calibration dtype {name!r}: choose {', '.join(CALIB_DTYPES)}")
        dtype = _ALL_DTYPES[name]
    if dtype not in _ALL_DTYPES.values():
        raise DeviceError(f"unsupported calibration dtype {name}: choose {', '.join(CALIB_DTYPES)}")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"--calib-dtype bfloat16: {torch.cuda.get_device_name(device)} cannot compute in "
            "bfloat16; use --calib-dtype float32"
        )
    if device.type == "mps" and dtype == torch.float64:
        raise DeviceError("MPS cannot compute in float64; use float32 or another device")
    try:
        x = torch.ones(1, 1, dtype=dtype, device=device)
        (x @ x).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"--calib-dtype {name} does not work on {device}: {str(exc).splitlines()[0]}") from None
    return dtype


def resolve(
    device: str | torch.device | DeviceRequest | None = "auto", dtype: str | torch.dtype = "float32"
) -> Placement:
    """Check a ``--device``/``--calib-dtype`` pair (the device read by :func:`parse_device`); call before
    any work."""
    dev = parse_device(device).device
    return Placement(dev, resolve_dtype(dtype, dev))


def default_placement(dtype: str | torch.dtype = "float32") -> Placement:
    """The placement of a library call given none: :data:`DEFAULT_DEVICE` in ``dtype`` (float32 unless
    the caller's weights ask for float64)."""
    return resolve(DEFAULT_DEVICE, dtype)


def linalg_device(placement: Placement | torch.device | None) -> torch.device:
    """Where a conversion's float64 linear algebra runs: the calibration device, except MPS (no float64)."""
    if placement is None:
        return torch.device("cpu")
    dev = placement.device if isinstance(placement, Placement) else torch.device(placement)
    return torch.device("cpu") if dev.type == "mps" else dev


# ------------------------------------------------------------------------ what enters a model
def module_device(module: torch.nn.Module) -> torch.device:
    """The device a module computes its inputs on: for a model, its input embedding's (where a
    device map puts its first layer); else its first parameter's or buffer's. A weight accelerate
    offloaded (``meta``) computes on its hook's execution device, else on the CPU."""
    first = None
    get = getattr(module, "get_input_embeddings", None)
    if get is not None:
        try:
            emb = get()
        except (AttributeError, NotImplementedError):
            emb = None
        if emb is not None:
            first = (emb, getattr(emb, "weight", None))
    if first is None or first[1] is None:
        t = next(module.parameters(), None)
        if t is None:
            t = next(module.buffers(), None)
        if t is None:
            return torch.device("cpu")
        first = (module, t)
    owner, t = first
    if t.device.type == "meta":
        hook = getattr(owner, "_hf_hook", None)
        dev = getattr(hook, "execution_device", None)
        return (
            torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}") if dev is not None else torch.device("cpu")
        )
    return t.device


def to_model(t: torch.Tensor, module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on the device of ``module`` (:func:`module_device`), the one way tensors enter a model:
    token ids, masks and activations handed to a forward go through here. ``dtype`` also casts
    (floating tensors only)."""
    dev = module_device(module)
    if dtype is not None and t.is_floating_point():
        return t.to(device=dev, dtype=dtype)
    return t.to(dev)


@contextlib.contextmanager
def exact_float64(device: torch.device | str | None = None, enabled: bool = True):
    """A region where float64 work stays float64 and no float32 step inside it is lowered: TF32
    off for CUDA matmuls and cuDNN, ``highest`` float32 matmul precision, and autocast disabled on
    ``device`` (and the CPU). The previous settings come back on exit. ``enabled=False`` does nothing
    (for callers that compute in float32/bfloat16, where TF32 and autocast are the user's choice)."""
    if not enabled:
        yield
        return
    kinds = {"cpu"} | ({torch.device(device).type} if device is not None else set())
    if torch.cuda.is_available():
        kinds.add("cuda")
    with contextlib.ExitStack() as stack:
        stack.callback(_restore_precision, _precision_state())
        _set_ieee()
        for kind in sorted(kinds):
            if kind in ("cpu", "cuda", "mps", "xpu"):
                stack.enter_context(torch.autocast(device_type=kind, enabled=False))
        yield


# float32 precision switches: torch >= 2.9 has per-backend ``fp32_precision`` ("ieee", "tf32",
# "bf16") and refuses to read the legacy ``allow_tf32`` flags once they were set through it
def _precision_switches() -> list:
    b = torch.backends
    found = []
    mkldnn = getattr(b, "mkldnn", None)
    for owner in (
        b.cuda.matmul,
        getattr(b.cudnn, "conv", None),
        getattr(b.cudnn, "rnn", None),
        getattr(mkldnn, "matmul", None),
        getattr(mkldnn, "conv", None),
        getattr(mkldnn, "rnn", None),
    ):
        if owner is not None and hasattr(owner, "fp32_precision"):
            found.append(owner)
    return found


def _precision_state():
    new = _precision_switches()
    if new:
        return "new", [(o, o.fp32_precision) for o in new]
    return "legacy", (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def _set_ieee() -> None:
    new = _precision_switches()
    if new:
        for o in new:
            o.fp32_precision = "ieee"
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _restore_precision(state) -> None:
    kind, saved = state
    if kind == "new":
        for o, v in saved:
            if o.fp32_precision != v:
                o.fp32_precision = v
        return
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
    torch.set_float32_matmul_precision(saved[2])
