"""Activation-aware exact scalings for weight-only quantization (``rotate --for-quantization --scales QTYPE``).

AWQ's idea, made exact and fused into the stock checkpoint. A weight-only quantizer's output error on a
linear layer is ``X ΔWᵀ``; with ``H = E[xᵀx]`` the input's second moment its mean square is
``tr(ΔW H ΔWᵀ)``. Three exact per-channel scalings move precision between input channels:

* **norm → readers:** ``RMSNorm(x)·w`` read by ``W`` equals ``RMSNorm(x)·(w/s)`` read by ``W diag(s)``
  (q, k, v share the attention norm; gate, up the FFN norm), for any non-zero ``s``;
* **up → down:** ``silu(gate)·up`` is linear in ``up``: ``up -> diag(1/s) up``, ``down -> down diag(s)``;
* **V → O**, per channel of a KV group: ``V rows / s``, the O columns of every query head of the group
  ``* s`` (exact with GQA: the group's heads share the factor).

Scaling column ``j`` of ``W`` by ``s_j`` and its input by ``1/s_j`` leaves the float product unchanged but
changes what the quantizer rounds: the error becomes ``tr(ΔW' diag(1/s) H diag(1/s) ΔW'ᵀ)`` with
``ΔW' = q(W diag(s)) − W diag(s)``. Channels that carry large activations get larger weights, hence a
smaller relative rounding error where it is amplified most. As in AWQ, ``s = rms(x)^α`` (normalised
to geometric mean 1) and ``α`` is chosen from a grid by that error under the *actual* quantizer's
dequantized weights; ``α = 0`` (no scaling) is on the grid, so the chosen scale never increases the
layer's calibration error. The statistics are the calibration engine's second moments
(:mod:`hf_symmetry.calibration`), transformed into whatever basis the layer is in after the residual
and V/O rotations of :mod:`.rotation`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...calibration.data import token_batches
from ...calibration.engine import CalibrationEngine
from ...calibration.statistics import StatsRequest
from ...symmetry.layout import HeadLayout
from .channel_scales import normalised, scale_ffn_channels, scale_norm_readers, scale_vo_channels

Tensors = dict[str, torch.Tensor]
Quantizer = Callable[[torch.Tensor], torch.Tensor]

GRID = tuple(i / 10 for i in range(11))
SITES = ("attn_in", "ffn_in", "o_in", "down_in")


def layer_stats(
    source, config: dict, ids: torch.Tensor, progress: bool = False, seq_len: int = 512, placement=None
) -> list[Tensors]:
    """Per decoder layer, ``E[xᵀx]`` (float64, on the CPU) of the inputs of q/k/v (the attention norm's
    output, γ included), gate/up, o and down, over the calibration token ids ``ids``. The forward passes
    run one layer at a time on ``placement`` (:func:`hf_symmetry.devices.resolve`; default: the CPU in
    float32)."""
    engine = CalibrationEngine(source, config=config, placement=placement, progress=progress)
    result = engine.collect(token_batches(ids, seq_len), StatsRequest(grams=SITES))
    return [{site: s.grams[site] / result.tokens for site in SITES} for s in result.layers]


def residual_order(stats: list[Tensors]) -> torch.Tensor:
    """The residual permutation of ``--sort-channels``: channels in increasing order of their activation RMS
    at the layers' readers (the geometric mean over every layer's attention and FFN norm outputs, whose
    diagonals are what :func:`search_scales` scales by). A row-grouped quantizer then finds channels of
    like scale in one block: the few massive-activation channels, whose scaled reader columns would set
    the step of every block they sit in, share one block instead of spoiling several."""
    key = sum(st[site].diagonal().clamp_min(1e-30).log() for st in stats for site in ("attn_in", "ffn_in"))
    return torch.argsort(key, stable=True)


def permute_stats(stats: list[Tensors], perm: torch.Tensor) -> list[Tensors]:
    """The second moments seen by the readers after :func:`residual_order`'s permutation."""
    return [{**st, **{site: st[site][perm][:, perm] for site in ("attn_in", "ffn_in")}} for st in stats]


def scale_error(W: torch.Tensor, H: torch.Tensor, s: torch.Tensor, quantize: Quantizer) -> float:
    """``tr(ΔW' diag(1/s) H diag(1/s) ΔW'ᵀ)``, ``ΔW' = q(W diag(s)) − W diag(s)``: the mean square output
    error of the scaled layer under ``quantize`` for inputs of second moment ``H`` (float32 arithmetic). A
    quantizer that weighs columns by their importance (``uses_importance``: llama.cpp's ``--imatrix``
    quantizers, :mod:`.llamacpp`) gets ``diag(H) / s²``, the mean square input of the *scaled* layer: what
    ``llama-imatrix`` would collect on the converted model."""
    if getattr(quantize, "sample", None) is not None:  # a row-grouped quantizer's error, estimated on some rows
        rows, quantize = quantize.sample()
        W = W[rows]
    s32 = s.to(torch.float32)
    A = W.to(torch.float32) * s32[None, :]
    if getattr(quantize, "uses_importance", False):
        q = quantize(A, (H.diagonal().to(torch.float64) / s.to(torch.float64) ** 2).to(torch.float32))
    else:
        q = quantize(A)
    E = (q.to(torch.float32) - A) / s32[None, :]
    return ((E @ H.to(torch.float32)) * E).sum().item()


def search_scales(
    W: torch.Tensor,
    H: torch.Tensor,
    quantize: Quantizer,
    grid=GRID,
    tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
    pow2: bool = False,
) -> tuple[torch.Tensor, dict]:
    """AWQ's grid search: ``s = rms^α`` (``rms_j = √H_jj``, passed through ``tie`` where channels must
    share one factor), ``α`` minimising :func:`scale_error`. Returns ``s`` (float64) and the errors.
    ``pow2``: each factor rounded to a power of two, so that scaling is exact in every binary float
    format (float32, bfloat16, float16: only exponents change) and the scaled checkpoint computes the
    original's logits to the last bit, not just to float rounding (SmolLM2 Q4_0: 37.31 against 36.13
    with continuous factors, docs/quantization.md)."""
    rms = H.diagonal().to(torch.float64).clamp_min(0).sqrt()
    if tie is not None:
        rms = tie(rms)
    errors = {}
    best = (float("inf"), None, None)
    for a in grid:
        s = normalised(rms, a)
        if pow2:
            s = torch.exp2(torch.round(torch.log2(s)))
        err = scale_error(W, H, s, quantize)
        errors[a] = err
        if err < best[0]:
            best = (err, a, s)
    return best[2], {"alpha": best[1], "error": best[0], "unscaled": errors.get(0.0, float("nan"))}


def _group_tie(layout: HeadLayout) -> Callable[[torch.Tensor], torch.Tensor]:
    """O's columns: one factor per channel of a KV group (RMS over the group's query heads), expanded back."""

    def tie(rms: torch.Tensor) -> torch.Tensor:
        g = rms.reshape(layout.n_kv_heads, layout.group_size, layout.head_dim).pow(2).mean(dim=1).sqrt()
        return g[:, None, :].expand(-1, layout.group_size, -1).reshape(-1)

    return tie


def _cat(layer: Tensors, names) -> torch.Tensor:
    return torch.cat([layer[f"{n}.weight"] for n in names if f"{n}.weight" in layer])


def apply_scales(
    layer: Tensors,
    layout: HeadLayout,
    H: Tensors,
    quantize: Quantizer | dict[str, Quantizer],
    grid=GRID,
    log: dict | None = None,
    pow2: bool = False,
) -> Tensors:
    """Search and apply the four exact scalings of one layer: V → O and up → down first (they rescale
    reader *rows* of the attention and FFN groups, which a row-grouped quantizer does not see), then
    attention norm → q, k, v and FFN norm → gate, up. ``H``: the layer's input second moments *in the
    layer's current basis*, keys of :data:`SITES`. ``quantize``: one quantizer for every site, or one per site
    (``{"o", "down", "attn_norm", "ffn_norm"}``: llama-quantize's mixture gives each linear its own type).
    ``log`` gets, per site, the chosen ``alpha``, the errors, whether any factor differs from 1 (``changed``)
    and the factors' mean square inverse ``inv_s2`` (what the site's input second moments are divided by)."""

    def q(site):
        return quantize[site] if isinstance(quantize, dict) else quantize

    def note(info, s):
        return {**info, "changed": bool((s != 1).any()), "inv_s2": (1.0 / s.to(torch.float64) ** 2)}

    out = dict(layer)
    s, info = search_scales(out["o.weight"], H["o_in"], q("o"), grid, tie=_group_tie(layout), pow2=pow2)
    per_kv = s.reshape(layout.n_kv_heads, layout.group_size, layout.head_dim)[:, 0].reshape(-1)
    out = scale_vo_channels(out, layout, per_kv)
    report = {"o": note(info, s)}
    s, info = search_scales(out["down.weight"], H["down_in"], q("down"), grid, pow2=pow2)
    report["down"] = note(info, s)
    out = scale_ffn_channels(out, 1.0 / s)
    for norm, readers, site in (("attn_norm", ("q", "k", "v"), "attn_in"), ("ffn_norm", ("gate", "up"), "ffn_in")):
        s, info = search_scales(_cat(out, readers), H[site], q(norm), grid, pow2=pow2)
        report[norm] = note(info, s)
        out = scale_norm_readers(out, norm, readers, s)
    if log is not None:
        log.update(report)
    return out


def to_layer_basis(
    H: Tensors, gammas: tuple[torch.Tensor, torch.Tensor] | None, Q, vo: list[torch.Tensor] | None, layout: HeadLayout
) -> Tensors:
    """The second moments of the original model in the basis of a ``--for-quantization`` layer: with a
    residual rotation ``Q`` (norms folded), the readers see ``RMSNorm(x)/γ · Q``; with V/O rotations
    ``R_g`` (``W_O -> W_O R``), o's input becomes ``x R`` per head."""
    out = dict(H)
    if Q is not None:
        Qd = (Q.dense() if hasattr(Q, "dense") else Q).to(torch.float64)
        for site, g in zip(("attn_in", "ffn_in"), gammas):
            g = g.to(torch.float64)
            if (g == 0).any():
                raise ValueError("activation-aware scales with a residual rotation need non-zero norm weights")
            out[site] = Qd.T @ (H[site] / g[:, None] / g[None, :]) @ Qd
    if vo is not None:
        R = torch.block_diag(*[vo[layout.kv_group(h)] for h in range(layout.n_heads)]).to(torch.float64)
        out["o_in"] = R.T @ H["o_in"] @ R
    return out
