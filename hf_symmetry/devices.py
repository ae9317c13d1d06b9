"""Where calibration and the heavy linear algebra run: ``--device`` and ``--calib-dtype``.

``resolve_device("auto")`` is CUDA when torch sees a GPU, else the CPU; ``cuda``, ``cuda:N``,
``mps`` and ``cpu`` name one device. :func:`resolve` checks a device/dtype pair before any work and
raises :class:`DeviceError` (a ``ValueError``) with one line naming what is wrong: an unknown
device, a device this machine does not have, or a calibration dtype the device cannot compute in.
Nothing here allocates more than a one-element probe tensor.
"""

from __future__ import annotations

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


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The device ``spec`` names, checked against this machine (see the module docstring)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if m:
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {spec}: CUDA is not available here (torch {torch.__version__}"
                              f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu or auto")
        index = int(m.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                              f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", index)
    if spec == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError("--device mps: the Apple MPS backend is not available here; use --device cpu or auto")
        return torch.device("mps")
    raise DeviceError(f"unknown device {spec!r}: choose {DEVICE_CHOICES}")


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
        raise DeviceError(f"--calib-dtype bfloat16: {torch.cuda.get_device_name(device)} cannot compute in "
                          "bfloat16; use --calib-dtype float32")
    if device.type == "mps" and dtype == torch.float64:
        raise DeviceError("MPS cannot compute in float64; use float32 or another device")
    try:
        x = torch.ones(1, 1, dtype=dtype, device=device)
        (x @ x).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"--calib-dtype {name} does not work on {device}: {str(exc).splitlines()[0]}") from None
    return dtype


def resolve(device: str | torch.device | None = "auto", dtype: str | torch.dtype = "float32") -> Placement:
    """Check a ``--device``/``--calib-dtype`` pair; call before any work."""
    dev = resolve_device(device)
    return Placement(dev, resolve_dtype(dtype, dev))


def placement_from_args(args) -> Placement:
    """The :class:`Placement` of a command's ``--device``/``--calib-dtype`` flags
    (:func:`hf_symmetry.commands.common.add_device_args`)."""
    return resolve(getattr(args, "device", "auto"), getattr(args, "calib_dtype", "float32"))


def linalg_device(placement: Placement | torch.device | None) -> torch.device:
    """Where a conversion's float64 linear algebra runs: the calibration device, except MPS (no float64)."""
    if placement is None:
        return torch.device("cpu")
    dev = placement.device if isinstance(placement, Placement) else torch.device(placement)
    return torch.device("cpu") if dev.type == "mps" else dev
