"""The exact per-channel scalings of one canonical layer that both the data-free balancing
(:mod:`.rotation`) and the activation-aware search (:mod:`.scales`) set: norm → readers, up → down and
V → O (each exact for any non-zero factors, docs/math.md §1), and the normalisation of a factor vector
to geometric mean 1."""

from __future__ import annotations

import torch

from ...symmetry import actions
from ...symmetry.layout import HeadLayout

Tensors = dict[str, torch.Tensor]


def normalised(c: torch.Tensor, alpha: float) -> torch.Tensor:
    """``c^alpha`` divided by its geometric mean (so the overall weight scale is kept); zeros -> 1."""
    c = torch.where(c > 0, c, torch.ones_like(c)).to(torch.float64)
    s = c.pow(alpha)
    return s / s.log().mean().exp()


def scale_ffn_channels(layer: Tensors, s: torch.Tensor) -> Tensors:
    """``up -> diag(s) up`` (and its bias), ``down -> down diag(1/s)``: exact for ``act(gate)·up``."""
    if (s == 0).any():
        raise actions.NotASymmetry("FFN scales must be non-zero")
    out = dict(layer)
    out["up.weight"] = out["up.weight"] * s[:, None]
    if "up.bias" in out:
        out["up.bias"] = out["up.bias"] * s
    out["down.weight"] = out["down.weight"] / s[None, :]
    return out


def scale_vo_channels(layer: Tensors, layout: HeadLayout, t: torch.Tensor) -> Tensors:
    """Per KV group g and channel c of ``head_dim``: V row ``/ t``, every O column of the group's
    heads ``* t``. ``t`` has shape ``[n_kv_heads * head_dim]``."""
    if (t == 0).any():
        raise actions.NotASymmetry("VO scales must be non-zero")
    out = dict(layer)
    out["v.weight"] = out["v.weight"] / t[:, None]
    if "v.bias" in out:
        out["v.bias"] = out["v.bias"] / t
    per_head = t.reshape(layout.n_kv_heads, layout.head_dim).repeat_interleave(layout.group_size, dim=0).reshape(-1)
    out["o.weight"] = out["o.weight"] * per_head[None, :]
    return out


def scale_norm_readers(layer: Tensors, norm: str, readers: tuple[str, ...], s: torch.Tensor) -> Tensors:
    """``norm.weight / s`` and every reader ``W diag(s)``: exact for any non-zero ``s``."""
    if (s == 0).any():
        raise actions.NotASymmetry("norm scales must be non-zero")
    out = dict(layer)
    out[f"{norm}.weight"] = out[f"{norm}.weight"] / s.to(out[f"{norm}.weight"].dtype)
    for n in readers:
        if f"{n}.weight" in out:
            out[f"{n}.weight"] = out[f"{n}.weight"] * s.to(out[f"{n}.weight"].dtype)[None, :]
    return out
