"""One SOURCE matched to one ANCHOR, streaming (:class:`PairMatcher`, :func:`run_pair`): the residual
rotation first, then globals and layers as the streaming loop brings them."""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...symmetry import actions
from ...symmetry.procrustes import orthogonal_procrustes
from ..stream import TensorSource, partition_keys, transform_checkpoint
from .align import align_layer
from .distances import MatchDistances
from .options import MatchPlan
from .residual import fold_globals, fold_layer, residual_cross_globals, residual_cross_layer, with_lm_head
from .solution import LayerMatch, MatchSolution

Tensors = dict[str, torch.Tensor]


class PairMatcher:
    """Matches one SOURCE to one ANCHOR, streaming: :meth:`solve_residual` (before any layer is
    written), then :meth:`match_globals` and :meth:`match_layer` as the layers come. With
    ``identity=True`` it only moves a model into the comparison frame (the anchor itself)."""

    def __init__(self, adapter: Adapter, plan: MatchPlan, identity: bool = False):
        self.adapter, self.plan, self.identity = adapter, plan, identity
        self.solution = MatchSolution(fold=plan.residual)
        self.distances = MatchDistances()

    # the anchor's frame ------------------------------------------------------------
    def anchor_globals(self, g: Tensors) -> Tensors:
        return fold_globals(g, self.adapter) if self.plan.residual else g

    def anchor_layer(self, layer: Tensors) -> Tensors:
        return fold_layer(layer)[0] if self.plan.residual else layer

    # residual rotation -------------------------------------------------------------
    def solve_residual(self, anchor: TensorSource, source: TensorSource, progress: bool = False) -> None:
        """Q from the embeddings and LM head (shared vocabulary), then ``residual_iters``
        block-coordinate passes: match heads/FFN given Q, re-solve Q from every weight given
        that match. Without scaling every step is an exact block optimum, so the total distance
        never grows from one pass to the next."""
        if not self.plan.residual or self.identity:
            return
        ad = self.adapter
        a_parts, s_parts = partition_keys(ad, anchor.keys()), partition_keys(ad, source.keys())
        a_g = fold_globals(ad.read_globals(anchor.get(a_parts[0])), ad)
        s_g = fold_globals(ad.read_globals(source.get(s_parts[0])), ad)
        M_globals = residual_cross_globals(a_g, s_g)
        del a_g, s_g
        Q = orthogonal_procrustes(M_globals)
        head_plan = replace(self.plan, residual=False, residual_iters=0)
        for it in range(self.plan.residual_iters):
            M = M_globals.clone()
            for i in tqdm(range(ad.n_layers), desc=f"residual pass {it + 1}", disable=not progress, unit="layer"):
                a = fold_layer(ad.read_layer(i, anchor.get(a_parts[1][i])))[0]
                s = fold_layer(ad.read_layer(i, source.get(s_parts[1][i])))[0]
                found, _ = align_layer(a, actions.rotate_residual_layer(s, Q), ad.layout, head_plan)
                M = M + residual_cross_layer(a, found.apply(s, ad.layout))
            Q = orthogonal_procrustes(M)
        self.solution.residual = Q

    # streaming steps -----------------------------------------------------------------
    def match_globals(self, anchor: Tensors, source: Tensors) -> Tensors:
        """Matched source globals; records the embedding distances."""
        ad = self.adapter
        a = self.anchor_globals(anchor)
        if self.plan.residual:
            self.solution.final_gamma = source["final_norm.weight"].clone()
            before = fold_globals(source, ad)
            after = before if self.identity else actions.rotate_residual_globals(before, self.solution.residual)
        else:
            before = after = source
        b = with_lm_head(before, ad)
        self.distances.add(with_lm_head(a, ad), b, b if after is before else with_lm_head(after, ad), is_global=True)
        return after

    def match_layer(self, i: int, anchor: Tensors, source: Tensors) -> Tensors:
        """Matched source layer ``i``; records the solution and the distances."""
        a = self.anchor_layer(anchor)
        if self.plan.residual:
            before, found = fold_layer(source)
            s = before if self.identity else actions.rotate_residual_layer(before, self.solution.residual)
        else:
            before, found, s = source, LayerMatch(), source
        if not self.identity:
            found, s = align_layer(a, s, self.adapter.layout, self.plan, found)
        self.solution.layers[i] = found
        self.distances.add(a, before, s, layer=i)
        return s


def matched_config(config: dict, adapter: Adapter, plan: MatchPlan) -> dict:
    """Folding the final norm into the head unties tied embeddings (as ``rotate`` does)."""
    new = dict(config)
    if plan.residual and adapter.spec.lm_head is not None and adapter.tied_embeddings:
        new["tie_word_embeddings"] = False
    return new


def run_pair(
    anchor: TensorSource,
    source: TensorSource,
    adapter: Adapter,
    plan: MatchPlan,
    sink,
    identity: bool = False,
    progress: bool = True,
) -> PairMatcher:
    """Stream ``source`` matched to ``anchor`` into ``sink``."""
    matcher = PairMatcher(adapter, plan, identity)
    matcher.solve_residual(anchor, source, progress)
    g_keys, per_layer, _ = partition_keys(adapter, anchor.keys())
    anchor_globals = adapter.read_globals(anchor.get(g_keys))
    transform_checkpoint(
        source,
        adapter,
        sink,
        layer_fn=lambda i, layer: matcher.match_layer(i, adapter.read_layer(i, anchor.get(per_layer[i])), layer),
        globals_fn=lambda g: matcher.match_globals(anchor_globals, g),
        progress=progress,
        desc="fold" if identity else "match",
    )
    return matcher
