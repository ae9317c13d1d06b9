"""The layer map: how each decoder layer's output of a converted model relates to the original's.

A conversion knows this relation exactly, and ``heal`` distils through it (symmetry-aware layer
targets). With ``h_l`` the original model's residual stream after decoder layer ``l`` (``[..., d]``,
rows) and ``s_l`` the converted model's:

* **identity** (TPA, FaRR: the residual stream is untouched, only the attention changes):
  ``s_l ≈ h_l``;
* **rotation** (compress: SliceGPT and the ProcrustesGPT classes on RMSNorm families): the stream is
  rotated by the rotation ``Q`` of the residual segment the layer writes (segment ``2l + 2``; one
  global ``Q`` for SliceGPT's default) and cut to that segment's width ``w_l``:
  ``s_l ≈ h_l Q[:, :w_l]``.

At zero distortion (full-width slicing, full-rank TPA) the relation is exact, up to float round-off.

Stored next to the weights in ``<folder>/layer_map.safetensors`` (not a weights file: transformers reads
``model*.safetensors`` only, and the project's parameter count skips it): the distinct bases
``basis.<k>`` (float32 ``[d, w]``), ``layer_basis`` (int64 ``[L]``, ``-1`` for identity) and
``layer_width`` (int64 ``[L]``); metadata ``format``, ``kind``, ``hidden_size``, ``num_layers``,
``conversion``. A folder without it (a stock model, an older conversion, a LayerNorm decoder) has
no map: ``heal`` then distils the logits only and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["LayerMap", "LayerMapRecorder", "read_layer_map", "MAP_FILE"]

MAP_FILE = "layer_map.safetensors"
FORMAT = "hf_symmetry.layer_map/1"


@dataclass
class LayerMap:
    """Per decoder layer, the map from the original model's residual stream to the converted one's."""

    kind: str  # "identity" | "rotation"
    hidden_size: int  # the original model's stream width d
    layer_basis: list[int]  # per layer: index into ``bases``, -1 for identity
    layer_width: list[int]  # per layer: the converted stream's width
    bases: list[torch.Tensor] = field(default_factory=list)  # distinct [d, w] float32
    conversion: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_basis)

    @classmethod
    def identity(cls, num_layers: int, hidden_size: int, conversion: str = "") -> "LayerMap":
        return cls("identity", hidden_size, [-1] * num_layers, [hidden_size] * num_layers, [], conversion)

    def target(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The original model's layer-``layer`` state ``h [..., d]`` in the converted model's basis."""
        k = self.layer_basis[layer]
        if k < 0:
            return h
        Q = self.bases[k][:, : self.layer_width[layer]]
        return h @ Q.to(device=h.device, dtype=h.dtype)

    def mismatch(self, teacher_config: dict, student_config: dict) -> str | None:
        """Why this map cannot relate the two models (``None`` when it can)."""
        for who, cfg in (("teacher", teacher_config), ("student", student_config)):
            n = cfg.get("num_hidden_layers")
            if n is not None and n != self.num_layers:
                return f"the layer map has {self.num_layers} layers, the {who} {n}"
        d = teacher_config.get("hidden_size")
        if d is not None and d != self.hidden_size:
            return f"the layer map reads a stream of width {self.hidden_size}, the teacher's is {d}"
        return None

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / MAP_FILE
        tensors = {f"basis.{k}": b.to(torch.float32).contiguous() for k, b in enumerate(self.bases)}
        tensors["layer_basis"] = torch.tensor(self.layer_basis, dtype=torch.int64)
        tensors["layer_width"] = torch.tensor(self.layer_width, dtype=torch.int64)
        metadata = {
            "format": FORMAT,
            "kind": self.kind,
            "hidden_size": str(self.hidden_size),
            "num_layers": str(self.num_layers),
            "conversion": self.conversion,
        }
        path.write_bytes(_safetensors_bytes(tensors, metadata))
        return path


_DTYPES = {torch.float32: "F32", torch.int64: "I64"}


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """``tensors`` (float32 or int64) as a safetensors file whose bytes depend on the tensors and metadata alone:
    keys in sorted order. (safetensors' own ``save_file`` writes the metadata in a hash map's order, which changes
    from one process to the next, so two identical conversions would write different bytes.)"""
    header, blobs, offset = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def read_layer_map(folder: str | Path) -> LayerMap | None:
    """The layer map stored in ``folder`` (``None`` when there is none). A file of another format
    raises ``ValueError``."""
    path = Path(folder) / MAP_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an hf_symmetry layer map (format {meta.get('format')!r})")
        t = {k: f.get_tensor(k) for k in f.keys()}
    n_bases = sum(1 for k in t if k.startswith("basis."))
    return LayerMap(
        meta["kind"],
        int(meta["hidden_size"]),
        t["layer_basis"].tolist(),
        t["layer_width"].tolist(),
        [t[f"basis.{k}"] for k in range(n_bases)],
        meta.get("conversion", ""),
    )


class LayerMapRecorder:
    """Collects a rotation map as a conversion writes its layers (:class:`...compress.assemble.Assembler`):
    ``add(l, Q, w)`` with the full rotation ``Q [d, d]`` of the segment layer ``l`` writes. One global
    rotation (the same tensor for every layer) is stored once, at its widest width."""

    def __init__(self, num_layers: int, hidden_size: int, conversion: str = ""):
        self.map = LayerMap("rotation", hidden_size, [-1] * num_layers, [hidden_size] * num_layers, [], conversion)
        self._last = None  # the last distinct rotation (identity check only)

    def add(self, layer: int, Q: torch.Tensor, width: int) -> None:
        m = self.map
        if self._last is not None and Q is self._last:
            k = len(m.bases) - 1
            if width > m.bases[k].shape[1]:
                m.bases[k] = Q[:, :width].to(torch.float32).clone()
        else:
            m.bases.append(Q[:, :width].to(torch.float32).clone())
            self._last = Q
            k = len(m.bases) - 1
        m.layer_basis[layer], m.layer_width[layer] = k, width

    def complete(self) -> bool:
        return all(k >= 0 for k in self.map.layer_basis)
