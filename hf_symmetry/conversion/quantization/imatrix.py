"""Importance-matrix files as llama.cpp reads them (``llama-quantize --imatrix FILE``).

``llama-imatrix`` runs the model on a text and keeps, for every matrix multiplication's weight, the sum over
tokens of each input column's square (``in_sum2``) and the number of tokens (``counts``); ``llama-quantize``
weights column ``j`` of that tensor by ``in_sum2_j / counts`` (tools/quantize/quantize.cpp), i.e. by the mean
square activation ``E[x_j²]``: the diagonal of the second moment ``H = E[xᵀx]`` that the calibration engine
collects. This llama.cpp (``0c1e57098``) writes and reads the GGUF format (tools/imatrix/imatrix.cpp
``save_imatrix``; common/imatrix-loader.cpp): KV ``general.type = "imatrix"``, ``imatrix.datasets`` (strings),
``imatrix.chunk_count``, ``imatrix.chunk_size`` (u32), and per weight two F32 tensors, ``<name>.in_sum2`` of
``ne = [n_cols, 1]`` and ``<name>.counts`` of ``ne = [1, 1]``, in sorted name order. (The legacy ``.dat``
format is still read, but the loader prefers GGUF.)
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

#: canonical linear -> (GGUF tensor role, the calibration site whose second moment is its input's)
ROLES = {
    "q": ("attn_q", "attn_in"),
    "k": ("attn_k", "attn_in"),
    "v": ("attn_v", "attn_in"),
    "o": ("attn_output", "o_in"),
    "gate": ("ffn_gate", "ffn_in"),
    "up": ("ffn_up", "ffn_in"),
    "down": ("ffn_down", "down_in"),
}


def gguf_name(layer: int, linear: str) -> str:
    """The GGUF tensor name of a canonical decoder linear (llama, mistral and qwen2 share them)."""
    return f"blk.{layer}.{ROLES[linear][0]}.weight"


def imatrix_values(in_sum2, counts) -> np.ndarray:
    """What llama-quantize weights the columns by: ``in_sum2 / counts`` in float32 (1 where the count is 0)."""
    s = np.asarray(in_sum2, dtype=np.float32)
    c = np.float32(counts)
    return (s / c).astype(np.float32) if c > 0 else np.ones_like(s)


def entries_from_stats(stats: list[dict[str, torch.Tensor]], tokens: int, linears=tuple(ROLES)) -> dict:
    """``{gguf name: (in_sum2 float32 [n_cols], count)}`` from per-layer second moments (``{site: H}``, the
    mean over ``tokens`` tokens, as :func:`.scales.layer_stats` returns them): ``in_sum2 = diag(H) · tokens``."""
    out = {}
    for i, st in enumerate(stats):
        for lin in linears:
            H = st[ROLES[lin][1]]
            diag = (H.diagonal() if H.ndim == 2 else H).to(torch.float64)
            out[gguf_name(i, lin)] = ((diag * tokens).to(torch.float32).numpy(), int(tokens))
    return out


def write_imatrix(path: str | Path, entries: dict, datasets: list[str], chunk_count: int, chunk_size: int) -> Path:
    """Write ``entries`` (``{gguf name: (in_sum2, count)}``) as a GGUF imatrix file, the keys and tensor layout
    of ``llama-imatrix``'s own."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch="")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama-imatrix writes no architecture
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
    for name in sorted(entries):
        sums, count = entries[name]
        writer.add_tensor(f"{name}.in_sum2", np.asarray(sums, dtype=np.float32).reshape(1, -1))
        writer.add_tensor(f"{name}.counts", np.full((1, 1), count, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return path


def read_imatrix(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """``({gguf name: in_sum2 / counts (float32)}, {datasets, chunk_count, chunk_size, type})`` of a GGUF imatrix
    file, read with the ``gguf`` package."""
    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    meta = {
        "type": field(gguf.Keys.General.TYPE),
        "datasets": field(gguf.Keys.IMatrix.DATASETS),
        "chunk_count": field(gguf.Keys.IMatrix.CHUNK_COUNT),
        "chunk_size": field(gguf.Keys.IMatrix.CHUNK_SIZE),
    }
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    values = {}
    for name, data in tensors.items():
        if name.endswith(".in_sum2"):
            base = name[: -len(".in_sum2")]
            values[base] = imatrix_values(data.reshape(-1), tensors[f"{base}.counts"].reshape(-1)[0])
    return values, meta
