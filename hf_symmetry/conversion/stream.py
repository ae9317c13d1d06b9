"""The layer-by-layer loop every weight-space conversion runs: read a layer, make it
canonical, transform it, write it back. Sources are safetensors folders (streaming) or
in-memory state dicts (tests, in-process use) behind the same two methods."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter
from ..symmetry.actions import OwnedTensors

Tensors = dict[str, torch.Tensor]
LayerFn = Callable[[int, Tensors], Tensors]
GlobalsFn = Callable[[Tensors], Tensors]
CombineLayersFn = Callable[[int, list[Tensors]], Tensors]
CombineGlobalsFn = Callable[[list[Tensors]], Tensors]
CombineRestFn = Callable[[str, list[torch.Tensor]], torch.Tensor]


class TensorSource(Protocol):
    def keys(self) -> list[str]: ...
    def get(self, names: list[str]) -> Tensors: ...


class TensorSink(Protocol):
    def add(self, tensors: Tensors) -> None: ...


class DictSource:
    def __init__(self, state_dict: Tensors):
        self.state_dict = state_dict

    def keys(self) -> list[str]:
        return list(self.state_dict)

    def get(self, names: list[str]) -> Tensors:
        return {n: self.state_dict[n] for n in names}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict.items()}


class DictSink(dict):
    def add(self, tensors: Tensors) -> None:
        self.update(tensors)


def partition_keys(adapter: Adapter, keys: list[str]) -> tuple[list[str], dict[int, list[str]], list[str]]:
    """(global keys, keys per layer, everything else)."""
    global_keys = adapter.global_keys(keys)
    per_layer: dict[int, list[str]] = defaultdict(list)
    rest = []
    gset = set(global_keys)
    for k in keys:
        i = adapter.layer_of(k)
        if i is not None:
            per_layer[i].append(k)
        elif k not in gset:
            rest.append(k)
    missing = [i for i in range(adapter.n_layers) if i not in per_layer]
    if missing:
        raise ValueError(f"checkpoint has no tensors for layers {missing[:5]} of {adapter.n_layers}")
    return global_keys, per_layer, rest


def write_globals_lean(
    raw: Tensors,
    adapter: Adapter,
    sink: TensorSink,
    globals_fn: GlobalsFn,
    dtype: torch.dtype | None = torch.float64,
    writer: Adapter | None = None,
) -> None:
    """Globals are vocabulary-sized: drop the raw tensors once they are canonical, and cast and
    write the results one at a time, so no more than one extra copy is ever alive. With
    ``dtype=None`` they stay in the checkpoint's dtype (``globals_fn`` then computes in float64
    a block of rows at a time)."""
    dtypes = {k: v.dtype for k, v in raw.items()}
    canonical = adapter.read_globals(raw, dtype)
    raw.clear()
    new = globals_fn(canonical)
    del canonical
    for key in list(new):
        sink.add((writer or adapter).write_globals({key: new.pop(key)}, dtypes))


@dataclass(frozen=True)
class StreamOptions:
    """How :func:`transform_checkpoint` reads and writes. ``globals_dtype``: the dtype the globals are made
    canonical in (None: the checkpoint's, :func:`write_globals_lean`). ``give_layers``: ``layer_fn`` gets each
    canonical layer as :class:`OwnedTensors`, which the symmetry actions update in place (for conversions that
    never look at a layer's old state). ``writer``: the adapter of a different output family (LayerNorm decoders
    written as the RMS-decoder family); tensors outside the canonical form are then not carried over."""

    globals_dtype: torch.dtype | None = torch.float64
    give_layers: bool = False
    writer: Adapter | None = None


def transform_checkpoint(
    source: TensorSource,
    adapter: Adapter,
    sink: TensorSink,
    layer_fn: LayerFn,
    globals_fn: GlobalsFn,
    progress: bool = True,
    desc: str = "layers",
    options: StreamOptions = StreamOptions(),
) -> None:
    """Every layer of ``source`` read, made canonical, transformed by ``layer_fn`` and written to ``sink``; the
    globals first, by ``globals_fn``; tensors the adapter does not model carried over as they are (``options``:
    :class:`StreamOptions`)."""
    globals_dtype, give_layers, writer = options.globals_dtype, options.give_layers, options.writer
    global_keys, per_layer, rest = partition_keys(adapter, source.keys())
    write_globals_lean(source.get(global_keys), adapter, sink, globals_fn, globals_dtype, writer)
    for i in tqdm(range(adapter.n_layers), desc=desc, disable=not progress, unit="layer"):
        raw = source.get(per_layer[i])
        canonical = adapter.read_layer(i, raw)
        if give_layers:
            canonical = OwnedTensors(canonical)
        modeled = adapter.modeled_layer_keys(i)
        passthrough = {k: v for k, v in raw.items() if k not in modeled} if writer is None else {}  # rotary buffers
        dtypes = {k: v.dtype for k, v in raw.items()}
        del raw  # keep one copy of the layer alive, not two
        sink.add({**passthrough, **(writer or adapter).write_layer(i, layer_fn(i, canonical), dtypes)})
    if rest and writer is None:
        sink.add(source.get(rest))


@dataclass(frozen=True)
class Combination:
    """How :func:`combine_checkpoints` makes one checkpoint of many: ``layer(i, layers)``, ``globals(globals)``,
    and ``rest(key, tensors)`` for each tensor the adapter does not model. ``globals_last``: combine the globals
    after the last layer (for rules that need statistics of the whole stack, e.g. RegMean's LM-head Gram)."""

    layer: CombineLayersFn
    globals: CombineGlobalsFn
    rest: CombineRestFn
    globals_last: bool = False


def combine_checkpoints(
    sources: list[TensorSource],
    adapter: Adapter,
    sink: TensorSink,
    combination: Combination,
    like: int = 0,
    progress: bool = True,
    desc: str = "layers",
) -> None:
    """The many-to-one twin of :func:`transform_checkpoint` (merging): layer i of every source is
    read, made canonical and combined by ``combination.layer`` into one layer, written in the dtypes of
    ``sources[like]``. Tensors the adapter does not model (in a layer or outside) are combined
    one by one by ``combination.rest(key, tensors)``. Every source must hold the same keys, apart from a
    tied ``lm_head``."""
    layer_fn, globals_fn, rest_fn = combination.layer, combination.globals, combination.rest
    globals_last = combination.globals_last
    parts = [partition_keys(adapter, s.keys()) for s in sources]

    def write_globals() -> None:
        raws = [s.get(p[0]) for s, p in zip(sources, parts)]
        sink.add(adapter.write_globals(globals_fn([adapter.read_globals(r) for r in raws]), raws[like]))

    if not globals_last:
        write_globals()
    for i in tqdm(range(adapter.n_layers), desc=desc, disable=not progress, unit="layer"):
        raws = [s.get(p[1][i]) for s, p in zip(sources, parts)]
        new = adapter.write_layer(i, layer_fn(i, [adapter.read_layer(i, r) for r in raws]), raws[like])
        sink.add({**{k: rest_fn(k, [r[k] for r in raws]) for k in raws[like] if k not in new}, **new})
        del raws, new
    if globals_last:
        write_globals()
    for k in parts[like][2]:
        sink.add({k: rest_fn(k, [s.get([k])[k] for s in sources])})
