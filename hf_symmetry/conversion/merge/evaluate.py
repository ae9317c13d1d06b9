"""The merge and every input measured on one text (:func:`evaluate_merge`), recorded in the card."""

from __future__ import annotations

import json
from pathlib import Path

from ...assets import resolve_model
from ...evaluation.verification import perplexities
from ...hub.cards import update_card
from ...hub.entries import perplexity_card_entry
from ...hub.lineage import public_model_labels
from ...text import public_text_label
from .on_disk import tokenizer_folder
from .recipe import EvaluationText, MergeRecipe


def _is_causal_lm(config: dict) -> bool:
    arch = " ".join(config.get("architectures") or [])
    return "CausalLM" in arch or "LMHead" in arch


def evaluate_merge(
    out: str | Path,
    recipe: MergeRecipe,
    text: str | Path | None = None,
    tokens: int | None = None,
    device: str | None = "auto",
    progress: bool = True,
) -> dict:
    """Perplexity of the merge written to ``out`` and of every input on one text (the shared
    definition, :func:`hf_symmetry.evaluation.verification.perplexities`), recorded in the card:
    the merge's as model-index metadata, every input's in the card's table. Returns the figures
    (empty when the inputs are not causal LMs or have no tokenizer)."""
    spec = recipe.evaluation or EvaluationText()
    text, tokens = text or spec.text, tokens or spec.tokens
    folders = [resolve_model(m) for m in recipe.inputs]
    tok_folder = tokenizer_folder(folders)
    if tok_folder is None or not _is_causal_lm(json.loads((Path(out) / "config.json").read_text())):
        return {}
    labels = public_model_labels(recipe.inputs)
    models = {MERGED: Path(out), **dict(zip(labels, folders))}
    results, path = perplexities(models, text, tokens, tokenizer_from=tok_folder, device=device, progress=progress)
    merged = results.pop(MERGED)
    figures = {
        "text": public_text_label(text),
        "tokens": merged.tokens,
        "window": merged.window,
        "stride": merged.stride,
        "merged": merged.perplexity,
        "inputs": {name: r.perplexity for name, r in results.items()},
    }
    update_card(out, eval_results=[perplexity_card_entry(merged, path, tokens)], evaluation=figures)
    return figures


MERGED = "this merge"
