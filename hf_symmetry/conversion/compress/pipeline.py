"""Entry points: the whole pipeline on tensors, on a loaded model, and on a checkpoint folder (the one
folder entry point of every route: the compressed family here, the stock SliceGPT output in :mod:`.stock`,
LayerNorm decoders in :mod:`.layernorm_decoders`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig

from ...calibration import CalibrationText
from ...checkpoint_io import CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, parse_size
from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM
from ..remote_code import save_family_config
from ..stream import DictSink, DictSource
from .assemble import build_model, config_object
from .core import compress_into
from .layernorm_decoders import LayerNormDecoders, compress_layer_norm_model, through_rms_decoder
from .moments import CalibrationStats, read_calibration
from .options import CompressOptions
from .plan import Plan, plan_for
from .report import CompressReport, finish_folder
from .routes import CALIBRATION, CompressRun, CountingSink, Route, check_calibration, checkpoint_dtype
from .stock import REMOTE_CODE, StockOptions, StockSlice, why_not_stock

Tensors = dict[str, torch.Tensor]


def compress_tensors(run: CompressRun) -> tuple[Tensors, dict, CompressReport]:
    """The whole pipeline on tensors, collected in memory: (compressed state dict, config dict, report)
    (:func:`compress_into` with a :class:`..stream.DictSink`; ``run.sink`` must be unset)."""
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
):
    """In memory: a loaded HF Llama-family model -> (CompressedLlamaForCausalLM, report); an OPT / GPT-2
    model -> (RMSDecoderForCausalLM, report) (:mod:`.layernorm_decoders`). ``calib_ids``: the calibration
    token ids, of which the first ``calibration.tokens`` run in sequences of ``calibration.seq_len``."""
    options.validate()
    check_calibration(calibration)
    if through_rms_decoder(model.config):
        return compress_layer_norm_model(
            model, options, calib_ids, progress=progress, placement=placement, calibration=calibration
        )
    dtype = next(model.parameters()).dtype
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    state, new_config, report = compress_tensors(
        CompressRun(
            source,
            model.config.to_dict(),
            options,
            calib_ids,
            placement,
            progress,
            dtype,
            hf_config=model.config,
            stats=stats,
            calibration=calibration,
        )
    )
    compressed, counted = build_model(state, new_config, dtype)
    report.accounting.compressed_model_params_counted = counted
    return compressed, report


class CompressedFamily(Route):
    """The compressed (remote-code) family: the plan (made by :meth:`check`), calibration, solvers and
    assembly of this package."""

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


def route_for(config: dict, options: CompressOptions, stock: StockOptions = REMOTE_CODE) -> Route:
    """The one decision of a folder's route: SliceGPT as the source's stock family where ``stock`` asks for
    it (not ``remote_code``) and :func:`.stock.why_not_stock` allows; LayerNorm decoders through the
    RMS-decoder family; else the compressed family."""
    refusal = None
    if options.slicing:
        refusal = "--remote-code" if stock.remote_code else why_not_stock(config, options, stock.untie)
        if refusal is None:
            return StockSlice(stock)
    if through_rms_decoder(config):
        return LayerNormDecoders(refusal)
    return CompressedFamily(refusal)


def compress_checkpoint(
    src: str | Path,
    out: str | Path,
    options: CompressOptions,
    calibration: CalibrationText | None = None,
    stock: StockOptions = REMOTE_CODE,
    overwrite: bool = False,
    progress: bool = True,
    placement=None,
) -> CompressReport:
    """Compress the HF folder ``src`` into ``out`` (a non-empty one only with ``overwrite``): the one entry point of
    every route (:func:`route_for`). ``calibration`` (a :class:`...calibration.CalibrationText`; needed by every
    method but stage none): its text's first ``tokens`` tokens, in sequences of ``seq_len``. ``stock`` (a
    :class:`.stock.StockOptions`; default :data:`.stock.REMOTE_CODE`): unless it says ``remote_code``, where
    SliceGPT with one global PCA and one width can be written as the source's own stock family
    (:func:`.stock.why_not_stock`), it is (no remote code); otherwise the output loads with
    ``trust_remote_code=True``. Every input is checked before any work; ``out`` appears only when everything
    succeeded. The tokenizer is loaded once; the source model is never loaded whole: calibration reads the
    checkpoint one decoder layer at a time on ``placement``'s device, the solvers read the layers as they need them,
    and the tensors are written to safetensors shards (of at most 2 GB) as they are made. Perplexity before/after is
    the command's verification step (:func:`record_verification`), run on the written folder."""
    options.validate()
    check_calibration(calibration)
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    route = route_for(reader.config, options, stock)
    route.check(reader, options)
    calib_ids = read_calibration(src, calibration, options)  # an empty file fails here, before any load
    dtype = checkpoint_dtype(reader.config)
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
