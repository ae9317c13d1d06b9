"""What a FaRR model folder says about itself: the effective-rank heatmap of the maps it truncated
and the model card's text."""

from __future__ import annotations

from pathlib import Path

from ...architectures import Adapter
from ...evaluation.spectra_plots import plot_rank_heatmaps
from ...hub.lineage import public_model_label
from .analysis import LayerAnalysis
from .reduce import FarrReport
from .spectra import analysis_report

HEATMAP_FILE = "effective_rank.png"
CARD_TAUS = (0.99, 0.999)


def write_rank_heatmap(
    folder: Path, analysis: list[LayerAnalysis], config: dict, keys: list[str], report: FarrReport, name: str
) -> dict:
    """The `spectra` effective-rank heatmap of the maps FaRR truncated (from the spectra it already
    computed, so no second pass), written to ``folder``; returns the card's plot entry."""
    adapter = Adapter.from_config(config, keys)
    tau = report.options.get("tau")
    taus = sorted({*CARD_TAUS, tau} if tau is not None else set(CARD_TAUS))
    heat = analysis_report(analysis, adapter, taus, name)
    plot_rank_heatmaps(
        heat,
        folder / HEATMAP_FILE,
        title=f"Effective rank of the fused attention maps of {name} (rows: heads / KV groups, columns: layers)",
    )
    unit = "head" if adapter.layout.n_kv_heads == adapter.layout.n_heads else "KV group"
    metric = "activation-aware metric" if report.calibration else "data-free Frobenius metric"
    chosen = (
        f"this model was cut at τ = {tau:g}"
        if tau is not None
        else "this model's ranks were set by the parameter budget instead of a τ"
    )
    caption = (
        f"Effective rank of the source model's fused maps per {unit} and layer at τ ∈ "
        f"{{{', '.join(f'{t:g}' for t in taus)}}} ({metric}): the fewest singular directions keeping a "
        f"fraction τ of the map's energy. Each layer's head dim is the largest rank in its column; {chosen}."
    )
    return {"path": HEATMAP_FILE, "caption": caption}


def farr_card_data(src, out, report: FarrReport, plots: list | None = None) -> dict:
    """What the model card says about a FaRR model (quality figures are added once verified)."""
    paths = " and ".join({"vo": "value/output", "qk": "query/key"}[p] for p in report.ranks)
    how = (
        f"energy threshold τ = {report.options['tau']}"
        if report.options["tau"] is not None
        else f"a budget of {report.options['params_fraction']:.0%} of the rewritten projections' parameters"
    )
    metric = (
        f"the activation-aware metric ({report.calibration['tokens']} calibration tokens)"
        if report.calibration
        else "the data-free Frobenius metric"
    )
    summary = (
        f"FaRR (fuse and rank reduce) of `{public_model_label(src)}`: each layer's fused {paths} maps were truncated "
        f"with {how} in {metric} and split back with a balanced √Σ split, giving per-layer head dims "
        f"(`v_head_dims`{', `qk_head_dims`' if 'qk' in report.ranks else ''} in config.json). "
        f"The rewritten projections keep {report.touchable_kept_fraction:.1%} of their parameters "
        f"({report.params_before:,} → {report.params_after:,} in the whole model). Custom model class: load "
        "with `trust_remote_code=True` (or `import hf_symmetry`)."
    )
    return {
        "title": Path(out).name,
        "inputs": [str(src)],
        "summary": summary,
        "plots": plots or [],
        "parameters": {
            **{k: v for k, v in report.options.items() if v is not None},
            **{f"{p}_head_dims": r for p, r in report.ranks.items()},
        },
        "notes": "\n".join(f"- {n}" for n in report.notes) or None,
        "extra": {
            "touchable_params_before": report.touchable_params_before,
            "touchable_params_after": report.touchable_params_after,
            "calibration": report.calibration,
            "original_head_dim": report.head_dim,
        },
    }
