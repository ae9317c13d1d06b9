"""``match`` on state dicts in memory (:func:`match_state_dict`), and the anchor side of a residual
match, norms folded (:func:`fold_state_dict`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...architectures import Adapter
from ..stream import DictSink, DictSource
from .checks import plan_pair
from .distances import MatchDistances
from .options import MatchOptions, MatchPlan
from .pair import matched_config, run_pair
from .solution import MatchSolution

Tensors = dict[str, torch.Tensor]


@dataclass
class MatchResult:
    state_dict: Tensors
    config: dict
    solution: MatchSolution
    distances: MatchDistances
    symmetries: list[str]


def match_state_dict(
    anchor: Tensors,
    source: Tensors,
    config,
    options: MatchOptions = MatchOptions(),
    anchor_config=None,
    progress: bool = False,
) -> MatchResult:
    """In-memory matching: SOURCE's state dict moved as close to ANCHOR's as its symmetries allow."""
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    anchor_config = anchor_config.to_dict() if hasattr(anchor_config, "to_dict") else dict(anchor_config or config)
    a_src, s_src = DictSource(anchor), DictSource(source)
    adapter, plan = plan_pair(a_src, s_src, anchor_config, config, options)
    sink = DictSink()
    matcher = run_pair(a_src, s_src, adapter, plan, sink, progress=progress)
    return MatchResult(
        dict(sink), matched_config(config, adapter, plan), matcher.solution, matcher.distances, plan.symmetries()
    )


def fold_state_dict(state_dict: Tensors, config, progress: bool = False) -> MatchResult:
    """Norms folded into the adjacent linears (the frame residual matching compares in), function
    preserved: the anchor side of a residual match."""
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    src = DictSource(state_dict)
    adapter = Adapter.from_config(config, src.keys())
    plan = MatchPlan(residual=True)
    adapter.check_supports("residual_rotation")
    sink = DictSink()
    matcher = run_pair(src, src, adapter, plan, sink, identity=True, progress=progress)
    return MatchResult(dict(sink), matched_config(config, adapter, plan), matcher.solution, matcher.distances, [])
