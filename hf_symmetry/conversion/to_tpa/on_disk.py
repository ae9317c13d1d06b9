"""The checkpoint entry point (:func:`convert_checkpoint_to_tpa`): a safetensors folder streamed layer
by layer into a TPA model folder with its remote code, layer map, report and card."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

from ...architectures import Adapter
from ...architectures.capabilities import require
from ...assets import resolve_model, resolve_text
from ...calibration import CalibrationText
from ...calibration.memory import release_free_memory
from ...checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
)
from ...devices import linalg_device
from ...flags import Flag, flag, nested
from ...hub.cards import write_card
from ...hub.lineage import public_report
from ...modeling.modeling_tpa import LAYER_PREFIX as TPA_LAYER_PREFIX
from ...modeling.modeling_tpa import TPAForCausalLM
from ..layer_map import LayerMap
from ..layer_parts import read_part, stand_ins
from ..remote_code import save_family_config
from .grams import attention_input_grams
from .layer import LayerFit, layout_keys, split_layer_keys, tpa_globals, tpa_layer, tpa_name
from .report import LayerError, ToTPAReport, tpa_card_data
from .target import check_ranks, heads, source_biases, tpa_config_from


@dataclass(frozen=True)
class ToTPAOptions:
    """What ``to-tpa`` converts to: the K and V ranks (None: the number of KV heads, exact); ``calibration``, the
    calibration text whose first ``calibration.tokens`` tokens the reduction is fitted to. (The written folder is
    verified by the command, as every conversion's: ``commands/runner.py``.)"""

    k_rank: int | None = flag(None, "R_K (default: number of KV heads = exact)", type=int)
    v_rank: int | None = flag(None, "R_V (default: number of KV heads = exact)", type=int)
    calibration: CalibrationText | None = nested(
        CalibrationText,
        text=Flag(
            "calibration text (file or embedded name, e.g. britannica-calib) for reduced ranks",
            name="--calib",
            metavar="FILE",
            unset=None,
        ),
        tokens=Flag(f"calibration tokens (default: {CalibrationText.tokens})", name="--calib-tokens", type=int),
    )


def convert_checkpoint_to_tpa(
    source: str | Path,
    out: str | Path,
    options: ToTPAOptions = ToTPAOptions(),
    overwrite: bool = False,
    progress: bool = True,
    placement=None,
    max_shard_size: str | int = "2GB",
) -> ToTPAReport:
    """Convert the checkpoint ``source`` layer by layer (never loading the whole model; every layer
    read through the family's adapter) and write an HF folder (config with ``auto_map``,
    ``configuration_tpa.py``/``modeling_tpa.py``, weights, tokenizer, generation config,
    ``tpa_conversion.json``) to ``out`` via a temporary folder renamed into place. With ``options.calibration`` the
    attention inputs are measured by the layer-wise calibration engine on ``placement``
    (:func:`hf_symmetry.devices.resolve`), and the head-mode reductions run on that device too."""
    t0 = time.time()
    src = resolve_model(source)
    out = Path(out)
    check_output_dir(out, overwrite)
    config = AutoConfig.from_pretrained(src)  # fail fast, before reading any weights
    require(config, "to_tpa")
    reader = CheckpointReader(src)
    adapter = Adapter.from_config(config, reader.keys())
    heads(adapter)
    k_rank, v_rank = check_ranks(adapter, options.k_rank, options.v_rank)
    n_kv = adapter.layout.n_kv_heads
    global_keys, per_layer = layout_keys(adapter, reader.keys())
    calibration = options.calibration
    if calibration is not None:
        resolve_text(calibration.text)  # a missing text fails before any work
    reduced = k_rank < n_kv or v_rank < n_kv
    grams, calib_n = None, 0
    if calibration is not None:
        ids = calibration.ids(AutoTokenizer.from_pretrained(src))
        calib_n = int(ids.numel())
        if reduced:
            # one layer calibrated per converted layer: one Gram in memory, whatever the depth
            grams = attention_input_grams(src, ids, progress=False, placement=placement, lazy=True)

    shapes, dtypes = reader.shapes(), reader.dtypes()
    dtype = dtypes[per_layer[0][0]]
    flags = source_biases(adapter.read_layer(0, stand_ins(per_layer[0], shapes, dtypes)))
    tcfg = tpa_config_from(config, k_rank, v_rank, **flags)
    report = ToTPAReport.start(
        str(src), adapter, tcfg, k_rank, v_rank, exact=not reduced, calibrated=grams is not None, calib_tokens=calib_n
    )
    fit = LayerFit(k_rank, v_rank, flags, device=linalg_device(placement))

    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size))
        _write_layers(reader, adapter, writer, fit, grams, report, progress)
        for k in global_keys:  # vocabulary-sized: one at a time, as read
            writer.add(tpa_globals(adapter, reader.get([k]), tcfg.tie_word_embeddings))
        writer.close()
        save_family_config(TPAForCausalLM, tcfg, dtype, tmp)
        # the residual stream is untouched: heal's layer targets are the original's
        LayerMap.identity(adapter.n_layers, tcfg.hidden_size, "to_tpa").save(tmp)
        if not copy_side_files(Path(src), tmp):
            report.notes.append("the source folder has no tokenizer to copy")
        report.seconds = time.time() - t0
        (tmp / "tpa_conversion.json").write_text(json.dumps(public_report(report.as_dict()), indent=2) + "\n")
        write_card(tmp, "to_tpa", tpa_card_data(src, out, report))
    return report


def _write_layers(reader: CheckpointReader, adapter: Adapter, writer, fit: LayerFit, grams, report, progress) -> None:
    """Every layer converted (its errors appended to ``report``) and written, one at a time; ``grams``: the
    calibration engine's lazy Grams (the engine runs layer i, and lets it go, before layer i is read)."""
    _, per_layer = layout_keys(adapter, reader.keys())
    shapes, dtypes = reader.shapes(), reader.dtypes()
    for i in tqdm(range(adapter.n_layers), desc="to-tpa", disable=not progress, unit="layer"):
        # the engine runs layer i (and lets it go) before this layer is read
        gram = None if grams is None else next(grams).to(fit.device)
        keys = per_layer[i]
        like = dtypes[keys[0]]  # every tensor of the layer is written in the dtype of its first
        stand = stand_ins(keys, shapes, dtypes)
        converted, passed = split_layer_keys(adapter, i, keys, shapes)
        canon = read_part(adapter, i, stand, reader.get(converted), torch.float64)
        new, errs = tpa_layer(canon, adapter.layout, fit, gram)
        report.layers.append(LayerError(i, *errs))
        prefix = TPA_LAYER_PREFIX.format(i)
        writer.add(dict(sorted((prefix + k, v.to(like)) for k, v in new.items())))
        del canon, new, gram
        release_free_memory()
        for key in passed:  # unchanged matrices: one at a time, in their own dtype
            part = read_part(adapter, i, stand, reader.get([key]), None)
            writer.add({prefix + tpa_name(name): t.to(like) for name, t in part.items()})
            del part
    if grams is not None:
        grams.close()  # the calibration run's activations
    release_free_memory()
