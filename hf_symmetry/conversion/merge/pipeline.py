"""The merge of tensor sources (:func:`run_merge`): every check before any work, the anchor, the match
and the merge rule, streamed layer by layer into a sink (:func:`merge_sources`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...architectures import Adapter
from ...devices import linalg_device
from ..match.checks import check_same_architecture, check_same_vocabulary
from ..match.options import MatchPlan
from ..match.pair import PairMatcher
from ..match.residual import with_lm_head
from ..rotate import RotateOptions, plan_checks
from ..stream import Combination, TensorSource, combine_checkpoints
from .anchor import choose_anchor
from .fisher import Spill, fisher_sources, matched_inputs
from .recipe import MergeRecipe
from .rule import MergeRule
from .merge_pass import LayerGrams, MergeInputs, stream_merge

Tensors = dict[str, torch.Tensor]


@dataclass
class MergeOutcome:
    config: dict
    anchor: int
    tied_output: bool
    distances: dict = field(default_factory=dict)  # participant name -> match distance summary
    anchor_distances: dict = field(default_factory=dict)  # participant name -> squared distance to the mean
    seconds: dict = field(default_factory=dict)


def _tied_output(adapter: Adapter, configs: list[dict], plan: MatchPlan | None) -> bool:
    if adapter.spec.lm_head is None or (plan is not None and plan.residual):
        return False
    return all(Adapter.from_config(c).tied_embeddings for c in configs)


def merge_sources(
    inputs: MergeInputs,
    rule: MergeRule,
    sink,
    plan: MatchPlan | None,
    progress: bool = True,
    layer_grams: "LayerGrams | None" = None,
) -> list[PairMatcher] | None:
    """Stream every participant of ``inputs`` (whose ``matchers`` this sets) layer by layer, matched to
    ``sources[anchor]`` when ``plan`` is given, merged by ``rule`` into ``sink``. ``layer_grams`` (RegMean):
    the Gram matrices of each layer are collected as the layer comes (and the globals merged last). Returns the
    matchers (solutions and distances)."""
    sources, adapter, anchor, tied_output = inputs.sources, inputs.adapter, inputs.anchor, inputs.tied_output
    matchers = None
    if plan is not None:
        matchers = [PairMatcher(adapter, plan, identity=(j == anchor)) for j in range(len(sources))]
        for j, m in enumerate(matchers):
            m.solve_residual(sources[anchor], sources[j], progress)

    inputs.matchers = matchers
    if not rule.method.uses_fishers:
        stream_merge(inputs, rule, sink, progress, f"{'match + ' if plan else ''}{rule.method.name}", layer_grams)
        return matchers

    def globals_fn(gs: list[Tensors]) -> Tensors:
        if matchers:
            gs = [m.match_globals(gs[anchor], g) for m, g in zip(matchers, gs)]
        gs = [
            {k: v for k, v in g.items() if k != "lm_head.weight"} if tied_output else with_lm_head(g, adapter)
            for g in gs
        ]
        return rule.globals(gs)

    def layer_fn(i: int, layers: list[Tensors]) -> Tensors:
        if matchers:
            layers = [m.match_layer(i, layers[anchor], layer) for m, layer in zip(matchers, layers)]
        return rule.layer(i, layers)

    # Fisher: each layer's Fishers are read beside its weights (the matched inputs, written by then)
    combine_checkpoints(
        sources,
        adapter,
        sink,
        Combination(layer_fn, globals_fn, rule.rest),
        like=anchor,
        progress=progress,
        desc=f"{'match + ' if plan else ''}{rule.method.name}",
    )
    return matchers


@dataclass
class Participants:
    """The inputs of a merge (the recipe's models, then its base): their tensor sources, configs and names,
    and the folders they were read from (None: in memory; the vocabulary check reads their tokenizers)."""

    sources: list[TensorSource]
    configs: list[dict]
    names: list[str]
    folders: list | None = None


def run_merge(
    participants: Participants,
    recipe: MergeRecipe,
    sink,
    calibration_ids: torch.Tensor | None = None,
    progress: bool = True,
    placement=None,
    workdir: Path | None = None,
) -> MergeOutcome:
    """The merge of ``participants`` into ``sink``; checks first.
    ``workdir``: a folder for Fisher merging's matched inputs and Fishers and for the Grams RegMean keeps
    waiting while the next input's layer runs (default: memory)."""
    sources, configs, names = participants.sources, participants.configs, participants.names
    folders = participants.folders or [None] * len(sources)
    has_base = recipe.base_model is not None
    n_models = len(recipe.models)
    check_same_architecture([(n, c, s.shapes()) for n, c, s in zip(names, configs, sources)])
    check_same_vocabulary(list(zip(names, folders)), "merging combines embedding rows token by token")
    adapter = Adapter.from_config(configs[0], sources[0].keys())
    plan = recipe.match.plan(adapter) if recipe.match else None
    if plan is not None and plan.residual:
        plan_checks(adapter, RotateOptions(residual="random", heads="none", ffn=False), sources[0].keys())
    method = recipe.method
    if method.needs_calibration and calibration_ids is None:
        raise ValueError(f"{method.name} needs calibration token ids")
    method.check_model(adapter)
    if method.needs_calibration:
        batches = recipe.calibration.batches(calibration_ids, keep_partial=False)
    method.check_fits(sources[0], placement)  # e.g. Fisher's whole-model backward pass, before any work

    timings = {}
    start = time.perf_counter()
    anchor, to_mean = choose_anchor(sources, names, adapter, recipe.anchor, has_base, n_models, progress)
    timings["anchor"] = time.perf_counter() - start
    tied = _tied_output(adapter, configs, plan)
    config = dict(configs[anchor])
    if adapter.spec.lm_head is not None:
        config["tie_word_embeddings"] = tied
    rule = MergeRule(method, recipe.parameters, recipe.models, has_base, adapter, device=linalg_device(placement))

    start = time.perf_counter()
    if method.uses_fishers:
        spill = Spill(None if workdir is None else Path(workdir))
        matched, matchers = matched_inputs(sources, adapter, plan, anchor, progress, spill)
        timings["match"] = time.perf_counter() - start
        start = time.perf_counter()
        rule.fishers = fisher_sources(matched, config, batches, n_models, progress, placement, spill)
        timings["statistics"] = time.perf_counter() - start
        start = time.perf_counter()
        merge_sources(MergeInputs(matched, adapter, anchor, None, tied), rule, sink, None, progress)
        timings["merge"] = time.perf_counter() - start
    else:
        layer_grams = None
        if method.uses_grams:  # embeds the calibration tokens; each layer is measured in the merge pass
            layer_grams = LayerGrams(
                sources[:n_models],
                configs[:n_models],
                batches,
                placement,
                progress,
                spill=None if workdir is None else Path(workdir) / "grams",
            )
            timings["calibration_embed"] = time.perf_counter() - start
            start = time.perf_counter()
        inputs = MergeInputs(sources, adapter, anchor, None, tied)
        matchers = merge_sources(inputs, rule, sink, plan, progress, layer_grams)
        timings["match_and_merge" if plan else "merge"] = time.perf_counter() - start
    distances = {names[j]: m.distances.summary() for j, m in enumerate(matchers or []) if m and j != anchor}
    return MergeOutcome(
        config=config, anchor=anchor, tied_output=tied, distances=distances, anchor_distances=to_mean, seconds=timings
    )
