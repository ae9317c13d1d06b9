"""Entry points: the whole pipeline on tensors, on a loaded model, and on a checkpoint folder (which
hands the stock SliceGPT output to :mod:`.stock` and LayerNorm decoders to :mod:`.layernorm`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig

from ...checkpoint_io import CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, parse_size
from ...devices import linalg_device
from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM
from ...solvers.linalg import limit_threads
from ..remote_code import save_family_config
from ..stream import DictSource, TensorSource
from .allocate import allocate_for
from .allocate_widths import allocate_slice_for
from .assemble import Assembler, build_model, compressed_config, config_object
from .folded import read_folded
from .layernorm import compress_layer_norm_checkpoint, compress_layer_norm_model, through_rms_decoder
from .moments import CalibrationInput, CalibrationStats, one_pass_statistics, read_calibration, require_calibration
from .options import CompressOptions
from .pca import sequential_stream_pca
from .plan import Plan, check_family, plan_for
from .report import CompressReport, finish_folder, summarise_traces
from .solve import solve
from .stock import compress_stock_checkpoint, why_not_stock

Tensors = dict[str, torch.Tensor]


def compress_tensors(
    source: TensorSource,
    config: dict,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    plan: Plan | None = None,
    stats: CalibrationStats | None = None,
    hf_config=None,
    rotations: list[torch.Tensor] | None = None,
    placement=None,
    sink=None,
    scratch=None,
) -> tuple[Tensors, dict, CompressReport]:
    """The whole pipeline on tensors: (compressed state dict, config dict, report). Calibration runs
    the layer-wise engine over ``source`` on ``placement`` (:func:`hf_symmetry.devices.resolve`;
    default CPU float32); ``stats`` may be passed in instead (e.g. cached by a benchmark); ``plan``
    and ``rotations`` override the planned structures and the starting rotations (see :func:`solve`).
    The norm-folded layers are read from ``source`` as the steps need them. ``sink``: receives the
    compressed tensors as they are assembled, layer by layer (the returned state dict is then empty).
    ``scratch``: a folder for the solver's temporary files (one global Q's warm starts)."""
    times = {}
    t0 = time.perf_counter()
    if plan is None:
        plan, adapter = plan_for(source, config, options)
    else:
        adapter = check_family(config, source.keys())
    if stats is None:  # measured as the solver reaches each segment where that is enough
        stats = one_pass_statistics(source, config, options, calib_ids, placement, progress, on_demand=True)
    times["calibration"] = time.perf_counter() - t0
    if options.allocation == "sensitivity" and plan.accounting.get("allocation") != "sensitivity":
        require_calibration(options, calib_ids)
        t = time.perf_counter()
        ids = calib_ids[: options.calib_tokens]
        if options.slicing:
            keep, allocation = allocate_slice_for(source, config, options, plan, ids, stats, placement, progress)
        else:
            keep, allocation = allocate_for(
                source,
                config,
                options,
                plan,
                ids,
                stats.token_counts if stats is not None else None,
                placement,
                progress,
            )
        plan, _ = plan_for(source, config, options, keep=keep)
        plan.accounting["allocation_report"] = allocation
        times["allocation"] = time.perf_counter() - t
    t1 = time.perf_counter()
    # the solvers walk the segments in order (two layers at a time; sequential calibration holds its
    # own copy of the layer it runs, so one is kept and a segment reaching into the next layer re-reads
    # the previous one for its assembly); SliceGPT's PCA reads no weights
    layers, globals_, gamma = read_folded(
        source, adapter, source.keys(), plan.tied, lazy=True, keep=1 if options.slicing or options.sequential else 2
    )
    assembler = Assembler(plan, layers, globals_, gamma, dtype, sink)
    new_config = compressed_config(config, plan, options, hf_config)
    calib = None
    if options.solver == "pca-sequential":
        require_calibration(options, calib_ids)
        rotations, stats = sequential_stream_pca(
            source, config, calib_ids[: options.calib_tokens], options.calib_seq_len, plan.residual, placement, progress
        )
    elif options.sequential:
        require_calibration(options, calib_ids)
        calib = CalibrationInput(source, config, calib_ids[: options.calib_tokens], options.calib_seq_len, placement)

    with limit_threads(1):
        res = solve(
            plan,
            layers,
            globals_,
            stats,
            options,
            progress,
            rotations,
            calib,
            device=linalg_device(placement),
            keep_stats=False,
            on_segment=assembler.segment_done,  # parts written as they are solved
            row_dtype=dtype,
            scratch=scratch,
        )
    times["solve"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    state = assembler.finish(res, progress)
    times["assemble"] = time.perf_counter() - t2
    if sink is not None and assembler.layer_map.complete():
        sink.layer_map = assembler.layer_map.map  # written next to the weights (heal's layer targets)
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
    return state, new_config, report


def compress_model(
    model,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    progress: bool = False,
    stats: CalibrationStats | None = None,
    placement=None,
):
    """In memory: a loaded HF Llama-family model -> (CompressedLlamaForCausalLM, report); an OPT / GPT-2
    model -> (RMSDecoderForCausalLM, report) (:mod:`.layernorm`)."""
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
        dtype=dtype,
        progress=progress,
        stats=stats,
        hf_config=model.config,
        placement=placement,
    )
    compressed, counted = build_model(state, new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return compressed, report


def compress_checkpoint(
    src: str | Path,
    out: str | Path,
    options: CompressOptions,
    calib_text: str | Path | None,
    overwrite: bool = False,
    progress: bool = True,
    placement=None,
    max_shard_size: str | int = "2GB",
    stock=None,
) -> CompressReport:
    """Compress the HF folder ``src`` into ``out`` (loadable with ``trust_remote_code=True``). ``stock``
    (a :class:`.stock.StockOptions`): where SliceGPT with one global PCA and one width can be written as
    the source's own stock family (:func:`.stock.why_not_stock`), it is (no remote code). Every
    input is checked before any work; ``out`` appears only when everything succeeded. The tokenizer is
    loaded once; the source model is never loaded whole: calibration reads the checkpoint one decoder
    layer at a time on ``placement``'s device, the solvers read the layers as they need them, and the
    compressed tensors are written to safetensors shards as they are assembled. Perplexity before/after is the
    command's verification
    step (:func:`record_verification`), run on the written folder."""
    options.validate()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    if stock is not None:
        if why_not_stock(reader.config, options, stock.untie) is None:
            return compress_stock_checkpoint(
                src, out, options, calib_text, stock, overwrite, progress, placement, max_shard_size
            )
    if through_rms_decoder(reader.config):  # LayerNorm decoders: via the RMS-decoder family
        return compress_layer_norm_checkpoint(reader, out, options, calib_text, overwrite, progress, placement)
    plan, adapter = plan_for(reader, reader.config, options)
    calib_ids = read_calibration(src, calib_text, options)  # an empty file fails here, before any load
    hf_config = AutoConfig.from_pretrained(src)
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "compress"})
        counted = 0

        def sink(tensors: Tensors) -> None:  # one module's tensors at a time, straight to the shard
            nonlocal counted
            counted += sum(t.numel() for t in tensors.values())
            writer.add(tensors)

        sink.row_blocks = True  # the writer streams RowBlocks (Assembler.put)

        _, new_config, report = compress_tensors(
            reader,
            reader.config,
            options,
            calib_ids=calib_ids,
            dtype=dtype,
            progress=progress,
            plan=plan,
            hf_config=hf_config,
            placement=placement,
            sink=sink,
            scratch=tmp,
        )
        writer.close()
        if getattr(sink, "layer_map", None) is not None:
            sink.layer_map.save(tmp)
        save_family_config(CompressedLlamaForCausalLM, config_object(new_config), dtype, tmp)
        finish_folder(tmp, report, options, src, reader.path, out, counted)
    return report
