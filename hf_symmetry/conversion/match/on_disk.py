"""``match`` on HF folders, streaming (:func:`match_checkpoint`): the output folder, its report, the
per-layer distance plot and the model card."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
    write_config,
)
from ...evaluation.distance_plots import plot_layer_distances
from ...hub.cards import write_card
from ...hub.lineage import hub_id_of, public_model_labels
from .checks import plan_pair
from .options import MatchOptions
from .pair import matched_config, run_pair

DISTANCE_PLOT = "match_distances.png"  # written next to the weights, shown in the card


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
