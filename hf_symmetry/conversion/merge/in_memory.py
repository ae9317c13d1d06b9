"""``merge`` on state dicts in memory (:func:`merge_state_dicts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..stream import DictSink, DictSource
from .pipeline import MergeOutcome, Participants, run_merge
from .recipe import MergeRecipe, recipe_from_dict

Tensors = dict[str, torch.Tensor]


@dataclass
class MergeResult:
    state_dict: Tensors
    outcome: MergeOutcome


def merge_state_dicts(
    state_dicts: list[Tensors],
    config,
    recipe: dict | MergeRecipe,
    base: Tensors | None = None,
    calibration_ids: torch.Tensor | None = None,
    progress: bool = False,
) -> MergeResult:
    """In-memory merge. ``recipe`` is a recipe mapping (or :class:`MergeRecipe`); its ``models``
    entries give weights/densities in the order of ``state_dicts`` (their ``model`` names are
    labels only) and ``base_model`` labels ``base``. Data-dependent methods take
    ``calibration_ids`` (1-D token ids)."""
    recipe = recipe if isinstance(recipe, MergeRecipe) else recipe_from_dict(recipe)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if len(recipe.models) != len(state_dicts) or (base is None) != (recipe.base_model is None):
        raise ValueError("the recipe's models and base_model must correspond to the state dicts given")
    dicts = list(state_dicts) + ([base] if base is not None else [])
    sink = DictSink()
    outcome = run_merge(
        Participants([DictSource(d) for d in dicts], [config] * len(dicts), recipe.inputs),
        recipe,
        sink,
        calibration_ids,
        progress=progress,
    )
    return MergeResult(dict(sink), outcome)
