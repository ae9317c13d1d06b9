"""Entry points: the whole pipeline on tensors, on a loaded model, and on a checkpoint folder."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...checkpoint import (CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, copy_side_files,
                           parse_size)
from ...hub.cards import public_report
from ...symmetry import structured as st
from ..stream import DictSource, TensorSource
from .assemble import Assembler, build_model, compressed_config, config_object, read_folded
from .calibration import (CalibrationInput, CalibrationStats, collect_statistics, one_pass_on_demand,
                          sequential_stream_pca)
from .layernorm import through_rms_decoder
from .options import CompressOptions
from .plan import Plan, check_family, plan_for
from .solve import solve

Tensors = dict[str, torch.Tensor]
REPORT_FILE = "compression_report.json"


@dataclass
class CompressReport:
    source: str
    output: str | None
    family: str
    options: dict
    accounting: dict
    relative_errors: dict
    objective: dict                  # per solved problem: first and last objective value, steps
    calibration_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)
    method: str = ""

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _summarise(traces: dict) -> dict:
    return {k: {"first": v[0], "last": v[-1], "steps": len(v)} for k, v in traces.items() if v}


def _require_calibration(options: CompressOptions, calib_ids: torch.Tensor | None) -> None:
    if calib_ids is None or calib_ids.numel() < 2:
        what = "sequential calibration" if options.sequential else "this compression"
        raise ValueError(f"{what} needs calibration text (--calib) with at least two tokens")


def one_pass_statistics(source: TensorSource, config: dict, options: CompressOptions,
                        calib_ids: torch.Tensor | None, placement=None, progress: bool = True,
                        on_demand: bool = False) -> CalibrationStats | None:
    """The statistics of one pass of the original model that ``options`` needs (token counts only
    where it needs no activations; ``None`` where it needs no calibration), layer by layer from
    ``source``. ``on_demand`` (for a solver that releases each segment's statistics once solved):
    where :attr:`CompressOptions.statistics_on_demand`, measured as the solver first reads them."""
    if not options.needs_calibration:
        return None
    _require_calibration(options, calib_ids)
    if on_demand and options.statistics_on_demand:
        return one_pass_on_demand(source, config, calib_ids[: options.calib_tokens], options.calib_seq_len,
                                  placement=placement, progress=progress)
    return collect_statistics(source, config, calib_ids[: options.calib_tokens], options.calib_seq_len,
                              want_normed=options.want_normed, want_stream=options.want_stream,
                              placement=placement, progress=progress, stream_sum=options.stream_sum)


def compress_tensors(source: TensorSource, config: dict, options: CompressOptions,
                     calib_ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                     progress: bool = True, plan: Plan | None = None, stats: CalibrationStats | None = None,
                     hf_config=None, rotations: list[torch.Tensor] | None = None,
                     placement=None, sink=None, scratch=None) -> tuple[Tensors, dict, CompressReport]:
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
    if stats is None:      # measured as the solver reaches each segment where that is enough
        stats = one_pass_statistics(source, config, options, calib_ids, placement, progress, on_demand=True)
    times["calibration"] = time.perf_counter() - t0
    if options.allocation == "sensitivity" and plan.accounting.get("allocation") != "sensitivity":
        from .allocate import allocate_for

        _require_calibration(options, calib_ids)
        t = time.perf_counter()
        keep, allocation = allocate_for(source, config, options, plan, calib_ids[: options.calib_tokens],
                                        stats.token_counts if stats is not None else None, placement, progress,
                                        stats=stats)
        plan, _ = plan_for(source, config, options, keep=keep)
        plan.accounting["allocation_report"] = allocation
        times["allocation"] = time.perf_counter() - t
    t1 = time.perf_counter()
    # the solvers walk the segments in order (two layers at a time; sequential calibration holds its
    # own copy of the layer it runs, so one is kept and a segment reaching into the next layer re-reads
    # the previous one for its assembly); SliceGPT's PCA reads no weights
    layers, globals_, gamma = read_folded(source, adapter, source.keys(), plan.tied, lazy=True,
                                          keep=1 if options.slicing or options.sequential else 2)
    assembler = Assembler(plan, layers, globals_, gamma, dtype, sink)
    new_config = compressed_config(config, plan, options, hf_config)
    calib = None
    if options.solver == "pca-sequential":
        _require_calibration(options, calib_ids)
        rotations, stats = sequential_stream_pca(source, config, calib_ids[: options.calib_tokens],
                                                 options.calib_seq_len, plan.residual, placement, progress)
    elif options.sequential:
        _require_calibration(options, calib_ids)
        calib = CalibrationInput(source, config, calib_ids[: options.calib_tokens], options.calib_seq_len, placement)
    from ...devices import linalg_device

    with st.limit_threads(1):
        res = solve(plan, layers, globals_, stats, options, progress, rotations, calib, device=linalg_device(placement),
                    keep_stats=False, on_segment=assembler.segment_done,   # parts written as they are solved
                    row_dtype=dtype, scratch=scratch)
    times["solve"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    state = assembler.finish(res, progress)
    times["assemble"] = time.perf_counter() - t2
    if sink is not None and assembler.layer_map.complete():
        sink.layer_map = assembler.layer_map.map     # written next to the weights (heal's layer targets)
    report = CompressReport(source="", output=None, family=plan.family, options=options.as_dict(),
                            accounting=plan.accounting, relative_errors=res.relative_errors,
                            objective=_summarise(res.traces), calibration_tokens=stats.tokens if stats else 0,
                            seconds=times, method=options.label)
    return state, new_config, report


def compress_model(model, options: CompressOptions, calib_ids: torch.Tensor | None = None, progress: bool = False,
                   stats: CalibrationStats | None = None, placement=None):
    """In memory: a loaded HF Llama-family model -> (CompressedLlamaForCausalLM, report); an OPT / GPT-2
    model -> (RMSDecoderForCausalLM, report) (:mod:`.layernorm`)."""
    options.validate()
    if through_rms_decoder(model.config):
        from .layernorm import compress_layer_norm_model

        return compress_layer_norm_model(model, options, calib_ids, progress=progress, placement=placement)
    dtype = next(model.parameters()).dtype
    config = model.config.to_dict()
    source = DictSource({k: v.detach() for k, v in model.state_dict().items()})
    state, new_config, report = compress_tensors(source, config, options, calib_ids=calib_ids, dtype=dtype,
                                                 progress=progress, stats=stats, hf_config=model.config,
                                                 placement=placement)
    compressed, counted = build_model(state, new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return compressed, report


def compress_checkpoint(src: str | Path, out: str | Path, options: CompressOptions, calib_text: str | Path | None,
                        overwrite: bool = False, progress: bool = True, placement=None,
                        max_shard_size: str | int = "2GB", stock=None) -> CompressReport:
    """Compress the HF folder ``src`` into ``out`` (loadable with ``trust_remote_code=True``). ``stock``
    (a :class:`.stock.StockOptions`): where SliceGPT with one global PCA and one width can be written as
    the source's own stock family (:func:`.stock.why_not_stock`), it is (no remote code). Every
    input is checked before any work; ``out`` appears only when everything succeeded. The tokenizer is
    loaded once; the source model is never loaded whole: calibration reads the checkpoint one decoder
    layer at a time on ``placement``'s device, the solvers read the layers as they need them, and the
    compressed tensors are written to safetensors shards as they are assembled. Perplexity before/after is the command's verification
    step (:func:`record_verification`), run on the written folder."""
    from transformers import AutoConfig

    from ...evaluation.compare import load_tokenizer
    from ...text import read_text, tokenize_text
    from .card import write_card

    options.validate()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    if stock is not None:
        from .stock import compress_stock_checkpoint, why_not_stock

        if why_not_stock(reader.config, options, stock.untie) is None:
            return compress_stock_checkpoint(src, out, options, calib_text, stock, overwrite, progress, placement,
                                             max_shard_size)
    if through_rms_decoder(reader.config):    # LayerNorm decoders: via the RMS-decoder family
        from .layernorm import compress_layer_norm_checkpoint

        return compress_layer_norm_checkpoint(reader, out, options, calib_text, overwrite, progress, placement)
    plan, adapter = plan_for(reader, reader.config, options)
    calib = read_text(calib_text) if calib_text is not None else None  # an empty file fails here, before any load
    if options.needs_calibration and calib is None:
        raise ValueError(f"--calib is required for {options.label} (calibration text: a UTF-8 file or an "
                         "embedded name)")
    calib_ids = None
    if options.needs_calibration:
        calib_ids = tokenize_text(load_tokenizer(src), calib, max_tokens=options.calib_tokens)
        if calib_ids.numel() < 2:
            raise ValueError(f"calibration text {calib_text} has fewer than two tokens")
    hf_config = AutoConfig.from_pretrained(src)
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "compress"})
        counted = 0

        def sink(tensors: Tensors) -> None:        # one module's tensors at a time, straight to the shard
            nonlocal counted
            counted += sum(t.numel() for t in tensors.values())
            writer.add(tensors)

        sink.row_blocks = True                      # the writer streams RowBlocks (Assembler.put)

        _, new_config, report = compress_tensors(reader, reader.config, options, calib_ids=calib_ids, dtype=dtype,
                                                 progress=progress, plan=plan, hf_config=hf_config,
                                                 placement=placement, sink=sink, scratch=tmp)
        writer.close()
        if getattr(sink, "layer_map", None) is not None:
            sink.layer_map.save(tmp)
        _save_config(new_config, dtype, tmp)
        report.accounting["compressed_model_params_counted"] = counted
        report.source, report.output = str(src), str(out)
        copy_side_files(reader.path, tmp)
        _write_report(tmp, report)
        write_card(tmp, report, options)
        for f in tmp.iterdir():          # like save_pretrained elsewhere: ordinary readable files
            if f.is_file():
                os.chmod(f, 0o644)
    return report


def _save_config(config: dict, dtype: torch.dtype, folder: Path) -> None:
    """config.json with ``auto_map`` plus the flat remote-code files, as ``save_pretrained`` writes them
    (the weights are streamed separately)."""
    from accelerate import init_empty_weights
    from transformers.dynamic_module_utils import custom_object_save

    from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM

    with init_empty_weights():
        skeleton = CompressedLlamaForCausalLM(config_object(config))
    skeleton.config.dtype = str(dtype).split(".")[1]
    skeleton.config.architectures = [type(skeleton).__name__]
    custom_object_save(skeleton, folder, config=skeleton.config)
    skeleton.config.save_pretrained(folder)


def _write_report(folder: Path, report: CompressReport) -> None:
    (Path(folder) / REPORT_FILE).write_text(json.dumps(public_report(report.as_dict()), indent=2, default=str) + "\n")


def record_verification(folder: str | Path, report: CompressReport, options: CompressOptions, verification) -> None:
    """Put the verification's perplexities (original and compressed, the shared definition) into the
    report (``compression_report.json``) and the card of ``folder``, which the verification step then
    completes with its own figures."""
    from .card import write_card

    v = verification
    if v.perplexity_original is None or v.perplexity_converted is None:
        return
    report.perplexity = {"text": v.text, "tokens": v.ppl_tokens, "window": v.ppl_window, "stride": v.ppl_stride,
                         "original": v.perplexity_original, "compressed": v.perplexity_converted}
    folder = Path(folder)
    _write_report(folder, report)
    write_card(folder, report, options)
