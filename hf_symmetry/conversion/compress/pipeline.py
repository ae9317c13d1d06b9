"""Entry points: the pipeline on tensors, on a loaded model, and on a checkpoint folder (every route's)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig

from ...assets import resolve_text
from ...calibration import CalibrationText
from ...checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    config_dtype,
    parse_size,
)
from ...evaluation.compare import load_tokenizer
from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM
from ...text import read_text
from ..remote_code import save_family_config
from ..stream import DictSink, DictSource
from .assemble import build_model, config_object
from .core import compress_into
from .layernorm_decoders import LayerNormDecoders, layer_norm_tensors, through_rms_decoder
from .layernorm_decoders import check as check_layer_norm
from .layernorm_decoders import build as build_rms_decoder
from .moments import CalibrationStats
from .options import CompressOptions
from .plan import Plan, plan_for
from .report import CompressReport, finish_folder
from .routes import CALIBRATION, CompressRun, CountingSink, Route, check_calibration
from .stock import StockSlice, why_not_stock

Tensors = dict[str, torch.Tensor]


def compress_tensors(run: CompressRun) -> tuple[Tensors, dict, CompressReport]:
    """The whole pipeline on tensors, collected in memory: (state dict, config dict, report)."""
    if run.sink is not None:
        raise ValueError("compress_tensors collects the tensors itself; write into a sink with compress_into")
    sink = DictSink()
    new_config, report, _ = compress_into(replace(run, sink=sink))
    return dict(sink), new_config, report


def compress_model(
    model,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    progress: bool = False,
    stats: CalibrationStats | None = None,
    placement=None,
    calibration: CalibrationText = CALIBRATION,
    width: int | None = None,
):
    """In memory: a loaded model -> (CompressedLlamaForCausalLM, report), or (RMSDecoderForCausalLM, report)
    for a LayerNorm decoder (``width``: SliceGPT's residual width there instead of the ratio's). ``calib_ids``
    run at ``calibration``'s sizes."""
    options.validate()
    check_calibration(calibration)
    dtype = next(model.parameters()).dtype
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    config, sink = model.config.to_dict(), DictSink()
    run = CompressRun(source, config, options, calib_ids, placement, progress, dtype, sink, calibration=calibration)
    if through_rms_decoder(config):
        check_layer_norm(config, source.keys(), options)
        new_config, report = layer_norm_tensors(run, width)
        compressed, counted = build_rms_decoder(dict(sink), new_config, dtype)
    else:
        new_config, report, _ = compress_into(replace(run, hf_config=model.config, stats=stats))
        compressed, counted = build_model(dict(sink), new_config, dtype)
    report.accounting.compressed_model_params_counted = counted
    return compressed, report


class CompressedFamily(Route):
    """The compressed (remote-code) family; its plan is made by :meth:`check`."""

    plan: Plan | None = None

    def check(self, reader: CheckpointReader, options: CompressOptions) -> None:
        self.plan, _ = plan_for(reader, reader.config, options)

    def write(self, run: CompressRun) -> CompressReport:
        hf_config = AutoConfig.from_pretrained(run.source.path)
        new_config, report, layer_map = compress_into(replace(run, hf_config=hf_config, plan=self.plan))
        if layer_map is not None:  # written next to the weights
            layer_map.save(run.folder)
        save_family_config(CompressedLlamaForCausalLM, config_object(new_config), run.dtype, run.folder)
        return report


def route_for(config: dict, options: CompressOptions, stock: StockSlice | None = None) -> Route:
    """The one decision of a folder's route: SliceGPT as the source's stock family where ``stock`` (the stock
    route, ``None``: not wanted, ``--remote-code``) is given and :func:`.stock.why_not_stock` allows; LayerNorm
    decoders through the RMS-decoder family; else the compressed family."""
    refusal = None
    if options.slicing:
        refusal = "--remote-code" if stock is None else why_not_stock(config, options, stock.untie)
        if refusal is None:
            return stock
    if through_rms_decoder(config):
        return LayerNormDecoders(refusal)
    return CompressedFamily(refusal)


def read_calibration(src, calibration, options) -> torch.Tensor | None:
    """The token ids of ``calibration`` (a :class:`...calibration.CalibrationText`, or ``None``) with the
    tokenizer of the folder ``src``; ``None`` where ``options`` needs no calibration."""
    if calibration is None:
        if options.needs_calibration:
            raise ValueError(
                f"--calib is required for {options.label} (calibration text: a UTF-8 file or an embedded name)"
            )
        return None
    if not options.needs_calibration:
        read_text(resolve_text(calibration.text))  # unused, but an empty file fails before any work
        return None
    ids = calibration.ids(load_tokenizer(src))
    if ids.numel() < 2:
        raise ValueError(f"calibration text {calibration.text} has fewer than two tokens")
    return ids


def compress_checkpoint(
    src: str | Path,
    out: str | Path,
    options: CompressOptions,
    calibration: CalibrationText | None = None,
    stock: StockSlice | None = None,
    overwrite: bool = False,
    progress: bool = True,
    placement=None,
) -> CompressReport:
    """Compress the HF folder ``src`` into ``out`` (a non-empty one only with ``overwrite``) by its route
    (:func:`route_for`). ``calibration`` is needed by every method but stage none; ``stock`` (a
    :class:`.stock.StockSlice`) writes SliceGPT as the source's stock family where it can. Every input is checked before
    any work and ``out`` appears only when everything succeeded. The source is never loaded whole: calibration
    reads one decoder layer at a time on ``placement``'s device, and tensors go to 2 GB shards as they are made."""
    options.validate()
    check_calibration(calibration)
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    route = route_for(reader.config, options, stock)
    route.check(reader, options)
    calib_ids = read_calibration(src, calibration, options)  # an empty file fails here, before any load
    dtype = config_dtype(reader.config)
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size("2GB"), metadata={"hf_symmetry": "compress"})
        sink = CountingSink(writer)
        run = CompressRun(
            reader,
            reader.config,
            options,
            calib_ids,
            placement,
            progress,
            dtype,
            sink,
            tmp,
            calibration=calibration or CALIBRATION,
        )
        report = route.write(run)
        writer.close()
        finish_folder(tmp, report, run, src, out, sink.counted)
    return report
