"""Calibration text as token ids, and the ids cut into the batches every calibrated conversion
runs through the model (the one place that decides how calibration text is batched);
:class:`CalibrationText`, the one shape in which a conversion is given its calibration text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..assets import resolve_text
from ..text import read_text, tokenize_text


@dataclass(frozen=True)
class CalibrationText:
    """The calibration text of a conversion (compress, to-tpa, farr, merge): ``text``, a UTF-8 file or an
    embedded name (e.g. ``britannica-calib``), whose first ``tokens`` tokens run through the model in sequences
    of ``seq_len`` tokens, ``batch_size`` at a time (:func:`token_batches`; a conversion that cuts its own
    windows reads only ``text`` and ``tokens``)."""

    text: str | Path = "britannica-calib"
    tokens: int = 2048
    seq_len: int = 512
    batch_size: int = 1

    def ids(self, tokenizer) -> torch.Tensor:
        """The first ``tokens`` token ids of the text in ``tokenizer`` (:func:`calibration_ids`)."""
        return calibration_ids(tokenizer, self.text, self.tokens)

    def batches(self, ids: torch.Tensor, keep_partial: bool = True) -> list[torch.Tensor]:
        """``ids`` cut into ``[batch_size, seq_len]`` batches (:func:`token_batches`)."""
        return token_batches(ids, self.seq_len, self.batch_size, keep_partial)


def calibration_ids(tokenizer, text: str | Path, tokens: int) -> torch.Tensor:
    """The first ``tokens`` token ids (1-D, no special tokens) of ``text``: a file or an embedded
    text name (e.g. ``britannica-calib``)."""
    if tokens <= 0:
        raise ValueError(f"calibration needs a positive number of tokens, got {tokens}")
    return tokenize_text(tokenizer, read_text(resolve_text(text)), max_tokens=tokens)


def token_batches(
    ids: torch.Tensor, seq_len: int = 512, batch_size: int = 1, keep_partial: bool = True
) -> list[torch.Tensor]:
    """Cut a 1-D token stream into consecutive sequences of ``seq_len`` tokens, grouped into
    ``[batch, seq_len]`` batches of at most ``batch_size`` sequences.

    ``keep_partial``: a trailing sequence shorter than ``seq_len`` (at least 2 tokens) is kept as a
    batch of its own, so every token counts; otherwise it is dropped, so all batches are full.
    No padding ever enters a statistic."""
    ids = torch.as_tensor(ids).reshape(-1)
    if seq_len < 2 or batch_size < 1:
        raise ValueError(f"calibration needs seq_len >= 2 and batch_size >= 1; got {seq_len}, {batch_size}")
    n = ids.numel() // seq_len
    batches = list(torch.split(ids[: n * seq_len].reshape(n, seq_len), batch_size)) if n else []
    rest = ids[n * seq_len :]
    if keep_partial and rest.numel() >= 2:
        batches.append(rest.reshape(1, -1))
    if not batches:
        raise ValueError(
            f"calibration text has {ids.numel()} tokens, fewer than one sequence of "
            f"{seq_len if not keep_partial else 2}"
        )
    return batches


def token_counts(batches: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in ``batches`` (float64 ``[vocab_size]``): the weights of
    embedding rows in calibrated objectives."""
    ids = torch.cat([b.reshape(-1) for b in batches])
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size].to(torch.float64)
