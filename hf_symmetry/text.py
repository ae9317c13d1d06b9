"""Texts: read from a file, cut to token ids, and named in public (cards, reports) without a
local path. Calibration, evaluation and the hub all read texts through here."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers

from .assets import TEXT_NAMES, cache_dir


def read_text(path: str | Path) -> str:
    """The text of a UTF-8 file. An empty file, a binary one (a NUL byte) or one in another encoding raises
    ``ValueError`` naming the file and what is wrong."""
    data = Path(path).read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"text file {path} is binary (a NUL byte at offset {nul}), not UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"text file {path} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}): convert it, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return text.removeprefix("\ufeff")


def tokenize_text(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """1-D LongTensor of token ids for ``text`` (no special tokens), at most ``max_tokens``.

    Only about ``16 * max_tokens`` characters are tokenised, so a long text costs nothing extra
    and the tokenizer's "longer than the specified maximum sequence length" warning, which
    does not apply here (the ids are windowed afterwards), is silenced."""
    if max_tokens:
        text = _prefix_with_tokens(tokenizer, text, max_tokens)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the max-length warning is about model inputs, not these ids
    try:
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    finally:
        transformers.logging.set_verbosity(verbosity)
    if not ids:
        raise ValueError("text tokenises to zero tokens")
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def _prefix_with_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """A prefix of ``text`` long enough for ``max_tokens`` tokens (doubling from 8 characters per token)."""
    chars = 8 * max_tokens
    while chars < len(text):
        cut = text.rfind(" ", 0, chars)
        prefix = text[: cut if cut > chars // 2 else chars]
        if len(tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"]) > max_tokens:
            return prefix
        chars *= 2
    return text


def public_text_label(text: str | os.PathLike) -> str:
    """An embedded text by its name, a file by its base name (local paths stay private)."""
    s = str(text)
    if s in TEXT_NAMES:
        return s
    path = Path(s)
    if path.stem in TEXT_NAMES and path.resolve().is_relative_to(cache_dir().resolve()):
        return path.stem  # an embedded text, resolved to its cached file
    return path.name
