"""The residual frame: the explicit LM head, the norms folded into their readers (the frame residual
matching compares in, function-preserving), and the Procrustes statistics of the residual rotation
from the globals and from each layer."""

from __future__ import annotations

import torch

from ...architectures import Adapter
from ...symmetry import actions
from .solution import LayerMatch

Tensors = dict[str, torch.Tensor]

_RESIDUAL_READERS = ("q", "k", "v", "gate", "up")
_RESIDUAL_WRITERS = ("o", "down")


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


def residual_cross_globals(anchor: Tensors, source: Tensors) -> torch.Tensor:
    """``Σ S_embᵀ A_emb`` over token/position embeddings and the LM head (all residual readers of
    ``E -> E Q`` form): the Procrustes statistics of the residual rotation from the globals."""
    M = 0
    for key in anchor.keys() & source.keys():
        if key == "embed.weight" or key == "lm_head.weight" or (key.startswith("pos") and key.endswith(".weight")):
            M = M + source[key].T @ anchor[key]
    return M


def residual_cross_layer(anchor: Tensors, source: Tensors) -> torch.Tensor:
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
