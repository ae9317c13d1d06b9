"""Streaming safetensors I/O shared by every weight-space conversion.

Peak memory is bounded by what the caller holds (one layer, the embeddings): tensors are
read on demand from (possibly sharded) safetensors files straight into owned buffers, and
written tensor by tensor into shard files whose header is filled in when the shard closes.
Output goes to a temporary sibling folder that is renamed into place only when everything
succeeded.
"""

from __future__ import annotations

import contextlib
import fcntl
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


def parse_size(size: str | int, flag: str = "--max-shard-size") -> int:
    """A size in bytes from ``2GB``, ``500MB``, ``64KB``, ``1000B`` or a plain count of bytes; anything else (or a
    size that is not positive) is refused naming ``flag`` and the accepted forms."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        s = str(size).strip().upper()
        mult = 1
        for unit, m in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
            if s.endswith(unit):
                s, mult = s[: -len(unit)].strip(), m
                break
        try:
            number = float(s)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"{flag} {size!r} is not a size: give e.g. 2GB, 500MB, 64KB or a number of bytes")
        value = int(number * mult)
    if value <= 0:
        raise ValueError(f"{flag} must be positive, got {size!r}")
    return value


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


#: the file in every folder :func:`atomic_output_dir` writes: the files it wrote, one relative path a line (what
#: ``--overwrite`` may replace). Its bytes depend only on those names (no time, no pid).
MANIFEST = ".hf-symmetry-files"
#: files of a Hugging Face model folder, which ``--overwrite`` may replace though no hf-symmetry run wrote them
_HF_NAMES = frozenset({"config.json", "README.md", ".gitattributes", INDEX_FILE, *SIDE_FILES, *TOKENIZER_FILES})
_HF_NAME = re.compile(r"^(?:[^/]+\.(?:safetensors|py|json)|pytorch_model[^/]*\.bin)$")
#: leftovers of a run that was killed (its pid in the name): ``.OUT.partial-<pid>-*``, ``.OUT.old-<pid>``,
#: ``.OUT.lock`` (the pid inside); in the asset cache, ``.build-<pid>-*`` and ``.pkg-<pid>-*``
_PARTIAL = re.compile(r"^\.(.+)\.partial-(\d+)-.+$")
_OLD = re.compile(r"^\.(.+)\.old-(\d+)$")
_LOCK = re.compile(r"^\.(.+)\.lock$")
_BUILD = re.compile(r"^\.(?:build|pkg)-(\d+)-.+$")


def foreign_files(folder: str | os.PathLike) -> list[str]:
    """The entries of ``folder`` (relative paths; a folder's own name for what lies in it) that ``--overwrite``
    must not replace: those neither in its :data:`MANIFEST` (written by hf-symmetry) nor, in a folder with a
    ``config.json``, files of a Hugging Face model folder (config, weights, tokenizer, card, remote code)."""
    folder = Path(folder)
    listed = set((folder / MANIFEST).read_text().splitlines()) if (folder / MANIFEST).is_file() else set()
    hf = (folder / "config.json").is_file()
    foreign = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        if not dirs and not files and rel_root != Path("."):
            foreign.append(rel_root.as_posix())  # an empty folder: nobody's output
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = (rel_root / name).as_posix()
            if rel in listed or rel == MANIFEST or (hf and (rel in _HF_NAMES or _HF_NAME.match(rel))):
                continue
            foreign.append(rel)
    return sorted({f.split("/")[0] for f in foreign})


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def input_bytes(folder: str | os.PathLike) -> int:
    """Bytes of a model folder's weights (``*.safetensors``), or of a file: an output's expected size."""
    folder = Path(folder)
    if folder.is_file():
        return folder.stat().st_size
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.is_dir() else 0


def check_output_dir(
    out: str | os.PathLike, overwrite: bool, inputs=(), need_bytes: int = 0, is_file: bool = False
) -> Path:
    """Refuse, before any work, an OUT folder (or, ``is_file``, an OUT file) that is, contains or lies inside one of
    ``inputs``, that is the current folder or one above it, that exists and is not empty (unless ``overwrite``),
    or, with ``overwrite``, that holds files hf-symmetry did not write (:func:`foreign_files`; a file OUT: one
    not ending in ``.gguf``); one whose disk cannot be written or has less than ``need_bytes`` free."""
    out = Path(out)
    real = out.resolve()
    for given in inputs:
        src = Path(given).resolve()
        if real == src:
            raise ValueError(f"OUT {out} is the input {given}: write the output to another {_kind(is_file)}")
        if not is_file and src.is_relative_to(real):
            raise ValueError(f"OUT {out} contains the input {given}: write the output to another folder")
        if real.is_relative_to(src) and src.is_dir() and not is_file:
            raise ValueError(f"OUT {out} lies inside the input {given}: write the output outside it")
    if Path.cwd().resolve().is_relative_to(real):
        where = "the current folder" if Path.cwd().resolve() == real else "a folder above the current one"
        raise ValueError(f"OUT {out} is {where}: write the output to another folder")
    if out.is_symlink():  # (the swap would replace the link, or fail on a dangling one): name the real path
        raise FileExistsError(f"OUT {out} is a symbolic link (to {os.readlink(out)}): name the real {_kind(is_file)}")
    if is_file:
        if out.is_dir():
            raise FileExistsError(f"output {out} is a folder: name a file")
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists (use --overwrite)")
        if out.exists() and (out.suffix != ".gguf" or not _is_gguf(out)):
            raise FileExistsError(f"{out} exists and is not a .gguf file: --overwrite replaces only a .gguf file")
    else:
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"output {out} exists and is not a folder")
        if out.is_dir() and any(out.iterdir()):
            if not overwrite:
                raise FileExistsError(f"output folder {out} exists and is not empty (pass --overwrite to replace it)")
            foreign = foreign_files(out)
            if foreign:
                more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
                raise FileExistsError(
                    f"output folder {out} holds {foreign[0]!r}{more}"
                    ", which hf-symmetry did not write: --overwrite replaces only folders hf-symmetry wrote and "
                    "Hugging Face model folders; choose another OUT"
                )
    _check_disk(out, need_bytes)
    return out


def _is_gguf(path: Path) -> bool:
    """Whether a file starts with GGUF's magic (a file merely named ``*.gguf`` is the user's, not a GGUF)."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _kind(is_file: bool) -> str:
    return "file" if is_file else "folder"


def _check_disk(out: Path, need_bytes: int) -> None:
    """Refuse an OUT on a disk that cannot be written, or with less than ``need_bytes`` free."""
    where = _nearest_existing(out.absolute().parent)
    if not os.access(where, os.W_OK):
        raise ValueError(f"cannot write {out}: {where} is read-only or not writable; choose an OUT you can write")
    free = shutil.disk_usage(where).free
    if need_bytes and free < need_bytes:
        raise ValueError(
            f"not enough free space for {out}: about {need_bytes / 1e9:.2f} GB needed (the input's size), "
            f"{free / 1e9:.2f} GB free on {where}; free some space or choose OUT on another disk"
        )


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


def _lock_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def remove_stale_leftovers(folder: str | os.PathLike, builds: bool = False) -> list[Path]:
    """Remove, from ``folder``, what runs that were killed left there (their pid is in the name and the process
    is gone), saying so on stderr: ``.OUT.partial-<pid>-*`` folders and files, ``.OUT.lock`` files that no process
    holds, and ``.OUT.old-<pid>`` (a previous OUT: put back as OUT when OUT is missing, else removed); with
    ``builds`` (the asset cache), ``.build-<pid>-*`` and ``.pkg-<pid>-*``. Returns what was removed or put back.
    Nothing else is touched, nor anything of a live process."""
    folder = Path(folder)
    done: list[Path] = []
    if not folder.is_dir():
        return done
    for entry in sorted(folder.iterdir()):
        name = entry.name
        m = _PARTIAL.match(name) or _OLD.match(name) or (builds and _BUILD.match(name))
        if m:
            pid = int(m.group(m.re.groups))
            if _pid_alive(pid):
                continue
            if m.re is _OLD and not (folder / m.group(1)).exists():
                os.replace(entry, folder / m.group(1))
                _say(f"put back {m.group(1)} in {folder} from {name}: a run (pid {pid}) was killed while replacing it")
            else:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                _say(f"removed {name}, left in {folder} by a run (pid {pid}) that was killed before it finished")
            done.append(entry)
        elif _LOCK.match(name) and entry.is_file() and _take_stale_lock(entry):
            done.append(entry)
    return done


def remove_stale_partials(out: str | os.PathLike) -> list[Path]:
    """:func:`remove_stale_leftovers` in the folder of ``out``."""
    return remove_stale_leftovers(Path(out).absolute().parent)


def _say(line: str) -> None:
    print(f"hf-symmetry: {line}", file=sys.stderr)


def _take_stale_lock(path: Path) -> bool:
    """Remove the lock file ``path`` when no process holds it and its pid is gone."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        pid = _lock_pid(path)
        if _pid_alive(pid):
            return False
        path.unlink(missing_ok=True)
        _say(f"removed {path.name}, left in {path.parent} by a run (pid {pid}) that was killed before it finished")
        return True
    except OSError:  # held by a live run
        return False
    finally:
        os.close(fd)


_HELD_LOCKS: dict[Path, list[int]] = {}  # lock file -> [fd, depth]: this process's locks (they nest)


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[None]:
    """Hold ``.OUT.lock`` (next to ``out``, holding the pid) while writing ``out``: a second run that writes the same
    OUT is refused while this one runs (FileExistsError). ``flock`` holds it, so a killed run's lock is free
    for the next (which takes it over); nested calls in one process share it."""
    out = Path(out).absolute()
    path = out.parent / f".{out.name}.lock"
    if path in _HELD_LOCKS:
        _HELD_LOCKS[path][1] += 1
        try:
            yield
        finally:
            _HELD_LOCKS[path][1] -= 1
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileExistsError(
                f"another hf-symmetry run (pid {_lock_pid(path)}) is writing {out}: wait for it to finish or "
                "choose another OUT"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:  # the holder before us removed it: take the new one
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD_LOCKS[path] = [fd, 1]
    try:
        yield
    finally:
        _HELD_LOCKS[path][1] -= 1
        if _HELD_LOCKS[path][1] == 0:
            del _HELD_LOCKS[path]
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)


def _write_manifest(folder: Path) -> None:
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    (folder / MANIFEST).write_text("".join(f"{f}\n" for f in files if f != MANIFEST))


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` (``.OUT.partial-<pid>-*``); on success it replaces ``out`` (with its
    :data:`MANIFEST`), on any error (an interruption included) it is deleted and ``out`` is left as it was. The
    writing holds :func:`output_lock`. A run killed outright (SIGKILL, out of memory) cannot clean up: the next
    run removes what it left (:func:`remove_stale_leftovers`, also called by every command at its start)."""
    out = check_output_dir(out, overwrite).absolute()
    with output_lock(out):
        remove_stale_leftovers(out.parent)  # (may put a previous OUT back: checked next)
        check_output_dir(out, overwrite)  # (again: another run may have written it before we held the lock)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-{os.getpid()}-"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should be an ordinary folder
        try:
            yield tmp
            for f in tmp.rglob("*"):  # ordinary file modes, whatever wrote them (save_pretrained writes 0600)
                if f.is_file() and not f.is_symlink():
                    os.chmod(f, 0o666 & ~umask)
            _write_manifest(tmp)
            _replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextlib.contextmanager
def atomic_output_file(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of the file ``out`` (``.OUT.partial-<pid>-file``), which replaces ``out`` on
    success and is deleted on any error (an interruption included); the writing holds :func:`output_lock`."""
    out = Path(out).absolute()
    with output_lock(out):
        tmp = out.with_name(f".{out.name}.partial-{os.getpid()}-file")
        try:
            yield tmp
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _replace(tmp: Path, out: Path) -> None:
    """Put ``tmp`` in the place of ``out``; a failure leaves ``out`` as it was."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def config_dtype(config: dict) -> torch.dtype:
    """The dtype a checkpoint's config names (``dtype`` or ``torch_dtype``; float32 where it names none)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), torch.float32)


def write_config(dst: Path, config: dict) -> None:
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
