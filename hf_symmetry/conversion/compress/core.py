"""The pipeline on tensors (:func:`compress_into`): plan, calibration, solve, assembly, written by an
:class:`Output` (the compressed family; the RMS-decoder family for a LayerNorm decoder's centred model)."""

from __future__ import annotations

import time
from dataclasses import replace


from ...solvers.linalg import limit_threads
from ..layer_map import LayerMap
from .allocate import allocate_for, allocate_slice_for
from .assemble import Assembler, compressed_config
from .folded import read_folded
from .moments import one_pass_statistics
from .pca import sequential_stream_pca
from .plan import Plan, check_family, plan_for
from .report import CompressReport, summarise_traces
from .routes import CompressRun
from .solve import Kept, solve


class Output:
    """What :func:`compress_into` reads and writes, here for the compressed family. ``streams``: each part is
    written as soon as its segments are solved (else all at the end)."""

    streams = True

    def read(self, run: CompressRun, plan: Plan):
        """(layers, globals, the final norm's γ), norms folded, read as they are used."""
        keys = run.source.keys()
        adapter = check_family(run.config, keys)
        # the solvers walk the segments in order, two layers at a time; sequential calibration holds its own
        # copy of the layer it runs and SliceGPT's PCA reads no weights, so one is kept
        one = run.options.slicing or run.options.sequential
        return read_folded(run.source, adapter, keys, plan.tied, lazy=True, keep=1 if one else 2)

    def config(self, run: CompressRun, plan: Plan) -> dict:
        return compressed_config(run.config, plan, run.options, run.hf_config)

    def finish(self, run: CompressRun, res: Kept, globals_) -> None:
        """Write what the plan's modules do not hold (nothing here)."""

    def method(self, run: CompressRun) -> str:
        return run.options.label


def compress_into(run: CompressRun, output: Output = Output()) -> tuple[dict, CompressReport, LayerMap | None]:
    """The whole pipeline on tensors, written by ``output`` into ``run.sink`` layer by layer as it is
    assembled: (config dict, report, the layer map where every layer maps to the source, else None)."""
    times = {}
    t0 = time.perf_counter()
    source, config, options = run.source, run.config, run.options
    if run.plan is None:
        run = replace(run, plan=plan_for(source, config, options)[0])
    if run.stats is None:  # measured as the solver reaches each segment where that is enough
        run = replace(run, stats=one_pass_statistics(run, on_demand=True))
    times["calibration"] = time.perf_counter() - t0
    if options.allocation == "sensitivity" and run.plan.accounting.allocation != "sensitivity":
        t = time.perf_counter()
        run = replace(run, plan=_allocated_plan(run))
        times["allocation"] = time.perf_counter() - t
    t1 = time.perf_counter()
    plan = run.plan
    layers, globals_, gamma = output.read(run, plan)
    assembler = Assembler(plan, layers, globals_, gamma, run.dtype, run.sink)
    new_config = output.config(run, plan)
    if options.solver == "pca-sequential":
        rotations, stats = sequential_stream_pca(run, plan.residual)
        run = replace(run, rotations=rotations, stats=stats)
    elif options.sequential:
        run.require_calibration()  # before any solve

    kept = Kept(run.dtype, assembler.segment_done, keep_stats=False) if output.streams else Kept(keep_stats=False)
    with limit_threads(1):
        res = solve(run, layers, globals_, kept)
    times["solve"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    assembler.finish(res, run.progress)
    output.finish(run, res, globals_)
    times["assemble"] = time.perf_counter() - t2
    layer_map = assembler.layer_map.map if assembler.layer_map.complete() else None  # heal's layer targets
    report = CompressReport(
        source="",
        output=None,
        family=plan.family,
        options=options.as_dict(run.calibration),
        accounting=plan.accounting,
        relative_errors=res.relative_errors,
        objective=summarise_traces(res.traces),
        calibration_tokens=run.stats.tokens if run.stats else 0,
        seconds=times,
        method=output.method(run),
    )
    return new_config, report, layer_map


def _allocated_plan(run: CompressRun) -> Plan:
    """``--allocation sensitivity``: the plan at the sizes allocated per layer (SliceGPT: per segment)."""
    if run.options.slicing:
        keep, allocation = allocate_slice_for(run)
    else:
        keep, allocation = allocate_for(run)
    plan, _ = plan_for(run.source, run.config, run.options, keep=keep)
    plan.accounting.allocation_report = allocation
    return plan
