"""The ``spectra`` report: per layer and KV group, the singular values of the fused maps, their
effective and stable ranks and alignment, with what ``farr --tau`` would keep."""

from __future__ import annotations

import torch

from ...architectures import Adapter
from ...calibration import CalibrationEngine
from ...solvers import fused
from ..stream import TensorSource
from .analysis import LayerAnalysis, analyze
from .calibrated import calibrated_analysis
from .options import FarrOptions
from .ranks import plan_ranks, ranks_for_tau
from .target import farr_target, qk_layers


def _group_entry(g: fused.GroupSpectrum, taus: list[float], gqa: bool) -> dict:
    ranks = lambda S: {f"{t:g}": fused.effective_rank(S, t) for t in taus}  # noqa: E731
    entry = {
        "group": g.group,
        "heads": g.heads,
        "singular_values": [float(s) for s in g.S],
        "energy": float((g.S**2).sum()),
        "effective_rank": ranks(g.S),
        "stable_rank": fused.stable_rank(g.S),
        "alignment": g.alignment,
    }
    if g.factor_S is not None:
        entry["factor_effective_rank"] = {"output": ranks(g.factor_S[0]), "input": ranks(g.factor_S[1])}
    if gqa and g.head_S is not None:
        entry["head_effective_rank"] = [ranks(S) for S in g.head_S]
    return entry


def spectra_report(
    source: TensorSource,
    config: dict,
    taus: list[float],
    name: str = "",
    progress: bool = True,
    moments: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    calib_ids: torch.Tensor | None = None,
    placement=None,
) -> dict:
    """Per layer and KV group (head, without GQA): singular values of the fused value map and, where
    exact, of the fused score map; effective rank at each τ, stable rank, alignment, and the
    factors' own effective ranks. With a summary of what ``farr --tau`` would keep. ``moments``
    (from :func:`attention_input_moments`) or ``calib_ids`` (measured layer by layer by
    :func:`calibrated_analysis` on ``placement``) measure the maps in the activation-aware metric."""
    taus = [fused.check_tau(t) for t in taus]
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    L = adapter.layout
    fusable = qk_layers(adapter)
    qk_reason = None if fusable else fused.qk_fusion_blocker(L)
    paths = ("vo", "qk") if fusable else ("vo",)
    if calib_ids is not None:
        engine = CalibrationEngine(source, config, placement=placement, progress=progress)
        analysis = calibrated_analysis(engine, calib_ids, paths, detail=True)
    else:
        weights = {i: fused.InputWeights.from_moments(*m) for i, m in moments.items()} if moments else None
        analysis = analyze(source, adapter, paths, detail=True, progress=progress, weights=weights)
    calibrated = moments is not None or calib_ids is not None
    plotted = analysis_report(analysis, adapter, taus, name)
    report = {
        "model_name": name,
        "model_type": config.get("model_type"),
        "family": adapter.family,
        "layout": plotted["layout"],
        "paths": list(paths),
        "taus": taus,
        "norms_folded": adapter.spec.norm_position == "pre" and not calibrated,
        "metric": "activation-aware" if calibrated else "data-free (Frobenius)",
        "qk": {
            "available": qk_reason is None,
            "reason": qk_reason,
            "layers": fusable,
            "dims": (
                "non-rotary dims only" if any(adapter.layer_layout(i).rotary_dim for i in fusable) else "all head dims"
            ),
        },
        "layers": plotted["layers"],
        "summary": {p: {f"{t:g}": _tau_summary(analysis, p, t, adapter, config, keys) for t in taus} for p in paths},
    }
    return report


def analysis_report(analysis: list[LayerAnalysis], adapter: Adapter, taus: list[float], name: str) -> dict:
    """The part of a spectra report the plots read: layout, paths, τs and per-layer group entries."""
    L = adapter.layout
    gqa = L.n_kv_heads != L.n_heads
    paths = [p for p in ("vo", "qk") if any(p in a.spectra for a in analysis)]
    return {
        "model_name": name,
        "paths": paths,
        "taus": list(taus),
        "layout": {
            "n_heads": L.n_heads,
            "n_kv_heads": L.n_kv_heads,
            "head_dim": L.head_dim,
            "rotary_dim": L.rotary_dim,
            "rope_layout": L.rope_layout,
            "qk_norm": L.qk_norm,
        },
        "layers": [
            {"layer": a.layer, **{p: [_group_entry(g, taus, gqa) for g in a.spectra[p]] for p in a.spectra}}
            for a in analysis
        ],
    }


def _tau_summary(
    analysis: list[LayerAnalysis], path: str, tau: float, adapter: Adapter, config: dict, keys: list[str]
) -> dict:
    layer_ranks = ranks_for_tau(analysis, path, tau)
    reduced = [r for r in layer_ranks if r is not None]
    per_group = [fused.effective_rank(g.S, tau) for a in analysis for g in a.spectra.get(path, [])]
    out = {
        "layer_ranks": layer_ranks,
        "mean_layer_rank": sum(reduced) / len(reduced),
        "mean_group_rank": sum(per_group) / len(per_group),
        "farr_kept_params_fraction": None,
    }
    try:
        options = FarrOptions(tau=tau, vo=path == "vo", qk=path == "qk")
        plan = plan_ranks(analysis, options, farr_target(adapter, config, keys, options))
        out["farr_kept_params_fraction"] = plan.kept_fraction
    except ValueError:
        pass  # no FaRR model for this family/path: the spectra still stand
    return out
