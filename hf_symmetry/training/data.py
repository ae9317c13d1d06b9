"""Training data: local text files (UTF-8) or JSONL, tokenised and packed into fixed-length sequences.

* A **document** is one JSONL record's ``"text"`` field, or one blank-line-separated block of a text
  file (a paragraph or an article section), so that a single long text file still splits.
* The **train/validation split is by document**: a document goes wholly to one side, chosen by a
  hash of (seed, file name, document index) — deterministic, independent of file order and of the
  number of processes, and never sharing text between the two sides.
* Each side's documents are tokenised (no special tokens), each followed by the tokenizer's EOS
  token when it has one, concatenated in order, and cut into non-overlapping ``seq_len`` windows
  (the remainder is dropped). ``labels`` equal ``input_ids``: the model shifts them.

Everything here is deterministic: the same files, tokenizer and settings give the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["read_documents", "split_documents", "pack_documents", "PackedDataset", "build_datasets", "TextData"]


def read_documents(paths) -> list[tuple[str, str]]:
    """``[(source, document_text), ...]`` from text files and ``.jsonl`` files (``"text"`` field).

    ``source`` is ``"<file name>#<index>"``, used for the deterministic split. Raises ``ValueError``
    for a file that is not valid UTF-8, a JSONL record without a string ``"text"``, or when no file
    holds any non-blank text; ``FileNotFoundError`` for a missing file."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise ValueError("no training text given")
    docs: list[tuple[str, str]] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist")
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if path.suffix.lower() == ".jsonl":
            for lineno, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'{path}:{lineno}: a JSONL record needs a string "text" field')
                if record["text"].strip():
                    docs.append((f"{path.name}#{lineno}", record["text"]))
        else:
            blocks = [b.strip() for b in re.split(r"\n\s*\n", raw)]
            docs += [(f"{path.name}#{i}", b) for i, b in enumerate(blocks) if b]
    if not docs:
        raise ValueError(f"the training text ({', '.join(str(p) for p in paths)}) is empty")
    return docs


def _bucket(seed: int, source: str) -> float:
    h = hashlib.sha256(f"{seed}:{source}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_documents(docs, validation_fraction: float = 0.05, seed: int = 0):
    """``(train_docs, validation_docs)``: each document goes wholly to one side, by a hash of
    ``(seed, source)``. With ``validation_fraction > 0`` and at least two documents, validation gets
    at least one document and train keeps at least one."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {validation_fraction}")
    keys = [_bucket(seed, src) for src, _ in docs]
    val = [k < validation_fraction for k in keys]
    if validation_fraction > 0 and len(docs) >= 2:
        if not any(val):
            val[min(range(len(docs)), key=keys.__getitem__)] = True
        if all(val):
            val[max(range(len(docs)), key=keys.__getitem__)] = False
    train = [d for d, v in zip(docs, val) if not v]
    valid = [d for d, v in zip(docs, val) if v]
    return train, valid


def pack_documents(tokenizer, docs, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """``[n, seq_len]`` LongTensor: the documents tokenised (each followed by EOS when the tokenizer has
    one), concatenated in order, truncated to ``max_tokens`` and cut into whole windows."""
    if seq_len < 2:
        raise ValueError(f"sequence length must be at least 2, got {seq_len}")
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for _, text in docs:
        ids += tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        if eos is not None:
            ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length token windows (``[n, seq_len]``); item ``i`` is ``{"input_ids", "labels"}`` (equal:
    the model shifts), plus any extra per-sequence tensors given in ``extras`` (e.g. cached teacher
    logits, indexed by the same ``i``)."""

    def __init__(self, sequences: torch.Tensor, extras: dict[str, torch.Tensor] | None = None):
        self.sequences = sequences
        self.extras = dict(extras or {})

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def __getitem__(self, i):
        item = {"input_ids": self.sequences[i], "labels": self.sequences[i]}
        for k, v in self.extras.items():
            item[k] = v[i]
        return item

    @property
    def tokens(self) -> int:
        return self.sequences.numel()


@dataclass
class TextData:
    """What :func:`build_datasets` returns: the two datasets and where they came from."""

    train: PackedDataset
    validation: PackedDataset | None
    train_documents: int
    validation_documents: int
    seq_len: int

    def as_dict(self) -> dict:
        return dict(
            train_sequences=len(self.train),
            train_tokens=self.train.tokens,
            validation_sequences=0 if self.validation is None else len(self.validation),
            validation_tokens=0 if self.validation is None else self.validation.tokens,
            train_documents=self.train_documents,
            validation_documents=self.validation_documents,
            seq_len=self.seq_len,
        )


def build_datasets(
    tokenizer,
    paths,
    seq_len: int = 512,
    validation_fraction: float = 0.05,
    max_train_tokens: int | None = None,
    max_validation_tokens: int | None = None,
    seed: int = 0,
) -> TextData:
    """Read ``paths`` (text files / JSONL), split by document, tokenise and pack both sides.

    Raises ``ValueError`` before returning if the text is empty or too short for one training
    sequence of ``seq_len`` tokens. ``validation`` is ``None`` when ``validation_fraction`` is 0 or
    the validation documents are shorter than one sequence."""
    docs = read_documents(paths)
    train_docs, val_docs = split_documents(docs, validation_fraction, seed)
    train = pack_documents(tokenizer, train_docs, seq_len, max_train_tokens)
    if train.shape[0] == 0:
        raise ValueError(f"the training text is shorter than one sequence of {seq_len} tokens")
    val = pack_documents(tokenizer, val_docs, seq_len, max_validation_tokens) if val_docs else None
    return TextData(
        PackedDataset(train),
        PackedDataset(val) if val is not None and val.shape[0] else None,
        len(train_docs),
        len(val_docs),
        seq_len,
    )
