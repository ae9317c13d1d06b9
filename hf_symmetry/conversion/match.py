"""``match``: align SOURCE to ANCHOR inside SOURCE's symmetry orbit (Zhang et al. 2025, rotation symmetry; docs/math.md
§2).

The result computes exactly SOURCE's function but sits as close to ANCHOR, weight by weight, as
the chosen symmetries allow, so that averaging-style merges combine corresponding units:

* per KV group, QK rotation by closed-form Procrustes (all of O(d_h) without RoPE; the exact
  per-pair SO(2) optimum in the checkpoint's pairing layout with RoPE; free non-rotary dims for
  partial rotary), summed over the group's query heads;
* per KV group, VO rotation by Procrustes over V rows and every O column block of the group;
* optionally per-group QK and VO scalings (the quartic of Zhang et al. 2025, eq. 12);
* FFN neurons by linear assignment;
* optionally (beyond the paper; RMSNorm families) one residual-stream rotation after norm
  fusion, by Procrustes on the embeddings and LM head, refined by block-coordinate passes over
  every residual reader and writer when ``residual_iters > 0``.

Solvers live in :mod:`hf_symmetry.symmetry.procrustes`; the group actions that apply them are the
same ones ``rotate`` uses (:mod:`hf_symmetry.symmetry.actions`). Distances are squared Frobenius
norms per component, before and after, in the frame the models are compared in (norm-folded
when the residual stream is matched: folding is function-preserving and both sides get it).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter, spec_for_model_type
from ..architectures.capabilities import allows, structural_config
from ..checkpoint import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
    write_config,
)
from ..evaluation.distance_plots import plot_layer_distances
from ..hub.cards import hub_id_of, public_model_labels, write_card
from ..symmetry import actions
from ..symmetry.layout import HeadLayout
from ..symmetry.procrustes import commutant_procrustes, match_permutation, orthogonal_procrustes, quartic_scale
from .rotate import RotateOptions, plan_checks
from .stream import DictSink, DictSource, TensorSource, partition_keys, transform_checkpoint

Tensors = dict[str, torch.Tensor]

DISTANCE_PLOT = "match_distances.png"  # written next to the weights, shown in the card
COMPONENTS = ("qk", "vo", "ffn", "norms", "embeddings")
_LAYER_COMPONENT = {"q": "qk", "k": "qk", "v": "vo", "o": "vo", "gate": "ffn", "up": "ffn", "down": "ffn"}
_RESIDUAL_READERS = ("q", "k", "v", "gate", "up")
_RESIDUAL_WRITERS = ("o", "down")


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class MatchOptions:
    """What to match. ``heads='auto'`` matches QK and VO where the family has them as symmetries
    (VO only under QK-norm); naming ``qk`` or ``both`` on a QK-norm family is refused."""

    heads: Literal["auto", "both", "qk", "vo", "none"] = "auto"
    ffn: bool = True
    scaling: bool = False
    residual: bool = False
    residual_iters: int = 0

    def plan(self, adapter: Adapter) -> "MatchPlan":
        if self.heads not in ("auto", "both", "qk", "vo", "none"):
            raise ValueError(f"heads must be one of auto, both, qk, vo, none; got {self.heads!r}")
        if self.residual_iters < 0:
            raise ValueError("residual_iters must be >= 0")
        if self.residual_iters and not self.residual:
            raise ValueError("residual_iters refines the residual-stream rotation: it needs residual matching")
        qk = self.heads in ("both", "qk") or (self.heads == "auto" and allows(adapter, "qk_rotation"))
        vo = self.heads in ("auto", "both", "vo")
        plan = MatchPlan(
            qk=qk,
            vo=vo,
            qk_scale=self.scaling and qk,
            vo_scale=self.scaling and vo,
            ffn=self.ffn,
            residual=self.residual,
            residual_iters=self.residual_iters,
        )
        for symmetry in plan.symmetries():
            adapter.check_supports(symmetry)
        return plan


@dataclass(frozen=True)
class MatchPlan:
    """Options resolved against one family (see :meth:`MatchOptions.plan`)."""

    qk: bool = False
    vo: bool = False
    qk_scale: bool = False
    vo_scale: bool = False
    ffn: bool = False
    residual: bool = False
    residual_iters: int = 0

    def symmetries(self) -> list[str]:
        names = [
            ("residual_rotation", self.residual),
            ("qk_rotation", self.qk),
            ("vo_rotation", self.vo),
            ("qk_scaling", self.qk_scale),
            ("vo_scaling", self.vo_scale),
            ("ffn_permutation", self.ffn),
        ]
        return [n for n, on in names if on]


# --------------------------------------------------------------------------- solution


@dataclass
class LayerMatch:
    """The group element found for one layer (None: not matched), and the norm weights that were
    folded (residual matching) — everything needed to replay the match or transform statistics."""

    qk: list[torch.Tensor] | None = None
    vo: list[torch.Tensor] | None = None
    qk_scale: torch.Tensor | None = None
    vo_scale: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    attn_gamma: torch.Tensor | None = None
    ffn_gamma: torch.Tensor | None = None

    def apply(self, layer: Tensors, layout: HeadLayout) -> Tensors:
        """The head and FFN part of the match (not the fold or residual rotation), in solving order."""
        if self.qk is not None:
            layer = actions.rotate_qk(layer, layout, self.qk)
        if self.vo is not None:
            layer = actions.rotate_vo(layer, layout, self.vo)
        if self.qk_scale is not None:
            layer = actions.scale_qk(layer, layout, self.qk_scale)
        if self.vo_scale is not None:
            layer = actions.scale_vo(layer, layout, self.vo_scale)
        if self.perm is not None:
            layer = actions.permute_ffn(layer, self.perm)
        return layer


@dataclass
class MatchSolution:
    """How a checkpoint was moved into the anchor's frame: optional norm folding and residual
    rotation ``Q`` (None: identity), then per-layer :class:`LayerMatch`."""

    fold: bool = False
    residual: torch.Tensor | None = None
    final_gamma: torch.Tensor | None = None
    layers: dict[int, LayerMatch] = field(default_factory=dict)

    def transform_grams(self, grams: dict[str, torch.Tensor], layout: HeadLayout) -> dict[str, torch.Tensor]:
        """Gram matrices ``XᵀX`` of linear-layer inputs taken on the model *before* matching, mapped
        exactly to the matched model (keys ``layers.{i}.{attn_in,o_in,ffn_in,down_in}``, ``head_in``):
        folding γ divides inputs by γ, the residual rotation maps ``X -> XQ`` (``G -> QᵀGQ``), the VO
        rotation and scale map each o_proj head block ``X_h -> X_h R_g / c_g``, the FFN permutation
        reorders down_proj inputs (``PᵀGP``). QK rotations and scales change no linear input."""
        out = {}
        for key, G in grams.items():
            G = G.to(torch.float64)
            if key == "head_in":
                out[key] = self._residual_gram(G, self.final_gamma)
                continue
            _, i, name = key.split(".")
            lm = self.layers.get(int(i), LayerMatch())
            if name == "attn_in":
                G = self._residual_gram(G, lm.attn_gamma)
            elif name == "ffn_in":
                G = self._residual_gram(G, lm.ffn_gamma)
            elif name == "o_in":
                B = _o_input_map(lm, layout)
                G = G if B is None else B.T @ G @ B
            elif name == "down_in" and lm.perm is not None:
                G = G[lm.perm][:, lm.perm]
            out[key] = G
        return out

    def _residual_gram(self, G: torch.Tensor, gamma: torch.Tensor | None) -> torch.Tensor:
        if self.fold and gamma is not None:
            if (gamma == 0).any():
                raise ValueError(
                    "cannot transform Gram matrices through a norm with a zero weight (the folded "
                    "input is not determined); compute them on the matched model instead"
                )
            g = gamma.to(torch.float64)
            G = G / torch.outer(g, g)
        if self.residual is not None:
            G = self.residual.T @ G @ self.residual
        return G

    def is_identity(self, atol: float = 1e-10) -> bool:
        """True when every group element found is the identity (matching a model to itself)."""

        def eye_like(R):
            return torch.allclose(R, torch.eye(R.shape[0], dtype=R.dtype), atol=atol)

        if self.residual is not None and not eye_like(self.residual):
            return False
        for lm in self.layers.values():
            for Rs in (lm.qk, lm.vo):
                if Rs is not None and not all(eye_like(R) for R in Rs):
                    return False
            for s in (lm.qk_scale, lm.vo_scale):
                if s is not None and not torch.allclose(s, torch.ones_like(s), atol=atol):
                    return False
            if lm.perm is not None and not torch.equal(lm.perm, torch.arange(len(lm.perm))):
                return False
        return True


def _o_input_map(lm: LayerMatch, layout: HeadLayout) -> torch.Tensor | None:
    """Block-diagonal map of o_proj inputs: head h's block is ``R_g / c_g`` for its KV group g."""
    if lm.vo is None and lm.vo_scale is None:
        return None
    blocks = []
    for h in range(layout.n_heads):
        g = layout.kv_group(h)
        R = lm.vo[g] if lm.vo is not None else torch.eye(layout.head_dim, dtype=torch.float64)
        blocks.append(R / (lm.vo_scale[g] if lm.vo_scale is not None else 1.0))
    return torch.block_diag(*blocks)


# --------------------------------------------------------------------------- distances


def component_of(key: str, is_global: bool = False) -> str:
    return "embeddings" if is_global else _LAYER_COMPONENT.get(key.split(".")[0], "norms")


def _sq(t: torch.Tensor) -> float:
    v = t.reshape(-1)
    return torch.dot(v, v).item()  # BLAS: much faster than pow().sum() on large tensors


def squared_distances(anchor: Tensors, source: Tensors, is_global: bool = False) -> dict[str, float]:
    """Squared Frobenius distance per component over the tensors both dicts hold."""
    out = dict.fromkeys(COMPONENTS, 0.0)
    seen: dict[tuple[int, int], float] = {}  # a tied head aliases the embedding: one subtraction
    for key in anchor.keys() & source.keys():
        a, s = anchor[key], source[key]
        if (id(a), id(s)) not in seen:
            seen[id(a), id(s)] = _sq(a.to(torch.float64) - s.to(torch.float64))
        out[component_of(key, is_global)] += seen[id(a), id(s)]
    return out


def squared_norms(tensors: Tensors, is_global: bool = False) -> dict[str, float]:
    out = dict.fromkeys(COMPONENTS, 0.0)
    seen: dict[int, float] = {}
    for key, t in tensors.items():
        if id(t) not in seen:
            seen[id(t)] = _sq(t.to(torch.float64))
        out[component_of(key, is_global)] += seen[id(t)]
    return out


@dataclass
class MatchDistances:
    """Squared distances to the anchor per component, before and after matching, and the anchor's
    squared norms (for relative figures)."""

    before: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    after: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    anchor: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    layers: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # i -> (before, after, anchor)

    def add(
        self, anchor: Tensors, before: Tensors, after: Tensors, is_global: bool = False, layer: int | None = None
    ) -> None:
        d_before = squared_distances(anchor, before, is_global)
        d_after = d_before if after is before else squared_distances(anchor, after, is_global)
        rows = (d_before, d_after, squared_norms({k: anchor[k] for k in anchor.keys() & after.keys()}, is_global))
        for total, new in zip((self.before, self.after, self.anchor), rows):
            for k, v in new.items():
                total[k] += v
        if layer is not None:
            self.layers[layer] = tuple(sum(r.values()) for r in rows)

    def per_layer(self) -> list[dict]:
        """Relative distance ``‖source − anchor‖ / ‖anchor‖`` of each layer, before and after."""
        return [
            {
                "layer": i,
                "relative_before": math.sqrt(b / n) if n > 0 else 0.0,
                "relative_after": math.sqrt(a / n) if n > 0 else 0.0,
            }
            for i, (b, a, n) in sorted(self.layers.items())
        ]

    def summary(self) -> dict:
        """Per component and in total: squared distance before/after, reduction, relative distance
        after (``‖source − anchor‖ / ‖anchor‖``)."""
        rows = {}
        for comp in (*COMPONENTS, "total"):
            b = sum(self.before.values()) if comp == "total" else self.before[comp]
            a = sum(self.after.values()) if comp == "total" else self.after[comp]
            n = sum(self.anchor.values()) if comp == "total" else self.anchor[comp]
            if comp != "total" and n == 0 and b == 0:
                continue
            rows[comp] = {
                "before": b,
                "after": a,
                "reduction": (1 - a / b) if b > 0 else 0.0,
                "relative_before": math.sqrt(b / n) if n > 0 else 0.0,
                "relative_after": math.sqrt(a / n) if n > 0 else 0.0,
            }
        return rows


# --------------------------------------------------------------------------- per-layer solving


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


# --------------------------------------------------------------------------- residual frame


def with_lm_head(g: Tensors, adapter: Adapter) -> Tensors:
    """Globals with an explicit ``lm_head.weight`` (the embedding when tied), so tied and untied
    checkpoints compare and merge alike."""
    if adapter.spec.lm_head is None or "lm_head.weight" in g:
        return g
    # an alias, not a copy (a vocabulary-sized fp64 tensor): nothing downstream writes in place
    return {**g, "lm_head.weight": g["embed.weight"]}


def fold_globals(g: Tensors, adapter: Adapter) -> Tensors:
    """Final norm folded into the (untied) LM head; function-preserving."""
    return actions.fold_final_norm(with_lm_head(g, adapter))


def fold_layer(layer: Tensors) -> tuple[Tensors, LayerMatch]:
    """Both pre-norms folded into their readers, and the record of the γ that were folded."""
    found = LayerMatch(attn_gamma=layer["attn_norm.weight"].clone(), ffn_gamma=layer["ffn_norm.weight"].clone())
    return actions.fold_layer_norms(layer), found


def _residual_cross_globals(anchor: Tensors, source: Tensors) -> torch.Tensor:
    """``Σ S_embᵀ A_emb`` over token/position embeddings and the LM head (all residual readers of
    ``E -> E Q`` form): the Procrustes statistics of the residual rotation from the globals."""
    M = 0
    for key in anchor.keys() & source.keys():
        if key == "embed.weight" or key == "lm_head.weight" or (key.startswith("pos") and key.endswith(".weight")):
            M = M + source[key].T @ anchor[key]
    return M


def _residual_cross_layer(anchor: Tensors, source: Tensors) -> torch.Tensor:
    """A layer's share of the residual Procrustes statistics: readers ``W -> W Q`` add ``SᵀA``,
    writers ``W -> Qᵀ W`` (and their biases) add ``S Aᵀ``."""
    M = 0
    for n in _RESIDUAL_READERS:
        if f"{n}.weight" in source:
            M = M + source[f"{n}.weight"].T @ anchor[f"{n}.weight"]
    for n in _RESIDUAL_WRITERS:
        M = M + source[f"{n}.weight"] @ anchor[f"{n}.weight"].T
        if f"{n}.bias" in source:
            M = M + torch.outer(source[f"{n}.bias"], anchor[f"{n}.bias"])
    return M


# --------------------------------------------------------------------------- one pair, streaming


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
        M_globals = _residual_cross_globals(a_g, s_g)
        del a_g, s_g
        Q = orthogonal_procrustes(M_globals)
        head_plan = replace(self.plan, residual=False, residual_iters=0)
        for it in range(self.plan.residual_iters):
            M = M_globals.clone()
            for i in tqdm(range(ad.n_layers), desc=f"residual pass {it + 1}", disable=not progress, unit="layer"):
                a = fold_layer(ad.read_layer(i, anchor.get(a_parts[1][i])))[0]
                s = fold_layer(ad.read_layer(i, source.get(s_parts[1][i])))[0]
                found, _ = align_layer(a, actions.rotate_residual_layer(s, Q), ad.layout, head_plan)
                M = M + _residual_cross_layer(a, found.apply(s, ad.layout))
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


# --------------------------------------------------------------------------- checks before work


def check_same_architecture(models: list[tuple[str, dict, dict[str, tuple]]]) -> None:
    """``models``: (name, config, tensor shapes). Refuse different families, configs or shapes.
    A tied LM head may be absent on one side."""
    (name0, cfg0, shapes0), rest = models[0], models[1:]
    spec0 = spec_for_model_type(cfg0.get("model_type"))
    for name, cfg, shapes in rest:
        spec = spec_for_model_type(cfg.get("model_type"))
        if spec.family != spec0.family:
            raise ValueError(
                f"{name} is a {spec.family} model but {name0} is a {spec0.family} model: "
                "matching and merging need one architecture"
            )
        s0, s = structural_config(cfg0), structural_config(cfg)
        diff = sorted(k for k in s0.keys() | s.keys() if s0.get(k) != s.get(k))
        if diff:
            k = diff[0]
            raise ValueError(f"{name} and {name0} have different shapes/configs: {k} = {s.get(k)!r} vs {s0.get(k)!r}")
        optional = {spec.lm_head + ".weight"} if spec.lm_head else set()
        keys0, keys = set(shapes0) - optional, set(shapes) - optional
        if keys0 != keys:
            odd = sorted(keys0 ^ keys)[:3]
            raise ValueError(f"{name} and {name0} hold different tensors (e.g. {odd})")
        bad = [k for k in shapes0.keys() & shapes.keys() if shapes0[k] != shapes[k]]
        if bad:
            raise ValueError(
                f"{name} and {name0} have different shapes: {bad[0]} is {shapes[bad[0]]} vs {shapes0[bad[0]]}"
            )


def vocabulary_fingerprint(folder: str | Path | None) -> str | None:
    """A hash of the tokenizer's vocabulary (token -> id), or None when the folder has no tokenizer."""
    if folder is None:
        return None
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = {
            "model": data.get("model", {}).get("vocab"),
            "added": sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or []),
        }
        blob = json.dumps(vocab, sort_keys=True).encode()
    else:
        files = [folder / n for n in ("vocab.json", "vocab.txt", "tokenizer.model") if (folder / n).is_file()]
        if not files:
            return None
        blob = b"".join(f.read_bytes() for f in files)
    return hashlib.sha256(blob).hexdigest()


def check_same_vocabulary(folders: list[tuple[str, str | Path | None]], why: str) -> None:
    """Refuse models whose tokenizers map tokens to different ids (where both ship one)."""
    prints = [(name, vocabulary_fingerprint(folder)) for name, folder in folders]
    known = [(n, p) for n, p in prints if p is not None]
    for name, fp in known[1:]:
        if fp != known[0][1]:
            raise ValueError(f"{name} and {known[0][0]} have different vocabularies; {why}")


def plan_pair(
    anchor: TensorSource,
    source: TensorSource,
    anchor_config: dict,
    source_config: dict,
    options: MatchOptions,
    names=("ANCHOR", "SOURCE"),
    folders=(None, None),
) -> tuple[Adapter, MatchPlan]:
    """Every refusal, before any work: same architecture and shapes, supported symmetries,
    and for residual matching a shared vocabulary and no tensors outside the known layout."""
    check_same_architecture([(names[0], anchor_config, anchor.shapes()), (names[1], source_config, source.shapes())])
    adapter = Adapter.from_config(source_config, source.keys())
    plan = options.plan(adapter)
    if plan.residual:
        check_same_vocabulary(list(zip(names, folders)), "residual matching compares embedding rows token by token")
        plan_checks(adapter, RotateOptions(residual="random", heads="none", ffn=False), source.keys())
    return adapter, plan


# --------------------------------------------------------------------------- entry points


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


@dataclass
class MatchReport:
    anchor: str
    source: str
    output: str
    family: str
    symmetries: list[str]
    distances: dict
    seconds: float
    untied_embeddings: bool = False
    layer_distances: list[dict] = field(default_factory=list)
    verification: dict = field(default_factory=dict)


def match_checkpoint(
    anchor: str | Path,
    source: str | Path,
    out: str | Path,
    options: MatchOptions = MatchOptions(),
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
) -> MatchReport:
    """Stream SOURCE (an HF safetensors folder) matched to ANCHOR into ``out``: a stock folder with
    SOURCE's tokenizer files and a model card (exactness figures are added once verified)."""
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    a_reader, s_reader = CheckpointReader(anchor), CheckpointReader(source)
    adapter, plan = plan_pair(
        a_reader, s_reader, a_reader.config, s_reader.config, options, folders=(a_reader.path, s_reader.path)
    )
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "match"})
        matcher = run_pair(a_reader, s_reader, adapter, plan, writer, progress=progress)
        writer.close()
        write_config(tmp, matched_config(s_reader.config, adapter, plan))
        copy_side_files(s_reader.path, tmp)
        report = MatchReport(
            anchor=str(anchor),
            source=str(source),
            output=str(out),
            family=adapter.family,
            symmetries=plan.symmetries(),
            distances=matcher.distances.summary(),
            seconds=time.perf_counter() - start,
            untied_embeddings=bool(plan.residual and adapter.spec.lm_head and adapter.tied_embeddings),
            layer_distances=matcher.distances.per_layer(),
        )
        plot_layer_distances(
            report.layer_distances,
            tmp / DISTANCE_PLOT,
            f"{Path(source).name} to {Path(anchor).name}: distance per layer",
        )
        write_card(tmp, "match", match_card_data(report, options))
    return report


def match_card_data(report: MatchReport, options: MatchOptions) -> dict:
    """What the model card says about a match (local paths appear only as folder names)."""
    source, anchor = public_model_labels([report.source, report.anchor])
    return {
        "title": f"{source} matched to {anchor}",
        "method": "match",
        "parameters": asdict(options),
        "inputs": [report.source, report.anchor],
        # the function is SOURCE's: the anchor is only the reference frame, not an ancestor
        "base_model": [hub_id_of(report.source)] if hub_id_of(report.source) else [],
        "extra": {
            "anchor": anchor,
            "source": source,
            "symmetries": report.symmetries,
            "distances": report.distances,
            "untied_embeddings": report.untied_embeddings,
        },
        "plots": [
            {
                "path": DISTANCE_PLOT,
                "caption": "Relative distance to the anchor per layer "
                "(‖source − anchor‖ / ‖anchor‖), before and after matching",
            }
        ],
    }
