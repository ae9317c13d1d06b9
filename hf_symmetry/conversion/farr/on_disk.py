"""The checkpoint entry point (:func:`farr_checkpoint`): a safetensors folder streamed into a FaRR
model folder with its remote code, report, heatmap and card; and the calibration tokens it and
``spectra`` read."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ...architectures import Adapter
from ...assets import resolve_text
from ...calibration import CalibrationText
from ...checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
)
from ...devices import linalg_device
from ...evaluation.compare import load_tokenizer, write_json
from ...hub.cards import write_card
from ...hub.lineage import public_report
from ...hub.measure import count_stored_parameters
from ..layer_map import LayerMap
from ..remote_code import save_config_with_code
from ..stream import Tensors
from .calibrated import LayerWeights, calibrated_analysis
from .card import farr_card_data, write_rank_heatmap
from .options import FarrOptions
from .reduce import FarrReport, run_farr, state_dict_parameters
from .target import farr_classes, farr_target

REPORT_FILE = "farr_report.json"


def save_farr_config(farr_config, folder: Path) -> None:
    """config.json with ``auto_map`` plus the flat remote-code files, so the folder loads with
    ``trust_remote_code=True`` where hf_symmetry is not installed (:mod:`..remote_code`)."""
    save_config_with_code(farr_config, farr_classes(farr_config), folder)


def farr_checkpoint(
    src: str | Path,
    out: str | Path,
    options: FarrOptions,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
    calibration: CalibrationText | None = None,
    placement=None,
) -> FarrReport:
    """Stream ``src`` (an HF safetensors folder) into a FaRR model folder at ``out``. With ``calibration``
    (None: the data-free metric) the layer-wise calibration engine measures the attention inputs on the first
    ``calibration.tokens`` tokens (activation-aware metric) on ``placement``
    (:func:`hf_symmetry.devices.resolve`), one layer in memory at a time; the conversion streams too,
    and its SVDs and eigendecompositions run on that device."""
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    farr_target(Adapter.from_config(reader.config, reader.keys()), reader.config, reader.keys(), options)
    ids, record = None, None
    if calibration is not None:
        ids, record = calibration_tokens(src, calibration)
    with atomic_output_dir(out, overwrite) as tmp:
        weights = analysis = None
        if ids is not None:  # the metrics wait for the reduction pass in the (hidden) output folder
            weights = LayerWeights(tmp / ".farr-input-weights")
            analysis = calibrated_analysis(src, ids, options.paths, placement, progress, store=weights)
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "farr"})
        counter = _CountingSink(writer)
        farr_config, report, analysis = run_farr(
            reader,
            reader.config,
            options,
            counter,
            progress,
            weights=weights,
            analysis=analysis,
            device=linalg_device(placement),
        )
        if weights is not None:
            weights.close()
        report.calibration = record
        writer.close()
        farr_config.dtype = reader.config.get("dtype") or reader.config.get("torch_dtype")
        save_farr_config(farr_config, tmp)
        # the residual stream is untouched: heal's layer targets are the original's
        LayerMap.identity(farr_config.num_hidden_layers, farr_config.hidden_size, "farr").save(tmp)
        copy_side_files(reader.path, tmp)
        report.source, report.output = str(src), str(out)
        report.params_before = count_stored_parameters(reader.path)  # the count every card and report uses
        report.params_after = count_stored_parameters(tmp)
        report.seconds = time.perf_counter() - start
        write_json(tmp / REPORT_FILE, public_report(report.as_dict()))
        plots = [write_rank_heatmap(tmp, analysis, reader.config, reader.keys(), report, Path(src).name)]
        write_card(tmp, "farr", farr_card_data(src, out, report, plots))
    return report


def calibration_tokens(src, calibration: CalibrationText) -> tuple[torch.Tensor, dict]:
    """The first ``calibration.tokens`` token ids of its text in the tokenizer of the model folder ``src``, and
    a record of what was used."""
    if calibration.tokens <= 0:
        raise ValueError(f"calibration needs a positive number of tokens, got {calibration.tokens}")
    path = resolve_text(calibration.text)
    ids = calibration.ids(load_tokenizer(src))
    return ids, {"text": str(path), "tokens": int(ids.numel())}


class _CountingSink:
    def __init__(self, sink):
        self.sink, self.params = sink, 0

    def add(self, tensors: Tensors) -> None:
        self.params += state_dict_parameters(tensors)
        self.sink.add(tensors)
