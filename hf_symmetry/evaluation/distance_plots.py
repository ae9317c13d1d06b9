"""PNG plot of matching distances per layer (``hf-symmetry match``'s model card)."""

from __future__ import annotations

from pathlib import Path

from .spectra_plots import pyplot


def plot_layer_distances(per_layer: list[dict], out: Path, title: str) -> Path:
    """Bars of ``‖source − anchor‖ / ‖anchor‖`` per layer, before and after matching."""
    plt = pyplot()
    layers = [r["layer"] for r in per_layer]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.28 * len(layers) + 2), 3.2), dpi=110)
    width = 0.4
    ax.bar(
        [x - width / 2 for x in layers],
        [r["relative_before"] for r in per_layer],
        width,
        label="before",
        color="#bbbbbb",
    )
    ax.bar(
        [x + width / 2 for x in layers],
        [r["relative_after"] for r in per_layer],
        width,
        label="after matching",
        color="#1f77b4",
    )
    ax.set_xlabel("layer")
    ax.set_ylabel("‖source − anchor‖ / ‖anchor‖")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(frameon=False, fontsize=8, ncol=2, loc="lower right", bbox_to_anchor=(1.0, 1.0))
    ax.margins(x=0.01)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
