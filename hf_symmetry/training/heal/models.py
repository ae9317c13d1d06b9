"""The models of a healing run: loaded in float32 (quietly when asked), built as a weightless skeleton
for the LoRA plan, and scored for perplexity on the evaluation texts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ...assets import resolve_text
from ...evaluation.compare import load_model
from ...evaluation.perplexity import perplexity
from ...modeling import register_auto_classes
from ...text import read_text, tokenize_text


def load_quietly(folder: Path, progress: bool = True):
    """The model of ``folder`` in float32, without transformers' progress bar unless ``progress``."""
    was = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        return load_model(folder, dtype=torch.float32)
    finally:
        if was and not progress:
            hf_logging.enable_progress_bar()


def skeleton(folder: Path):
    """The model of ``folder`` built on the meta device from its config (structure only, no weights)."""
    register_auto_classes()

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def perplexities(model, tokenizer, texts: list[str], eval_tokens: int, progress: bool) -> dict:
    """``{text: perplexity}`` of ``model`` on the first ``eval_tokens`` tokens of each text."""
    out = {}
    for text in texts:
        ids = tokenize_text(tokenizer, read_text(resolve_text(text)), max_tokens=eval_tokens)
        out[text] = perplexity(model, ids, progress=False).perplexity
    return out
