"""The source checkpoint as the solvers and the assembly read it: canonical float64 tensors with the norms
folded into their readers, read when asked for, one matrix at a time (the vocabulary-sized ones a block of
rows at a time), so memory holds the matrices a step works on, whatever the depth."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...architectures import Adapter
from ...symmetry import actions
from ..stream import TensorSource, partition_keys

Tensors = dict[str, torch.Tensor]


class FoldedLayer(Mapping):
    """One layer's norm-folded canonical tensors, each read and folded when asked for (only the norms are
    kept, in float64): every access returns a fresh float64 tensor equal to the whole-layer fold's."""

    _NORM_OF = {**{r: "attn_norm" for r in actions._ATTN_READERS}, **{r: "ffn_norm" for r in actions._FFN_READERS}}

    def __init__(self, source: TensorSource, adapter: Adapter, index: int, keys: list[str]):
        self.source, self.adapter, self.index = source, adapter, index
        self.sources = adapter.canonical_sources(index, keys)  # canonical module -> checkpoint keys
        norms = sorted({n for n in self._NORM_OF.values() if n in self.sources})
        self.norms = self._read(norms)  # float64 (a γ − 1 norm made γ exactly)
        self._keys = [
            f"{c}.{kind}"
            for c, ks in self.sources.items()
            for kind in ("weight", "bias")
            if any(k.endswith("." + kind) for k in ks)
        ]

    def _read(self, modules) -> Tensors:
        names = list(dict.fromkeys(k for c in modules for k in self.sources[c]))
        raw = self.adapter.read_layer(
            self.index, self.source.get(names), dtype=None, norm_dtype=torch.float64, partial=True
        )
        return {k: v for k, v in raw.items() if k.rsplit(".", 1)[0] in modules}

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        canon = key.rsplit(".", 1)[0]
        is_norm = canon in self._NORM_OF.values()
        part = {} if is_norm else {k: v.to(torch.float64) for k, v in self._read([canon]).items()}
        norm = canon if is_norm else self._NORM_OF.get(canon)
        part.update({k: v for k, v in self.norms.items() if k.startswith(f"{norm}.")})
        return actions.fold_layer_norms(part)[key]


class FoldedLayers:
    """The layers as a read-only sequence of :class:`FoldedLayer` (the last ``keep`` of them kept)."""

    def __init__(self, source: TensorSource, adapter: Adapter, per_layer: dict[int, list[str]], keep: int = 2):
        self.source, self.adapter, self.per_layer, self.keep = source, adapter, per_layer, keep
        self._cache: dict[int, FoldedLayer] = {}
        self.reads = 0

    def __len__(self) -> int:
        return self.adapter.n_layers

    def __getitem__(self, i: int) -> FoldedLayer:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i not in self._cache:
            self.reads += 1
            while len(self._cache) >= self.keep:
                self._cache.pop(next(iter(self._cache)))
            self._cache[i] = FoldedLayer(self.source, self.adapter, i, self.per_layer[i])
        return self._cache[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def drop(self, i: int) -> None:
        """Forget layer ``i`` (its part of the output is written: nothing reads it again)."""
        self._cache.pop(i, None)


class FoldedGlobals(Mapping):
    """The canonical globals with the final norm folded into an untied head; the embedding and head are
    read when asked for and not kept (a fresh float64 copy each time)."""

    _LARGE = ("embed.weight", "lm_head.weight")

    def __init__(self, source: TensorSource, adapter: Adapter, global_keys: list[str], tied: bool):
        self.source, self.adapter = source, adapter
        self._where: dict[str, str] = {}  # canonical name -> checkpoint key
        for k in global_keys:
            for canon in adapter.read_globals({k: torch.empty(0)}, dtype=None):
                self._where[canon] = k
        if tied:
            self._where.pop("lm_head.weight", None)
        small = adapter.read_globals(source.get([k for c, k in self._where.items() if c not in self._LARGE]))
        self.gamma = small["final_norm.weight"].clone()
        self._small = actions.fold_final_norm(small)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(key)
        if key not in self._LARGE:
            return self._small[key]
        read = self.adapter.read_globals(self.source.get([self._where[key]]))
        if key == "lm_head.weight":
            read = actions.fold_final_norm({**read, "final_norm.weight": self.gamma})
        return read[key]

    def take(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (sorted unique indices) of ``self[key]``, float64."""
        ckey = self._where[key]
        if hasattr(self.source, "get_rows"):  # a checkpoint: only their bytes read
            raw = self.source.get_rows(ckey, rows)
        else:
            raw = self.source.get([ckey])[ckey][rows]
        t = self.adapter.read_globals({ckey: raw})[key]
        return t * self.gamma[None, :] if key == "lm_head.weight" else t  # as fold_final_norm folds


def global_rows(globals_, key: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (sorted unique indices) of ``globals_[key]`` (a dict or :class:`FoldedGlobals`), float64."""
    if isinstance(globals_, FoldedGlobals):
        return globals_.take(key, rows)
    return globals_[key][rows].to(torch.float64)


def global_row_blocks(globals_, key: str, chunk: int = 1024):
    """``(rows, iterator of (first row, block))`` over ``globals_[key]``, float64."""
    if isinstance(globals_, FoldedGlobals):  # its shape, without reading it
        n = globals_.source.shapes()[globals_._where[key]][0]
    else:
        n = globals_[key].shape[0]
    return n, ((i, global_rows(globals_, key, torch.arange(i, min(i + chunk, n)))) for i in range(0, n, chunk))


def read_folded(source: TensorSource, adapter: Adapter, keys: list[str], tied: bool, lazy: bool = False, keep: int = 2):
    """(layers, globals, γ): the layers with both norms folded, the globals with the final norm folded into
    an untied head (a tied head has none: the final γ goes into the head's change of basis) and that γ.
    ``lazy``: read when used (:class:`FoldedLayers`, :class:`FoldedGlobals`) instead of a list and a dict."""
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    rest = [k for k in rest if not k.endswith("rotary_emb.inv_freq")]
    if rest:
        raise ValueError(f"checkpoint has tensors compress does not know how to carry: {rest[:4]}")
    layers, g = FoldedLayers(source, adapter, per_layer, keep=keep), FoldedGlobals(source, adapter, global_keys, tied)
    return (layers, g, g.gamma) if lazy else ([dict(layer) for layer in layers], dict(g), g.gamma)
