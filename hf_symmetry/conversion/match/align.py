"""The per-layer solve: the cross statistics of each block (QK and VO per KV group, the quartic
scalings, the FFN neuron similarity) and :func:`align_layer`, which solves and applies them in turn
(each step the exact optimum of its block given the previous ones)."""

from __future__ import annotations

import torch

from ...symmetry import actions
from ...symmetry.layout import HeadLayout
from ...symmetry.procrustes import commutant_procrustes, match_permutation, orthogonal_procrustes, quartic_scale
from .options import MatchPlan
from .solution import LayerMatch

Tensors = dict[str, torch.Tensor]


def _span(layout: HeadLayout, heads) -> slice:
    """Rows of consecutive heads (a KV group's query heads are consecutive)."""
    heads = list(heads)
    return slice(layout.rows(heads[0]).start, layout.rows(heads[-1]).stop)


def _qk_cross(anchor: Tensors, source: Tensors, layout: HeadLayout, g: int) -> torch.Tensor:
    """``M = Σ_h W_Q,src^h W_Q,anc^hᵀ + W_K,src^g W_K,anc^gᵀ`` (+ the same for biases) over the
    query heads h of KV group g — each head's own slice, never the whole projection."""
    M = torch.zeros(layout.head_dim, layout.head_dim, dtype=torch.float64)
    for name, blocks in (("q", layout.heads_of_group(g)), ("k", (g,))):
        for b in blocks:
            rows = layout.rows(b)
            M += source[f"{name}.weight"][rows] @ anchor[f"{name}.weight"][rows].T
            if f"{name}.bias" in source:
                M += torch.outer(source[f"{name}.bias"][rows], anchor[f"{name}.bias"][rows])
    return M


def _vo_cross(anchor: Tensors, source: Tensors, layout: HeadLayout, g: int) -> torch.Tensor:
    """``M = W_V,src^g W_V,anc^gᵀ + Σ_h W_O,src^hᵀ W_O,anc^h`` (+ V biases) for KV group g."""
    rows = layout.rows(g)
    M = source["v.weight"][rows] @ anchor["v.weight"][rows].T
    if "v.bias" in source:
        M += torch.outer(source["v.bias"][rows], anchor["v.bias"][rows])
    for h in layout.heads_of_group(g):
        cols = layout.rows(h)
        M += source["o.weight"][:, cols].T @ anchor["o.weight"][:, cols]
    return M


def _inner_and_norm(anchor: Tensors, source: Tensors, parts: list[tuple[str, slice, int]]) -> tuple[float, float]:
    """(‖X‖², <X, X'>) over the named (tensor, slice, dim) blocks of source X and anchor X'."""
    xx = xy = 0.0
    for key, span, dim in parts:
        if key not in source:
            continue
        index = (span,) if dim == 0 else (slice(None), span)
        x, y = source[key][index].reshape(-1), anchor[key][index].reshape(-1)
        xx += torch.dot(x, x).item()
        xy += torch.dot(x, y).item()
    return xx, xy


def _qk_scale(anchor: Tensors, source: Tensors, layout: HeadLayout, g: int) -> float:
    q_rows, k_rows = _span(layout, layout.heads_of_group(g)), _span(layout, (g,))
    xx, xy = _inner_and_norm(anchor, source, [("q.weight", q_rows, 0), ("q.bias", q_rows, 0)])
    yy, yz = _inner_and_norm(anchor, source, [("k.weight", k_rows, 0), ("k.bias", k_rows, 0)])
    return quartic_scale(xx, xy, yy, yz)


def _vo_scale(anchor: Tensors, source: Tensors, layout: HeadLayout, g: int) -> float:
    o_cols, v_rows = _span(layout, layout.heads_of_group(g)), _span(layout, (g,))
    xx, xy = _inner_and_norm(anchor, source, [("o.weight", o_cols, 1)])  # O -> c O
    yy, yz = _inner_and_norm(anchor, source, [("v.weight", v_rows, 0), ("v.bias", v_rows, 0)])  # V -> V / c
    return quartic_scale(xx, xy, yy, yz)


def _ffn_similarity(anchor: Tensors, source: Tensors) -> torch.Tensor:
    """``C[j, i]`` = inner product of anchor neuron j and source neuron i over up (+gate) rows,
    their biases and down columns.

    In float32: C only ranks candidate pairings for the assignment (the permutation itself is applied
    exactly); float32 halves the matching's largest cost and can only swap pairings whose scores tie
    to ~1e-7 relative, which changes the distance by as little."""

    def f32(name: str) -> torch.Tensor:
        return anchor[name].float(), source[name].float()

    (au, su), (ad, sd) = f32("up.weight"), f32("down.weight")
    C = au @ su.T + ad.T @ sd
    if "gate.weight" in source:
        ag, sg = f32("gate.weight")
        C += ag @ sg.T
    for name in ("up.bias", "gate.bias"):
        if name in source:
            C += torch.outer(*f32(name))
    return C.double()


def align_layer(
    anchor: Tensors, source: Tensors, layout: HeadLayout, plan: MatchPlan, found: LayerMatch | None = None
) -> tuple[LayerMatch, Tensors]:
    """Solve and apply the head and FFN match of one layer (both layers in the same residual
    frame). Each step is the exact optimum of its block given the previous ones, so the distance
    never grows."""
    lm = found or LayerMatch()
    n_kv = layout.n_kv_heads
    if plan.qk:
        lm.qk = [commutant_procrustes(_qk_cross(anchor, source, layout, g), layout) for g in range(n_kv)]
        source = actions.rotate_qk(source, layout, lm.qk)
    if plan.vo:
        lm.vo = [orthogonal_procrustes(_vo_cross(anchor, source, layout, g)) for g in range(n_kv)]
        source = actions.rotate_vo(source, layout, lm.vo)
    if plan.qk_scale:
        lm.qk_scale = torch.tensor([_qk_scale(anchor, source, layout, g) for g in range(n_kv)], dtype=torch.float64)
        source = actions.scale_qk(source, layout, lm.qk_scale)
    if plan.vo_scale:
        lm.vo_scale = torch.tensor([_vo_scale(anchor, source, layout, g) for g in range(n_kv)], dtype=torch.float64)
        source = actions.scale_vo(source, layout, lm.vo_scale)
    if plan.ffn:
        lm.perm = match_permutation(_ffn_similarity(anchor, source))
        source = actions.permute_ffn(source, lm.perm)
    return lm, source
