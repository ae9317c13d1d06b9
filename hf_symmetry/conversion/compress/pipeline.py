"""Entry points: the whole pipeline on tensors, on a loaded model, and on a checkpoint folder (the one
folder entry point of every route: the compressed family here, the stock SliceGPT output in :mod:`.stock`,
LayerNorm decoders in :mod:`.layernorm_decoders`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig

from ...checkpoint_io import CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, parse_size
from ...devices import linalg_device
from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM
from ...solvers.linalg import limit_threads
from ..layer_map import LayerMap
from ..remote_code import save_family_config
from ..stream import DictSink, DictSource, TensorSource
from .allocate import allocate_for
from .allocate_widths import allocate_slice_for
from .assemble import Assembler, build_model, compressed_config, config_object
from .folded import read_folded
from .layernorm_decoders import LayerNormDecoders, compress_layer_norm_model, through_rms_decoder
from .moments import CalibrationInput, CalibrationStats, one_pass_statistics, read_calibration, require_calibration
from .options import CompressOptions
from .pca import sequential_stream_pca
from .plan import Plan, check_family, plan_for
from .report import CompressReport, finish_folder, summarise_traces
from .routes import CountingSink, FolderJob, FolderSettings, Given, Route, TensorRun, checkpoint_dtype
from .solve import SolveRun, solve
from .stock import REMOTE_CODE, StockOptions, StockSlice, why_not_stock

Tensors = dict[str, torch.Tensor]


def compress_tensors(
    source: TensorSource,
    config: dict,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    hf_config=None,
    given: Given = Given(),
    run: TensorRun = TensorRun(),
) -> tuple[Tensors, dict, CompressReport]:
    """The whole pipeline on tensors, collected in memory: (compressed state dict, config dict, report)
    (:func:`compress_into` with a :class:`..stream.DictSink`; ``run.sink`` must be unset)."""
    if run.sink is not None:
        raise ValueError("compress_tensors collects the tensors itself; write into a sink with compress_into")
    sink = DictSink()
    new_config, report, _ = compress_into(source, config, options, calib_ids, hf_config, given, replace(run, sink=sink))
    return dict(sink), new_config, report


def compress_into(
    source: TensorSource,
    config: dict,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    hf_config=None,
    given: Given = Given(),
    run: TensorRun = TensorRun(),
) -> tuple[dict, CompressReport, LayerMap | None]:
    """The whole pipeline on tensors, written into ``run.sink`` (a :class:`..stream.TensorSink`) as they are
    assembled, layer by layer: (config dict, report, the layer map where every layer maps to the source,
    else None). Calibration runs the layer-wise engine over ``source`` on ``run.placement``; ``given``
    (:class:`.routes.Given`) may hand in the statistics, the planned structures and the starting rotations
    (see :func:`solve`). The norm-folded layers are read from ``source`` as the steps need them.
    ``run.scratch``: a folder for the solver's temporary files (one global Q's warm starts)."""
    times = {}
    t0 = time.perf_counter()
    placement, progress = run.placement, run.progress
    plan, stats = given.plan, given.stats
    if plan is None:
        plan, adapter = plan_for(source, config, options)
    else:
        adapter = check_family(config, source.keys())
    if stats is None:  # measured as the solver reaches each segment where that is enough
        stats = one_pass_statistics(source, config, options, calib_ids, placement, progress, on_demand=True)
    times["calibration"] = time.perf_counter() - t0
    if options.allocation == "sensitivity" and plan.accounting.get("allocation") != "sensitivity":
        t = time.perf_counter()
        plan = _allocated_plan(source, config, options, plan, calib_ids, stats, run)
        times["allocation"] = time.perf_counter() - t
    t1 = time.perf_counter()
    # the solvers walk the segments in order (two layers at a time; sequential calibration holds its
    # own copy of the layer it runs, so one is kept and a segment reaching into the next layer re-reads
    # the previous one for its assembly); SliceGPT's PCA reads no weights
    layers, globals_, gamma = read_folded(
        source, adapter, source.keys(), plan.tied, lazy=True, keep=1 if options.slicing or options.sequential else 2
    )
    assembler = Assembler(plan, layers, globals_, gamma, run.dtype, run.sink)
    new_config = compressed_config(config, plan, options, hf_config)
    calib, rotations = None, given.rotations
    if options.solver == "pca-sequential":
        require_calibration(options, calib_ids)
        rotations, stats = sequential_stream_pca(
            source, config, calib_ids[: options.calib_tokens], options.calib_seq_len, plan.residual, placement, progress
        )
    elif options.sequential:
        require_calibration(options, calib_ids)
        calib = CalibrationInput(source, config, calib_ids[: options.calib_tokens], options.calib_seq_len, placement)

    with limit_threads(1):
        solve_run = SolveRun(
            progress,
            linalg_device(placement),
            keep_stats=False,
            on_segment=assembler.segment_done,  # parts written as they are solved
            row_dtype=run.dtype,
            scratch=run.scratch,
        )
        res = solve(plan, layers, globals_, stats, options, rotations, calib, solve_run)
    times["solve"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    assembler.finish(res, progress)
    times["assemble"] = time.perf_counter() - t2
    layer_map = assembler.layer_map.map if assembler.layer_map.complete() else None  # heal's layer targets
    report = CompressReport(
        source="",
        output=None,
        family=plan.family,
        options=options.as_dict(),
        accounting=plan.accounting,
        relative_errors=res.relative_errors,
        objective=summarise_traces(res.traces),
        calibration_tokens=stats.tokens if stats else 0,
        seconds=times,
        method=options.label,
    )
    return new_config, report, layer_map


def _allocated_plan(source, config: dict, options: CompressOptions, plan: Plan, calib_ids, stats, run: TensorRun):
    """``--allocation sensitivity``: the plan at the sizes measured per layer (SliceGPT: per segment), with
    the allocation's report in its accounting."""
    require_calibration(options, calib_ids)
    ids = calib_ids[: options.calib_tokens]
    if options.slicing:
        keep, allocation = allocate_slice_for(source, config, options, plan, ids, stats, run.placement, run.progress)
    else:
        counts = stats.token_counts if stats is not None else None
        keep, allocation = allocate_for(source, config, options, plan, ids, counts, run.placement, run.progress)
    plan, _ = plan_for(source, config, options, keep=keep)
    plan.accounting["allocation_report"] = allocation
    return plan


def compress_model(
    model,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    progress: bool = False,
    stats: CalibrationStats | None = None,
    placement=None,
):
    """In memory: a loaded HF Llama-family model -> (CompressedLlamaForCausalLM, report); an OPT / GPT-2
    model -> (RMSDecoderForCausalLM, report) (:mod:`.layernorm_decoders`)."""
    options.validate()
    if through_rms_decoder(model.config):
        return compress_layer_norm_model(model, options, calib_ids, progress=progress, placement=placement)
    dtype = next(model.parameters()).dtype
    config = model.config.to_dict()
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    state, new_config, report = compress_tensors(
        source,
        config,
        options,
        calib_ids=calib_ids,
        hf_config=model.config,
        given=Given(stats=stats),
        run=TensorRun(placement, progress, dtype),
    )
    compressed, counted = build_model(state, new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return compressed, report


class CompressedFamily(Route):
    """The compressed (remote-code) family: the plan (made by :meth:`check`), calibration, solvers and
    assembly of this package."""

    plan: Plan | None = None

    def check(self, reader: CheckpointReader, options: CompressOptions) -> None:
        self.plan, _ = plan_for(reader, reader.config, options)

    def write(self, job: FolderJob) -> CompressReport:
        hf_config = AutoConfig.from_pretrained(job.reader.path)
        new_config, report, layer_map = compress_into(
            job.reader,
            job.reader.config,
            job.options,
            calib_ids=job.calib_ids,
            hf_config=hf_config,
            given=Given(plan=self.plan),
            run=TensorRun(job.placement, job.progress, job.dtype, job.sink, job.folder),
        )
        if layer_map is not None:  # written next to the weights
            layer_map.save(job.folder)
        save_family_config(CompressedLlamaForCausalLM, config_object(new_config), job.dtype, job.folder)
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
    calib_text: str | Path | None,
    stock: StockOptions = REMOTE_CODE,
    progress: bool = True,
    placement=None,
    folder: FolderSettings = FolderSettings(),
) -> CompressReport:
    """Compress the HF folder ``src`` into ``out``: the one entry point of every route (:func:`route_for`).
    ``stock`` (a :class:`.stock.StockOptions`; default :data:`.stock.REMOTE_CODE`): unless it says
    ``remote_code``, where SliceGPT with one global PCA and one width can be written as the source's own stock
    family (:func:`.stock.why_not_stock`), it is (no remote code); otherwise the output loads with
    ``trust_remote_code=True``. Every input is checked before any work;
    ``out`` appears only when everything succeeded. The tokenizer is loaded once; the source model is never
    loaded whole: calibration reads the checkpoint one decoder layer at a time on ``placement``'s device,
    the solvers read the layers as they need them, and the tensors are written to safetensors shards as
    they are made. Perplexity before/after is the command's verification step
    (:func:`record_verification`), run on the written folder."""
    options.validate()
    check_output_dir(out, folder.overwrite)
    reader = CheckpointReader(src)
    route = route_for(reader.config, options, stock)
    route.check(reader, options)
    calib_ids = read_calibration(src, calib_text, options)  # an empty file fails here, before any load
    dtype = checkpoint_dtype(reader.config)
    with atomic_output_dir(out, folder.overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(folder.max_shard_size), metadata={"hf_symmetry": "compress"})
        sink = CountingSink(writer)
        report = route.write(FolderJob(reader, options, calib_ids, dtype, sink, tmp, placement, progress))
        writer.close()
        finish_folder(tmp, report, options, src, reader.path, out, sink.counted)
    return report
