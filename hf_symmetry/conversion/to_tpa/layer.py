"""Source tensors to TPA tensors: the checkpoint's keys sorted into globals and layers, one layer's
canonical tensors turned into the TPA family's (K and V factored, the rest renamed), the tensors a
streamed layer passes through unchanged, and the global tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...architectures import Adapter
from ...modeling.modeling_tpa import FACTORS as TPA_FACTORS
from ...modeling.modeling_tpa import GLOBAL_MODULES as TPA_GLOBAL_MODULES
from ...modeling.modeling_tpa import LAYER_MODULES as TPA_LAYER_MODULES
from ..layer_parts import module_of
from ..stream import Tensors, partition_keys
from .factor import head_mode_factors


def layout_keys(adapter: Adapter, keys: list[str]) -> tuple[list[str], dict[int, list[str]]]:
    """The source's keys as ``(global keys, {layer: keys})``, refusing any the TPA family has no place for."""
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    rest = [k for k in rest if not k.endswith("rotary_emb.inv_freq")]
    if rest:
        raise ValueError(f"to-tpa: the source has tensors the TPA family has no place for: {rest[:4]}")
    return global_keys, per_layer


@dataclass(frozen=True)
class LayerFit:
    """How :func:`tpa_layer` factors every layer: the K and V ranks, the source's bias flags
    (:func:`.target.source_biases`), whether the factors are fitted to the attention input's Gram when one is
    given (``calibrate``; else it only measures the activation errors), the head grouping (``group_of(i)``,
    None: the layout's) and the device the factorisations run on (None: the tensors')."""

    k_rank: int
    v_rank: int
    flags: dict
    calibrate: bool = True
    group_of: Callable | None = None
    device: torch.device | str | None = None


def tpa_layer(canon: Tensors, layout, fit: LayerFit, gram=None) -> tuple[Tensors, tuple]:
    """One layer: TPA tensors (names relative to the layer prefix, float64) from the source layer's
    canonical tensors (:mod:`hf_symmetry.architectures.adapter`), which it consumes, and the layer's
    errors ``(k_err, v_err, k_act_err, v_act_err)``."""
    k_rank, v_rank, flags, calibrate, group_of, device = (
        fit.k_rank,
        fit.v_rank,
        fit.flags,
        fit.calibrate,
        fit.group_of,
        fit.device,
    )
    h, n_kv, dh = layout.n_heads, layout.n_kv_heads, layout.head_dim
    out: Tensors = {}
    for cname, module in TPA_LAYER_MODULES.items():
        for param in ("weight", "bias"):
            t = canon.pop(f"{cname}.{param}", None)
            if t is not None:
                out[f"{module}.{param}"] = t
    q_bias = f"{TPA_LAYER_MODULES['q']}.bias"
    if flags["attention_bias"] and q_bias not in out:
        out[q_bias] = torch.zeros(h * dh, dtype=torch.float64)
    fit = gram if calibrate else None
    errs = {}
    for proj, rank in (("k", k_rank), ("v", v_rank)):
        a_name, b_name = TPA_FACTORS[proj]
        w, b = canon.pop(f"{proj}.weight"), canon.pop(f"{proj}.bias", None)
        dev = device or w.device
        a, wb, bb, err, aerr = head_mode_factors(
            w.to(dev), None if b is None else b.to(dev), h, n_kv, rank, fit, gram, group_of
        )
        out[a_name], out[f"{b_name}.weight"] = a.cpu(), wb.cpu()
        if flags["attention_bias"]:
            out[f"{b_name}.bias"] = bb.cpu() if bb is not None else torch.zeros(rank * dh, dtype=torch.float64)
        errs[proj] = (err, aerr)
    left = sorted(k for k, v in canon.items() if not (k.endswith("norm.bias") and not v.any()))
    if left:
        raise ValueError(f"to-tpa: the source layer has tensors the TPA family has no place for: {left}")
    return out, (errs["k"][0], errs["v"][0], errs["k"][1], errs["v"][1])


def split_layer_keys(adapter: Adapter, i: int, keys: list[str], shapes: dict) -> tuple[list[str], list[str]]:
    """Layer ``i``'s checkpoint keys split into what the conversion computes on (the key and value
    projections, fused ones included, and every vector: norms, biases), read in float64, and the
    matrices it passes through unchanged (query, output and FFN projections), read in their own dtype."""
    a = adapter.spec.attention
    kv = {m for m in (a.k, a.v, a.qkv) if m}
    converted = [k for k in keys if module_of(adapter, i, k) in kv or len(shapes[k]) < 2]
    return converted, [k for k in keys if k not in set(converted)]


def tpa_name(canonical: str) -> str:
    """The TPA tensor name (relative to the layer prefix) of a canonical tensor passed through."""
    module, param = canonical.rsplit(".", 1)
    if module not in TPA_LAYER_MODULES:
        raise ValueError(f"to-tpa: the source layer has tensors the TPA family has no place for: {[canonical]}")
    return f"{TPA_LAYER_MODULES[module]}.{param}"


def tpa_globals(adapter: Adapter, raw: Tensors, tied: bool) -> Tensors:
    """TPA global tensors (the source's dtype) from the source's raw global tensors (the tensors
    read are written: no vocabulary-sized copy)."""
    g = adapter.read_globals(raw, dtype=None, copy=False)
    out = {
        f"{module}.{param}": g[f"{cname}.{param}"]
        for cname, module in TPA_GLOBAL_MODULES.items()
        for param in ("weight", "bias")
        if f"{cname}.{param}" in g and not (tied and cname == "lm_head")
    }
    left = sorted(set(g) - {f"{c}.{k}" for c in TPA_GLOBAL_MODULES for k in ("weight", "bias")})
    if left:
        raise ValueError(f"to-tpa: the source has global tensors the TPA family has no place for: {left}")
    return out
