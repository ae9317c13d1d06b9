"""``merge`` on HF folders (:func:`merge_checkpoints`): the recipe's inputs resolved and tokenised, the
output folder in the recipe's dtype, its report and model card."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...assets import resolve_model, resolve_text
from ...checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
    write_config,
)
from ...evaluation.compare import load_tokenizer
from ...hub.cards import write_card
from ...hub.lineage import hub_id_of, public_model_labels
from ...text import public_text_label
from ..match.checks import vocabulary_fingerprint
from .pipeline import MergeOutcome, Participants, run_merge
from .recipe import MergeRecipe

Tensors = dict[str, torch.Tensor]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class _CastingSink:
    """Writes floating tensors in the recipe's dtype."""

    def __init__(self, sink, dtype: torch.dtype | None):
        self.sink, self.dtype = sink, dtype

    def add(self, tensors: Tensors) -> None:
        if self.dtype is not None:
            tensors = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        self.sink.add(tensors)


@dataclass
class MergeReport:
    output: str
    method: str
    inputs: list[str]
    anchor: str
    matched: bool
    distances: dict
    seconds: float
    timings: dict
    evaluation: dict = field(default_factory=dict)


def tokenizer_folder(folders: list[Path]) -> Path | None:
    return next((f for f in folders if vocabulary_fingerprint(f) is not None), None)


def merge_checkpoints(
    recipe: MergeRecipe,
    out: str | Path,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
    placement=None,
) -> MergeReport:
    """Merge the recipe's HF folders into ``out``: a stock folder with the anchor's config, the
    inputs' tokenizer and a model card (with the perplexities of the merge and of every input
    on the recipe's evaluation text, for causal LMs). ``placement`` (:func:`hf_symmetry.devices.resolve`):
    where RegMean's layer-wise calibration runs."""
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    folders = [resolve_model(m) for m in recipe.inputs]
    readers = [CheckpointReader(f) for f in folders]
    tok_folder = tokenizer_folder(folders)
    calibration_ids = None
    if recipe.method.needs_calibration:
        resolve_text(recipe.calibration.text)  # a missing text fails first
        if tok_folder is None:
            raise ValueError(
                f"{recipe.method.name} tokenises its calibration text, but no input folder has a tokenizer"
            )
        calibration_ids = recipe.calibration.ids(load_tokenizer(tok_folder))
    if recipe.evaluation:
        resolve_text(recipe.evaluation.text)  # a missing evaluation text fails before any work
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": f"merge/{recipe.method.name}"})
        sink = _CastingSink(writer, _DTYPES[recipe.dtype] if recipe.dtype else None)
        spill = tmp / ".merge-work"  # Fisher's matched inputs and Fishers, RegMean's waiting Grams (removed)
        outcome = run_merge(
            Participants(readers, [r.config for r in readers], recipe.inputs, folders),
            recipe,
            sink,
            calibration_ids,
            progress,
            placement,
            workdir=spill if recipe.method.spills else None,
        )
        shutil.rmtree(spill, ignore_errors=True)
        writer.close()
        config = dict(outcome.config)
        if recipe.dtype:
            config["dtype"] = recipe.dtype
        write_config(tmp, config)
        copy_side_files(tok_folder or folders[outcome.anchor], tmp)
        report = MergeReport(
            output=str(out),
            method=recipe.method.name,
            inputs=recipe.inputs,
            anchor=recipe.inputs[outcome.anchor],
            matched=recipe.match is not None,
            distances=outcome.distances,
            seconds=time.perf_counter() - start,
            timings=outcome.seconds,
        )
        write_card(tmp, "merge", merge_card_data(recipe, report, outcome))
    return report


def merge_card_data(recipe: MergeRecipe, report: MergeReport, outcome: MergeOutcome) -> dict:
    """What the model card says about a merge (inputs by distinct public names, no local path)."""
    label = dict(zip(recipe.inputs, public_model_labels(recipe.inputs)))
    models = [{"model": label[m.model], "weight": m.weight, **recipe.method.card_model(m)} for m in recipe.models]
    params = {**recipe.parameters, "match": asdict(recipe.match) if recipe.match else False}
    if recipe.method.needs_calibration:
        params["calibration"] = {**asdict(recipe.calibration), "text": public_text_label(recipe.calibration.text)}
    return {
        "title": f"{recipe.method.name} merge of {', '.join(label[m.model] for m in recipe.models)}",
        "method": f"merge/{recipe.method.name}",
        "parameters": params,
        "inputs": recipe.inputs,
        "base_model": [hub_id_of(m) for m in recipe.inputs],  # lineage: every input's Hub ancestor, once
        "extra": {
            "models": models,
            "base": label.get(recipe.base_model),
            "anchor": label[report.anchor],
            "matched": recipe.match is not None,
            "distances": {label[k]: v for k, v in report.distances.items()},
            "tied_embeddings": outcome.tied_output,
        },
    }
