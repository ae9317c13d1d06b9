"""PNG plots of fused-map spectra (``hf-symmetry spectra``): matplotlib, Agg backend."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

PATH_TITLES = {"vo": "value path W_O W_V", "qk": "score path W_Q^T W_K"}


def pyplot():
    import matplotlib  # lazy: keeps `hf-symmetry --help` fast

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: keeps `hf-symmetry --help` fast

    return plt


def _path_layers(report: dict, path: str) -> list[dict]:
    """The layers that have ``path`` (a RoPE layer of a model with NoPE layers has no score path)."""
    return [layer for layer in report["layers"] if path in layer]


def rank_grid(report: dict, path: str, tau: float) -> np.ndarray:
    """Effective rank at ``tau`` as a [units, layers] array (units: heads, or KV groups under GQA);
    NaN in the columns of layers without ``path``."""
    key = f"{tau:g}"
    units = len(_path_layers(report, path)[0][path])
    return np.array(
        [
            [g["effective_rank"][key] for g in layer[path]] if path in layer else [np.nan] * units
            for layer in report["layers"]
        ],
        dtype=float,
    ).T


def unit_labels(report: dict, path: str) -> list[str]:
    groups = _path_layers(report, path)[0][path]
    if report["layout"]["n_kv_heads"] == report["layout"]["n_heads"]:
        return [f"h{g['heads'][0]}" for g in groups]
    return [f"g{g['group']} (h{g['heads'][0]}-{g['heads'][-1]})" for g in groups]


def plot_rank_heatmaps(report: dict, out: Path, title: str | None = None) -> Path:
    """One heatmap per (path, τ): rows heads / KV groups, columns layers, colour and number = effective
    rank, with each layer's uniform rank (max over the column) on top."""
    plt = pyplot()
    paths, taus = report["paths"], report["taus"]
    head_dim = report["layout"]["head_dim"]
    n_units = len(_path_layers(report, paths[0])[0][paths[0]])
    n_layers = len(report["layers"])
    # one colour scale for every panel, from the lowest rank shown up to the head dim: near-full-rank
    # models would otherwise be a single flat colour
    low = min(int(np.nanmin(rank_grid(report, p, t))) for p in paths for t in taus)
    vmin = max(0, min(low - 1, head_dim - 4))
    cell = 0.32
    panels = [(path, tau) for path in paths for tau in taus]
    # wide grids (many layers, few heads/groups) stack their panels; square-ish ones tile paths × τ
    rows, cols = (len(panels), 1) if n_layers >= 2 * n_units else (len(paths), len(taus))
    fig, axes = plt.subplots(
        rows, cols, squeeze=False, figsize=(max(4.5, 2.2 + cell * n_layers) * cols, (1.4 + cell * n_units) * rows + 0.6)
    )
    for k, (path, tau) in enumerate(panels):
        ax = axes.flat[k]
        grid = rank_grid(report, path, tau)
        im = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=head_dim, aspect="auto", interpolation="nearest")
        if grid.size <= 600:
            for (u, layer), v in np.ndenumerate(grid):
                if np.isnan(v):
                    continue
                ax.text(
                    layer,
                    u,
                    str(int(v)),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if v < vmin + 0.6 * (head_dim - vmin) else "black",
                )
        ax.set_yticks(range(n_units), unit_labels(report, path), fontsize=7)
        step = max(1, n_layers // 15)
        ax.set_xticks(range(0, n_layers, step), [str(i) for i in range(0, n_layers, step)], fontsize=7)
        ax.set_xlabel("layer", fontsize=8)
        layer_ranks = grid[:, ~np.isnan(grid).all(axis=0)].max(axis=0)
        ax.set_title(
            f"{PATH_TITLES[path]}, τ={tau:g}\nlayer rank mean {layer_ranks.mean():.1f} / {head_dim}", fontsize=9
        )
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02).ax.tick_params(labelsize=7)
    fig.suptitle(title or f"Effective rank of fused attention maps: {report['model_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_layer_spectra(report: dict, path: str, out: Path) -> Path:
    """One small panel per layer: normalised singular values σ_i/σ_1 (log scale) of every head /
    KV group, with the layer's rank at each τ marked."""
    plt = pyplot()
    layers = _path_layers(report, path)
    head_dim = report["layout"]["head_dim"]
    cols = min(6, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.0 * rows), squeeze=False, sharex=True, sharey=True)
    styles = ["--", ":", "-."]
    for ax, layer in zip(axes.flat, layers):
        for g in layer[path]:
            s = np.asarray(g["singular_values"], dtype=float)
            if s.size and s[0] > 0:
                ax.semilogy(np.arange(1, s.size + 1), np.maximum(s / s[0], 1e-8), lw=0.8, alpha=0.8)
        for j, tau in enumerate(report["taus"]):
            r = max(g["effective_rank"][f"{tau:g}"] for g in layer[path])
            ax.axvline(r, color="k", ls=styles[j % 3], lw=0.7, label=f"τ={tau:g}: {r}")
        ax.set_title(f"layer {layer['layer']}", fontsize=8)
        ax.legend(fontsize=5.5, loc="lower left", frameon=False)
        ax.tick_params(labelsize=6)
        ax.set_xlim(1, head_dim)
        ax.set_ylim(1e-4, 1.5)
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    fig.suptitle(
        f"σ_i / σ_1 of each {'head' if report['layout']['n_kv_heads'] == report['layout']['n_heads'] else 'KV group'}"
        f" ({PATH_TITLES[path]}): {report['model_name']}",
        fontsize=10,
    )
    fig.supxlabel("singular value index i", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
