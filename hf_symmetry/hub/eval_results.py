"""A card's evaluation results, the entries of its ``model-index``: :class:`huggingface_hub.EvalResult`
from dicts (:func:`eval_result`), the perplexity entry on a named text (:func:`perplexity_result`),
the user-cache index that finds a measured text again by its sha256, and new results merged into a
card's list (:func:`merge_results`)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from huggingface_hub import EvalResult

from ..assets import cache_dir
from ..text import public_text_label
from .values import plain

_EVAL_FIELDS = (
    "task_type",
    "dataset_type",
    "dataset_name",
    "metric_type",
    "metric_value",
    "task_name",
    "dataset_config",
    "dataset_split",
    "dataset_revision",
    "dataset_args",
    "metric_name",
    "metric_config",
    "metric_args",
    "source_name",
    "source_url",
)


def eval_result(entry) -> "EvalResult":
    """An ``EvalResult`` from itself or from a dict of its fields (extra keys are ignored,
    so a dict may carry display-only fields such as ``notes``)."""
    if isinstance(entry, EvalResult):
        return entry
    missing = [
        k for k in ("task_type", "dataset_type", "dataset_name", "metric_type", "metric_value") if entry.get(k) is None
    ]
    if missing:
        raise ValueError(f"eval result {entry!r} lacks {', '.join(missing)}")
    return EvalResult(**{k: plain(entry[k]) for k in _EVAL_FIELDS if entry.get(k) is not None})


def file_sha256(path: str | os.PathLike, chars: int = 16) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:chars]


def perplexity_result(
    perplexity: float,
    text: str | os.PathLike,
    text_path: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    window: int | None = None,
    stride: int | None = None,
    tokens: int | None = None,
) -> dict:
    """The card entry for a sliding-window perplexity on a text (an embedded name or a file).

    ``dataset_args`` record what is needed to recompute it (text label and sha256, token count,
    window, stride) and the metric name states the definition. The local path is never part of
    the entry: it is remembered in the user's cache (:func:`remember_text`), keyed by sha256, so
    that ``push`` can find the text again on this machine."""
    label = public_text_label(text)
    path = Path(text_path or text)
    args = {"text": label, "max_tokens": max_tokens, "window": window, "stride": stride, "tokens": tokens}
    if path.is_file():
        args["text_sha256"] = remember_text(path)
    how = ", ".join(f"{k} {v}" for k, v in (("window", window), ("stride", stride)) if v is not None)
    count = tokens or max_tokens
    name = (
        "Perplexity (sliding window" + (f"; {how}" if how else "") + (f"; first {count} tokens" if count else "") + ")"
    )
    return {
        "task_type": "text-generation",
        "task_name": "Causal language modelling",
        "dataset_type": f"text/{Path(label).stem}",
        "dataset_name": f"{label} (local text)",
        "dataset_split": "full",
        "dataset_args": {k: v for k, v in args.items() if v is not None},
        "metric_type": "perplexity",
        "metric_name": name,
        "metric_value": float(perplexity),
    }


TEXT_INDEX = "text_index.json"


def remember_text(path: str | os.PathLike) -> str:
    """sha256 of a local text file, recorded with its path in the user's hf_symmetry cache (never
    in an output folder), so a card can name the text by label and hash only."""
    sha = file_sha256(path)
    index = cache_dir() / TEXT_INDEX
    try:
        known = json.loads(index.read_text()) if index.is_file() else {}
    except (OSError, ValueError):
        known = {}
    resolved = str(Path(path).resolve())
    if resolved not in known.get(sha, []):
        known.setdefault(sha, []).append(resolved)
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = index.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1) + "\n")
            os.replace(tmp, index)
        except OSError:
            pass  # a read-only cache only means push cannot find the text by itself
    return sha


def remembered_texts(sha: str) -> list[str]:
    """Local paths of texts with this sha256 that an earlier card entry measured."""
    index = cache_dir() / TEXT_INDEX
    try:
        return list(json.loads(index.read_text()).get(sha, [])) if index.is_file() else []
    except (OSError, ValueError):
        return []


def _result_key(entry) -> tuple:
    e = eval_result(entry)
    return (e.task_type, e.dataset_type, e.dataset_config, e.dataset_split, e.metric_type)


def merge_results(old: list, new: list) -> list:
    keys = {_result_key(e) for e in new}
    return [e for e in old if _result_key(e) not in keys] + [
        plain(asdict(eval_result(e))) if not isinstance(e, dict) else e for e in new
    ]
