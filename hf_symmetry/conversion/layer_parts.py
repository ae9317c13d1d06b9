"""Reading part of a decoder layer in canonical form, the rest standing in as meta tensors.

A conversion that changes only some of a layer's tensors (to-tpa: the key and value projections;
FaRR: the attention and, for the γ fold, gate/up) reads those in float64 and passes the others
through one at a time in their own dtype, instead of holding a float64 copy of the whole layer
(at Llama-3-8B shapes 1.75 GB, most of it the FFN). The adapter's ``read_layer`` still does every
layout step (fused projections split, Conv1D transposed, ``γ - 1`` norms), because the tensors not
read stand in as meta tensors with their real shapes."""

from __future__ import annotations

import torch

from ..architectures import Adapter

Tensors = dict[str, torch.Tensor]


def stand_ins(keys: list[str], shapes: dict, dtypes: dict | None = None) -> Tensors:
    """Meta tensors in the place of checkpoint tensors (names, shapes and dtypes; no data)."""
    return {k: torch.empty(shapes[k], dtype=(dtypes or {}).get(k, torch.float32), device="meta") for k in keys}


def read_part(adapter: Adapter, i: int, stand: Tensors, tensors: Tensors, dtype: torch.dtype | None) -> Tensors:
    """The canonical tensors of layer ``i`` that come from ``tensors`` (checkpoint tensors of the
    layer, which this consumes: the dict is emptied), in ``dtype`` (``None``: their own); the rest
    of the layer stands in as ``stand`` (:func:`stand_ins`)."""
    canon = adapter.read_layer(i, {**stand, **tensors}, dtype)
    tensors.clear()
    return {k: t for k, t in canon.items() if not t.is_meta}


def module_of(adapter: Adapter, i: int, key: str) -> str:
    """The module path of checkpoint key ``key`` of layer ``i``, relative to the layer prefix."""
    return key.removeprefix(adapter.layer_prefix(i)).rsplit(".", 1)[0]


def attention_modules(adapter: Adapter) -> set[str]:
    """Module paths (relative to a layer) of the attention's projections and QK-norms."""
    a = adapter.spec.attention
    return {m for m in (a.q, a.k, a.v, a.o, a.qkv, *(a.qk_norm or ())) if m}


def ffn_modules(adapter: Adapter) -> set[str]:
    """Module paths (relative to a layer) of the FFN's projections."""
    f = adapter.spec.ffn
    return {m for m in (f.gate, f.up, f.down, f.gate_up) if m}
