"""Fisher merging's passes before the merge: every input matched into the anchor's frame
(:func:`matched_inputs`), then each merged model's diagonal Fisher (:func:`fisher_sources`), both kept
between passes by a :class:`Spill` (files, or memory for the in-memory API)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...architectures import Adapter
from ...checkpoint_io import CheckpointReader, ShardedWriter, parse_size
from ..match.options import MatchPlan
from ..match.pair import run_pair
from ..stream import DictSink, DictSource, TensorSource
from .statistics import fisher_diagonal, fisher_model, statistics_dtype


class Spill:
    """Where Fisher merging keeps the matched inputs and the Fishers between its passes: safetensors
    folders under ``folder`` (host memory then holds one model at a time: the Fisher pass's), or
    memory when ``folder`` is None (the in-memory API)."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def write(self, name: str, fill) -> TensorSource:
        """``fill(sink)`` writes the tensors; returns them as a tensor source."""
        if self.folder is None:
            sink = DictSink()
            fill(sink)
            return DictSource(dict(sink))
        path = Path(self.folder) / name
        path.mkdir(parents=True)
        writer = ShardedWriter(path, parse_size("2GB"))
        fill(writer)
        writer.close()
        (path / "config.json").write_text("{}\n")  # a folder CheckpointReader reads
        return CheckpointReader(path)


class _SourceMapping:
    """A tensor source read one tensor at a time as a mapping (what :func:`fisher_model` loads)."""

    def __init__(self, source: TensorSource):
        self.source, self._keys = source, set(source.keys())

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.source.get([key])[key]


def matched_inputs(
    sources: list[TensorSource], adapter: Adapter, plan: MatchPlan | None, anchor: int, progress: bool, spill: Spill
) -> tuple[list[TensorSource], list]:
    """Every participant moved into the anchor's frame (streamed into ``spill``), with its match
    solution; without a plan, the inputs themselves."""
    if plan is None:
        return list(sources), [None] * len(sources)
    matched, solutions = [], []
    for j, s in enumerate(sources):
        found = []
        matched.append(
            spill.write(
                f"matched-{j}",
                lambda sink: found.append(
                    run_pair(sources[anchor], s, adapter, plan, sink, identity=(j == anchor), progress=progress)
                ),
            )
        )
        solutions.append(found[0])
    return matched, solutions


def fisher_sources(
    matched: list[TensorSource],
    matched_config: dict,
    batches: list[torch.Tensor],
    n_models: int,
    progress: bool,
    placement,
    spill: Spill,
) -> list[TensorSource]:
    """Diagonal Fisher of each merged model, on the matched models (the diagonal Fisher does not
    transform under the match): each model in turn placed by accelerate (:func:`fisher_model`) and
    its Fisher written to ``spill``."""
    fishers = []
    for j in range(n_models):
        model = fisher_model(matched_config, _SourceMapping(matched[j]), statistics_dtype(matched[j]), placement)
        fisher = fisher_diagonal(model, batches, progress, desc=f"fisher {j + 1}/{n_models}")
        del model
        fishers.append(spill.write(f"fisher-{j}", lambda sink, fisher=fisher: sink.add(fisher)))
        del fisher
    return fishers
