"""Non-uniform allocation: at a fixed total parameter count, each layer's size from its measured
sensitivity.

1. **Sensitivity** (:func:`measure_sensitivity`): for every decoder layer and several sizes ``κ`` (the
   fraction of its compressed matrices' parameters kept), the layer's matrices are projected onto
   the structure at that size and the layer is run on its calibration inputs (the layer-wise engine,
   one layer in memory): the error is the squared output error relative to the layer's residual
   update, ``‖ŷ − y‖² / ‖y − x‖²`` summed over calibration tokens. The embedding (and an untied head)
   count as groups of their own, with the token-weighted relative error of their rows.
2. **Allocation** (:func:`allocate`): a multiple-choice knapsack over the groups — minimise the sum of
   the groups' errors subject to the total parameter budget of the uniform plan at the same ratio —
   solved greedily on each group's lower convex hull of (parameters, error), then filled with the
   best single upgrades that still fit. Every group may also stay dense (κ = 1, error 0): the
   allocator keeps a layer dense only when that is worth its parameters, by the same rule.

The result is a ``keep`` map (matrix name → κ) for :func:`..plan.plan_compression`; the compressed
family's config carries each layer's structures, so the folder loads like any other.

SliceGPT widths: :mod:`.allocate_widths`."""

from __future__ import annotations

import copy
import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from ...calibration import CalibrationEngine, StatsRequest
from ...calibration import token_batches as batches
from ...solvers import structures as st
from .options import LAYER_MODULES, CompressOptions
from .plan import MatrixPlan, check_family, in_policy, matrix_entries, shared_factor, structure_for
from .routes import CompressRun

#: sizes at which sensitivity is measured, and the finer grid the allocator chooses from
MEASURED = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)
GRID = tuple(round(0.05 + 0.01 * i, 2) for i in range(95)) + (1.0,)
BUDGET_TOLERANCE = 1e-3  # of the model's total parameters


@dataclass
class Choice:
    keep: float
    params: int
    error: float


@dataclass
class Group:
    """Matrices sized together (one decoder layer's, or the embedding): their choices, cheapest first."""

    name: str
    matrices: list[str]
    choices: list[Choice] = field(default_factory=list)


def group_entries(entries: list[MatrixPlan], options: CompressOptions) -> dict[str, list[MatrixPlan]]:
    """The compressed matrices by group: ``layers.i`` per decoder layer, ``embed``, ``lm_head``."""
    groups: dict[str, list[MatrixPlan]] = {}
    for e in entries:
        if in_policy(e.canon, options):
            groups.setdefault(e.name if e.layer is None else f"layers.{e.layer}", []).append(e)
    return groups


def _structures(es: list[MatrixPlan], options: CompressOptions, kron_q: int | None, keep: float) -> list[st.Structure]:
    return [structure_for(options, e.name, *e.shape, keep, kron_q, e.canon in ("embed", "lm_head")) for e in es]


def build_groups(
    entries: list[MatrixPlan],
    options: CompressOptions,
    kron_q: int | None,
    curves: dict[str, list[tuple[float, float]]],
) -> list[Group]:
    """Each group's choices on :data:`GRID`: exact parameter counts, and the error interpolated (in the
    fraction of parameters actually kept) from the measured ``curves`` (group → [(fraction, error)],
    dense is error 0)."""
    groups = []
    for name, es in group_entries(entries, options).items():
        dense = sum(e.shape[0] * e.shape[1] for e in es)
        xs, ys = zip(*sorted(curves[name] + [(1.0, 0.0)]))
        seen: dict[int, Choice] = {}
        for keep in GRID:
            params = sum(s.params() for s in _structures(es, options, kron_q, keep))
            if params not in seen:
                err = float(np.interp(params / dense, xs, ys))
                seen[params] = Choice(keep, params, err)
        groups.append(Group(name, [e.name for e in es], sorted(seen.values(), key=lambda c: c.params)))
    return groups


def _hull(choices: list[Choice]) -> list[int]:
    """Indices of the lower convex hull of (params, error), cheapest first, error decreasing."""
    hull: list[int] = []
    for i, c in enumerate(choices):
        if hull and c.error >= choices[hull[-1]].error:
            continue
        while len(hull) >= 2:
            a, b = choices[hull[-2]], choices[hull[-1]]
            # b is above the segment a -> c: drop it (points on the segment stay: finer steps)
            if (b.error - a.error) * (c.params - a.params) > (c.error - a.error) * (b.params - a.params) + 1e-12 * (
                abs(a.error) + abs(c.error)
            ) * (c.params - a.params):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def allocate(groups: list[Group], budget: int) -> dict[str, Choice]:
    """The choice per group minimising the summed error with at most ``budget`` parameters in all."""
    cur = {g.name: 0 for g in groups}
    total = sum(g.choices[0].params for g in groups)
    if total > budget:
        raise ValueError(f"the parameter budget {budget:,} is below the smallest allocation ({total:,})")
    by_name = {g.name: g for g in groups}
    hulls = {g.name: _hull(g.choices) for g in groups}
    pos = {g.name: 0 for g in groups}  # position on the hull
    heap = []

    def push(name):
        h, p = hulls[name], pos[name]
        if p + 1 < len(h):
            a, b = by_name[name].choices[h[p]], by_name[name].choices[h[p + 1]]
            # ties (piecewise linear curves): the group holding the fewest parameters goes first
            eff = (a.error - b.error) / max(b.params - a.params, 1)
            heapq.heappush(heap, (-float(f"{eff:.6g}"), a.params, name))

    for g in groups:
        push(g.name)
    while heap:
        *_, name = heapq.heappop(heap)
        g, h, p = by_name[name], hulls[name], pos[name]
        step = g.choices[h[p + 1]].params - g.choices[h[p]].params
        if total + step > budget:
            continue  # this group cannot afford its next hull point
        total += step
        pos[name] = p + 1
        cur[name] = h[p + 1]
        push(name)
    # fill what is left with the single upgrades (off the hull too) that reduce the error most per parameter
    while True:
        best = None
        for g in groups:
            c = g.choices[cur[g.name]]
            for j in range(cur[g.name] + 1, len(g.choices)):
                o = g.choices[j]
                if total - c.params + o.params <= budget and o.error < c.error:
                    gain = (c.error - o.error) / (o.params - c.params)
                    if best is None or gain > best[0]:
                        best = (gain, g.name, j, o.params - c.params)
        if best is None:
            break
        _, name, j, dp = best
        cur[name], total = j, total + dp
    return {g.name: g.choices[cur[g.name]] for g in groups}


def keep_map(groups: list[Group], chosen: dict[str, Choice]) -> dict[str, float]:
    return {m: chosen[g.name].keep for g in groups for m in g.matrices}


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
def _projected(M: torch.Tensor, s: st.Structure) -> torch.Tensor:
    return s.dense(s.project(M.to(torch.float64))).to(M.dtype)


def _compressed_layer(module: torch.nn.Module, es: list[MatrixPlan], options, kron_q, keep, adapter) -> torch.nn.Module:
    new = copy.deepcopy(module)
    with torch.no_grad():
        for e, s in zip(es, _structures(es, options, kron_q, keep)):
            path = LAYER_MODULES[e.canon][0]
            lin = new.get_submodule(adapter_path(adapter, path))
            W = lin.weight
            M = W if e.role == "reader" else W.T
            Mh = _projected(M, s)
            W.copy_(Mh if e.role == "reader" else Mh.T)
    return new


def adapter_path(adapter, canonical_path: str) -> str:
    """The module path inside a decoder layer of ``self_attn.q_proj`` etc. for this family."""
    a, f = adapter.spec.attention, adapter.spec.ffn
    part, proj = canonical_path.split(".")
    table = {
        "q_proj": a.q,
        "k_proj": a.k,
        "v_proj": a.v,
        "o_proj": a.o,
        "gate_proj": f.gate,
        "up_proj": f.up,
        "down_proj": f.down,
    }
    return table[proj]


def trace_of(t: torch.Tensor) -> float:
    """The trace of a square matrix, as a Python float."""
    return float(t.diagonal().sum())


def output_error(step, module: torch.nn.Module) -> float:
    """``Σ‖ŷ − y‖²`` over the calibration tokens of an engine step (:meth:`...calibration.CalibrationEngine.collect`
    with ``layer_out`` Grams): ``ŷ`` the changed layer ``module`` on the original layer's inputs, ``y`` its
    outputs."""
    got = step.collect(StatsRequest(grams=("layer_out",), cross=(("layer_out", "layer_out"),)), module=module)
    return (
        trace_of(got.grams["layer_out"])
        - 2 * trace_of(got.cross[("layer_out", "layer_out")])
        + trace_of(step.stats.grams["layer_out"])
    )


def measure_sensitivity(
    calib: CompressRun,
    adapter,
    entries: list[MatrixPlan],
    options: CompressOptions,
    token_counts: torch.Tensor | None = None,
    progress: bool = True,
    kron_q: int | None = None,
) -> dict[str, list[tuple[float, float]]]:
    """Per group: ``[(fraction of parameters kept, relative output error)]`` at the sizes of
    :data:`MEASURED` (see the module docstring), on ``calib`` (source, config, token ids, batch length,
    placement)."""
    source, config, ids, placement = calib.source, calib.config, calib.ids, calib.placement
    groups = group_entries(entries, options)
    if kron_q is None:
        kron_q = shared_factor(options, entries[0].shape[1], 1 - options.ratio)
    curves: dict[str, list[tuple[float, float]]] = {}
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)

    def on_layer(step):
        name = f"layers.{step.index}"
        es = groups.get(name)
        if not es:
            return None
        s = step.stats
        update = (
            trace_of(s.grams["layer_out"])
            - 2 * trace_of(s.joint[("layer_in", "layer_out")])
            + trace_of(s.grams["layer_in"])
        )
        dense = sum(e.shape[0] * e.shape[1] for e in es)
        curve = []
        for keep in MEASURED:
            params = sum(x.params() for x in _structures(es, options, kron_q, keep))
            err = output_error(step, _compressed_layer(step.module, es, options, kron_q, keep, adapter))
            curve.append((params / dense, max(err, 0.0) / max(update, 1e-300)))
        curves[name] = curve
        return None

    engine.collect(
        batches(ids, calib.seq_len),
        StatsRequest(grams=("layer_in", "layer_out"), joint=(("layer_in", "layer_out"),)),
        on_layer=on_layer,
        carry_original=True,
    )
    # embedding / untied head: token-weighted relative error of their rows
    weights = None if token_counts is None else token_counts.to(torch.float64) + 1.0
    for name in ("embed", "lm_head"):
        es = groups.get(name)
        if not es:
            continue
        key = f"{adapter.prefix}{adapter.spec.embed}.weight" if name == "embed" else f"{adapter.spec.lm_head}.weight"
        E = source.get([key])[key].to(torch.float64)
        w = torch.ones(E.shape[0], dtype=torch.float64) if weights is None else weights[: E.shape[0]]
        energy = float((w[:, None] * E.pow(2)).sum())
        curve = []
        for keep in MEASURED:
            s = _structures(es, options, kron_q, keep)[0]
            D = E - s.dense(s.project(E))
            curve.append((s.params() / E.numel(), float((w[:, None] * D.pow(2)).sum()) / max(energy, 1e-300)))
        curves[name] = curve
        del E
    return curves


def budget_of(uniform) -> int:
    """Parameters the compressed matrices may have so that the model meets the ratio's target total:
    the uniform plan's structured parameters, corrected by its rounding."""
    acc = uniform.accounting
    return acc.structured_params_of_compressed_matrices + acc.target_params - acc.compressed_model_params


def allocate_for(run, token_counts: torch.Tensor | None = None):
    """``(keep map, report)``: measure each group's sensitivity on ``run``'s calibration (a
    :class:`.routes.CompressRun`) and allocate the budget of its uniform plan ``run.plan`` (same ratio, same
    rotations and skips) between the groups (SliceGPT's widths: :func:`.allocate_widths.allocate_slice_for`)."""
    calib, options, uniform = run, run.options, run.plan
    adapter = check_family(calib.config, calib.source.keys())
    entries = matrix_entries(calib.config, calib.source.keys(), adapter)
    kron_q = uniform.accounting.kron_factor
    curves = measure_sensitivity(calib, adapter, entries, options, token_counts, run.progress, kron_q)
    budget = budget_of(uniform)
    groups = build_groups(entries, options, kron_q, curves)
    chosen = allocate(groups, budget)
    report = {
        "budget": budget,
        "allocated": sum(c.params for c in chosen.values()),
        "groups": {n: {"keep": c.keep, "params": c.params, "error": c.error} for n, c in chosen.items()},
        "sensitivity": curves,
    }
    return keep_map(groups, chosen), report
