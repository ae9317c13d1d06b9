"""Streaming safetensors I/O shared by every weight-space conversion.

Peak memory is bounded by what the caller holds (one layer, the embeddings): tensors are
read on demand from (possibly sharded) safetensors files straight into owned buffers, and
written tensor by tensor into shard files whose header is filled in when the shard closes.
Output goes to a temporary sibling folder that is renamed into place only when everything
succeeded.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files a conversion carries over unchanged: tokenizer and generation settings.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
#: files of which one makes a folder's tokenizer loadable by AutoTokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


class CheckpointReader:
    """Lazy access to the tensors of an HF folder stored as safetensors (single or sharded)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model folder {self.path} does not exist")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{self.path} has no config.json: not a Hugging Face model folder")
        self.config = json.loads(cfg.read_text())
        self.key_to_file: dict[str, str] = {}
        self._locations: dict[str, tuple] = {}  # key -> (file, dtype, shape, byte offset, byte size)
        index = self.path / INDEX_FILE
        if index.is_file():
            self.key_to_file = dict(json.loads(index.read_text())["weight_map"])
        elif (self.path / SINGLE_FILE).is_file():
            self.key_to_file = dict.fromkeys(self._header_keys(SINGLE_FILE), SINGLE_FILE)
        else:
            raise FileNotFoundError(
                f"{self.path} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); "
                "hf_symmetry reads only safetensors"
            )
        for fname in sorted(set(self.key_to_file.values())):
            if not (self.path / fname).is_file():
                raise FileNotFoundError(f"{self.path}: shard {fname} named in the index is missing")
            # Validate every header up front (safetensors also checks offsets against the file
            # size), so a corrupt or truncated shard fails before any output is written.
            absent = {k for k, f in self.key_to_file.items() if f == fname} - set(self._header_keys(fname))
            if absent:
                raise ValueError(
                    f"corrupt checkpoint {self.path}: {fname} lacks {sorted(absent)[:3]} named in the index"
                )

    def _header_keys(self, fname: str) -> list[str]:
        """Keys of one shard, validated by safetensors itself (offsets against the file size);
        also records where each tensor's bytes lie, for :meth:`get`."""
        try:
            with safe_open(self.path / fname, framework="pt") as f:
                keys = list(f.keys())
            with open(self.path / fname, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"corrupt safetensors file {self.path / fname}: {exc}") from None
        for k in keys:
            entry = header[k]
            if entry["dtype"] not in _TORCH_DTYPES:
                raise ValueError(
                    f"{self.path / fname}: tensor {k} has dtype {entry['dtype']}, which hf_symmetry "
                    f"does not read (supported: {', '.join(_TORCH_DTYPES)})"
                )
            start, end = entry["data_offsets"]
            self._locations[k] = (
                fname,
                _TORCH_DTYPES[entry["dtype"]],
                tuple(entry["shape"]),
                8 + n + start,
                end - start,
            )
        return keys

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def get(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read the named tensors into memory the caller owns. Bytes are read straight into each
        tensor's buffer (no memory map: a mapped copy would count in RSS next to the owned one)."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            by_file[self.key_to_file[n]].append(n)
        out = {}
        for fname, keys in by_file.items():
            with open(self.path / fname, "rb") as f:
                for k in sorted(keys, key=lambda k: self._locations[k][3]):  # in file order
                    _, dtype, shape, offset, size = self._locations[k]
                    t = torch.empty(shape, dtype=dtype)
                    f.seek(offset)
                    if size and f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != size:
                        raise ValueError(f"corrupt safetensors file {self.path / fname}: {k} is truncated")
                    out[k] = t
        return {n: out[n] for n in names}

    def get_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (sorted unique indices) of the 2-D tensor ``name``, reading only their bytes
        (e.g. the embedding rows of the calibration tokens)."""
        fname, dtype, shape, offset, _ = self._locations[name]
        width = math.prod(shape[1:])
        out = torch.empty((len(rows), *shape[1:]), dtype=dtype)
        row_bytes = width * out.element_size()
        with open(self.path / fname, "rb") as f:
            for j, r in enumerate(rows.tolist()):
                f.seek(offset + r * row_bytes)
                if f.readinto(memoryview(out[j].reshape(-1).view(torch.uint8).numpy())) != row_bytes:
                    raise ValueError(f"corrupt safetensors file {self.path / fname}: {name} is truncated")
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the safetensors headers (no tensor data is read)."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for k, fname in self.key_to_file.items():
            by_file[fname].append(k)
        out = {}
        for fname, keys in by_file.items():
            try:
                with safe_open(self.path / fname, framework="pt") as f:
                    out.update({k: tuple(f.get_slice(k).get_shape()) for k in keys})
            except (SafetensorError, OSError, ValueError) as exc:
                raise ValueError(f"corrupt safetensors file {self.path / fname}: {exc}") from None
        return out

    def dtypes(self) -> dict[str, torch.dtype]:
        """Every tensor's stored dtype, from the safetensors headers (no tensor data is read)."""
        return {k: loc[1] for k, loc in self._locations.items()}

    def total_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in set(self.key_to_file.values()))


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


class RowBlocks:
    """A tensor made a block of rows at a time, when it is written (:class:`ShardedWriter` streams the
    blocks into the shard), so that a vocabulary-sized factor is never in memory whole.
    ``make_blocks()`` yields its blocks in order along dimension ``row_dim`` (each with the tensor's
    other dimensions; any dtype: each is cast to :attr:`dtype`). :meth:`to` changes the dtype and
    :meth:`permute` the layout lazily; :meth:`materialise` makes the whole tensor (for consumers that
    need one). The blocks are written as they come where the dimensions before ``row_dim`` have size
    1 (then their bytes follow each other in the tensor's)."""

    def __init__(self, shape, dtype: torch.dtype, make_blocks, row_dim: int = 0):
        self.shape, self.dtype, self._make, self.row_dim = torch.Size(shape), dtype, make_blocks, row_dim

    def to(self, dtype: torch.dtype) -> "RowBlocks":
        return RowBlocks(self.shape, dtype, self._make, self.row_dim)

    def permute(self, *dims: int) -> "RowBlocks":
        make = self._make
        return RowBlocks(
            [self.shape[d] for d in dims],
            self.dtype,
            lambda: (block.permute(*dims) for block in make()),
            dims.index(self.row_dim),
        )

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def streamable(self) -> bool:
        """Whether the blocks' bytes, one after the other, are the tensor's (C order)."""
        return all(n == 1 for n in self.shape[: self.row_dim])

    def blocks(self) -> Iterator[torch.Tensor]:
        rows = 0
        for block in self._make():
            rows += block.shape[self.row_dim]
            yield block.to(device="cpu", dtype=self.dtype).contiguous()
        if rows != self.shape[self.row_dim]:
            raise RuntimeError(f"row blocks gave {rows} rows for a tensor of shape {tuple(self.shape)}")

    def materialise(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        i = 0
        for block in self.blocks():
            n = block.shape[self.row_dim]
            out.narrow(self.row_dim, i, n).copy_(block)
            i += n
        return out


class ShardedWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` as they come.

    Memory holds one tensor at a time, whatever the shard size: tensor bytes go straight into
    the shard file after a reserved header region, and the header is written into that region
    when the shard closes, padded with spaces (the safetensors format allows trailing
    whitespace in the header). A header too large for the reservation (thousands of tensors
    in one shard) falls back to copying the data behind it. The layout is the documented one:
    an 8-byte little-endian header length, a JSON header padded to 8 bytes, then the raw data."""

    HEADER_RESERVE = 128 * 1024  # ~1000 tensor entries; a few hundred are typical per shard

    def __init__(self, folder: Path, max_shard_bytes: int = 2 * 10**9, metadata: dict | None = None):
        self.folder = Path(folder)
        self.max_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self._file = None
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, tensors: dict[str, torch.Tensor | RowBlocks]) -> None:
        """Write ``tensors`` (a :class:`RowBlocks` value is written as its blocks come)."""
        for name, t in tensors.items():
            if t.dtype not in _ST_DTYPES:
                raise TypeError(f"cannot store dtype {t.dtype} in safetensors ({name})")
            size = math.prod(t.shape) * t.dtype.itemsize
            if self._header and self._offset + size > self.max_bytes:
                self.flush()
            if self._file is None:
                self._file = open(self.folder / f"shard-{len(self.shards):05d}.tmp", "wb")
                self._file.seek(self.HEADER_RESERVE)
            if isinstance(t, RowBlocks) and not t.streamable:
                t = t.materialise()
            for block in t.blocks() if isinstance(t, RowBlocks) else (t.detach().contiguous(),):
                self._file.write(memoryview(block.reshape(-1).view(torch.uint8).numpy()))
            self._header[name] = {
                "dtype": _ST_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [self._offset, self._offset + size],
            }
            self._offset += size
            self.total_bytes += size

    def flush(self) -> None:
        if self._file is None:
            return
        path = Path(self._file.name)
        header = json.dumps({"__metadata__": self.metadata, **self._header}, separators=(",", ":")).encode()
        if 8 + len(header) <= self.HEADER_RESERVE:
            header += b" " * (self.HEADER_RESERVE - 8 - len(header))
            self._file.seek(0)
            self._file.write(len(header).to_bytes(8, "little"))
            self._file.write(header)
            self._file.close()
        else:
            self._file.close()
            header += b" " * (-len(header) % 8)
            spool = path.with_suffix(".spool")
            os.replace(path, spool)
            with open(path, "wb") as out, open(spool, "rb") as data:
                out.write(len(header).to_bytes(8, "little"))
                out.write(header)
                data.seek(self.HEADER_RESERVE)
                shutil.copyfileobj(data, out, length=16 * 2**20)
            spool.unlink()
        self.shards.append((path.name, list(self._header)))
        self._file, self._header, self._offset = None, {}, 0

    def close(self) -> list[str]:
        """Flush, give shards their final HF names, write the index when sharded."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.folder / self.shards[0][0], self.folder / SINGLE_FILE)
            return [SINGLE_FILE]
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / final)
            weight_map.update({k: final for k in keys})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def check_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse a non-empty OUT unless overwriting; call before any work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output folder {out} exists and is not empty (pass --overwrite to replace it)")
    return out


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_partials(out: str | os.PathLike) -> list[Path]:
    """Delete the ``.OUT.partial-<pid>-*`` siblings of ``out`` left by runs that were killed (their
    process is gone), saying so on stderr; returns what was removed. Folders of live processes,
    names without a pid, and ``.OUT.old-*`` (a previous output being replaced) are left alone."""
    out = Path(out).absolute()
    removed = []
    if not out.parent.is_dir():
        return removed
    pattern = re.compile(re.escape(f".{out.name}.") + r"partial-(\d+)-.*$")
    for entry in out.parent.iterdir():
        m = pattern.match(entry.name)
        if m and entry.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            print(
                f"hf-symmetry: removed {entry.name}, left in {out.parent} by a run (pid {m.group(1)}) that was "
                "killed before it finished",
                file=sys.stderr,
            )
    return removed


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` (``.OUT.partial-<pid>-*``); on success it replaces
    ``out``, on any error it is deleted and ``out`` is left as it was. A run killed outright
    (SIGKILL, out of memory) cannot clean up: the next run on the same ``out`` removes such
    folders whose process is gone (:func:`remove_stale_partials`)."""
    out = check_output_dir(out, overwrite).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-{os.getpid()}-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should be an ordinary folder
    try:
        yield tmp
        for f in tmp.rglob("*"):  # ordinary file modes, whatever wrote them (save_pretrained writes 0600)
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~umask)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def write_config(dst: Path, config: dict) -> None:
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
