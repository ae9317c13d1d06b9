"""The head-mode factorisation (docs/math.md §4): one K or V projection written as non-contextual TPA,
exactly at full rank (``A = R·mask``, ``B`` the KV heads) and by the best rank-R head-mode reduction
below it, in the identity metric or a calibration Gram's."""

from __future__ import annotations

import math

import torch


def group_masks(num_heads: int, num_kv_heads: int, group_of=None) -> torch.Tensor:
    """``[n_kv, h]`` 0/1 masks: ``mask[j, i] = 1`` iff query head ``i`` reads KV head ``j``
    (HF ``repeat_kv``: ``j = i // (h / n_kv)``). ``group_of`` overrides the grouping (tests)."""
    g = num_heads // num_kv_heads
    mask = torch.zeros(num_kv_heads, num_heads, dtype=torch.float64)
    for i in range(num_heads):
        mask[group_of(i) if group_of else i // g, i] = 1.0
    return mask


def head_mode_factors(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv: int,
    rank: int,
    gram: torch.Tensor | None = None,
    eval_gram: torch.Tensor | None = None,
    group_of=None,
):
    """Factor one projection ([n_kv*dh, d] weight, optional bias) into non-contextual A ``[R, h]`` and a
    B projection (``[R*dh, d]`` weight, ``[R*dh]`` bias), fitting in the metric ``gram`` (identity when
    None). Returns ``(A, W_b, b_b, weight_err, act_err)``: the relative error of all query heads'
    effective maps, in the Frobenius norm and (with ``eval_gram``) on the calibration activations."""
    dh = weight.shape[0] // num_kv
    d = weight.shape[1]
    g = num_heads // num_kv
    W = weight.detach().to(torch.float64).reshape(num_kv, dh, d)
    b = None if bias is None else bias.detach().to(torch.float64).reshape(num_kv, dh, 1)
    Wt = W if b is None else torch.cat([W, b], dim=2)  # [n_kv, dh, F], F = d (+1 with a bias)
    masks = group_masks(num_heads, num_kv, group_of).to(W.device)  # [n_kv, h]

    if rank == num_kv:
        # exact GQA form: a_j = R·mask_j, B_j = K/V head j
        A, Wb = rank * masks, Wt
        w_err, a_err = 0.0, (0.0 if eval_gram is not None else None)
    else:

        def head_gram(C):
            """``M C Mᵀ`` over query heads (``h × h``), from the KV-head Gram."""
            flat = Wt.reshape(num_kv * dh, -1)
            if C is not None:
                flat = flat @ (C if b is not None else C[:d, :d])
            kv = torch.einsum("jef,kef->jk", flat.reshape(num_kv, dh, -1), Wt)
            return masks.T @ kv @ masks

        G_fit = head_gram(gram)
        evals, evecs = torch.linalg.eigh(G_fit)
        U = evecs[:, torch.argsort(evals, descending=True)[:rank]]  # [h, R], top head-mode components
        A = rank * math.sqrt(g) * U.T
        Wb = ((U.T @ masks.T) @ Wt.reshape(num_kv, -1)).reshape(rank, dh, -1) / math.sqrt(g)
        resid = torch.eye(num_heads, dtype=torch.float64, device=W.device) - U @ U.T  # heads' maps: M -> U Uᵀ M

        def rel_err(G):
            return (torch.trace(resid @ G @ resid).clamp_min(0) / torch.trace(G).clamp_min(1e-300)).sqrt().item()

        w_err = rel_err(G_fit if gram is None else head_gram(None))
        a_err = None if eval_gram is None else rel_err(G_fit if eval_gram is gram else head_gram(eval_gram))

    Wb = Wb.reshape(rank * dh, -1)
    if b is not None:
        return A, Wb[:, :d].contiguous(), Wb[:, d].contiguous(), w_err, a_err
    return A, Wb.contiguous(), None, w_err, a_err
