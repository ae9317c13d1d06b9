"""The group element a match found: per layer (:class:`LayerMatch`) and for the whole checkpoint
(:class:`MatchSolution`, with the norm folding and residual rotation), to replay the match or to carry
statistics taken on the unmatched model (Gram matrices) exactly through it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...symmetry import actions
from ...symmetry.layout import HeadLayout

Tensors = dict[str, torch.Tensor]


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
