"""What the calibration engine's embedding pass needs around the family's own modules: the catcher
that stands in for each decoder layer and records the arguments the model passes to it
(:class:`Catcher`, :class:`Stop`), and the rotary tables computed on the host for float64
calibration off the CPU (:func:`rotary_on_host`, :func:`undo_rotary`)."""

from __future__ import annotations

import torch


class Stop(Exception):
    """Raised by the last catcher: the rest of the model (final norm, head) is not run."""


class Catcher(torch.nn.Module):
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
            raise Stop
        return hidden_states


def rotary_on_host(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Make every rotary-embedding module under ``module`` compute its tables on the host and hand
    them to the caller's device; returns the modules patched (undo with :func:`undo_rotary`).

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


def undo_rotary(patched: list[torch.nn.Module]) -> None:
    for m in patched:
        m.__dict__.pop("forward", None)
