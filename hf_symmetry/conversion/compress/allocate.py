"""Non-uniform allocation: at a fixed total parameter count, each layer's size from its measured sensitivity.

1. **Sensitivity**: for each decoder layer and several sizes ``κ`` (the fraction of its compressed matrices'
   parameters kept), the layer with its matrices projected onto the structure at that size is run on its
   calibration inputs (the layer-wise engine, one layer in memory): its error is ``Σ‖ŷ − y‖² / Σ‖y − x‖²``
   over the calibration tokens, relative to the layer's residual update. The embedding (and an untied
   head) are groups of their own, with the token-weighted relative error of their rows.
2. **Allocation**: a multiple-choice knapsack over the groups' choices ``(keep, params, error)`` — minimise
   the summed error within the parameter budget of the uniform plan at the same ratio — solved greedily on
   each group's lower convex hull of (params, error), then filled with the best single upgrades that still
   fit. Dense (κ = 1, error 0) is one of the choices: a layer stays dense only where that is worth its
   parameters.

The result is a ``keep`` map (matrix name → κ) for the plan. SliceGPT's widths: :mod:`.allocate_widths`."""

from __future__ import annotations

import copy
import heapq

import numpy as np
import torch

from ...calibration import StatsRequest
from ...calibration import token_batches as batches
from ...solvers import structures as st
from .options import CompressOptions
from .plan import MatrixPlan, check_family, in_policy, matrix_entries, structure_for
from .routes import CompressRun

#: sizes at which sensitivity is measured, and the finer grid the allocator chooses from
MEASURED = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)
GRID = tuple(round(0.05 + 0.01 * i, 2) for i in range(95)) + (1.0,)

Choices = list[tuple[float, int, float]]  # a group's (keep, params, error), cheapest first
Curves = dict[str, list[tuple[float, float]]]  # per group, the measured (size, relative error)
Members = dict[str, list[MatrixPlan]]  # per group, its compressed matrices


def group_entries(entries: list[MatrixPlan], options: CompressOptions) -> Members:
    """The compressed matrices by group: ``layers.i`` per decoder layer, ``embed``, ``lm_head``."""
    members: Members = {}
    for e in entries:
        if in_policy(e.canon, options):
            members.setdefault(e.name if e.layer is None else f"layers.{e.layer}", []).append(e)
    return members


def _structures(es: list[MatrixPlan], options: CompressOptions, kron_q: int | None, keep: float) -> list[st.Structure]:
    return [structure_for(options, e, keep, kron_q) for e in es]


def build_groups(members: Members, options: CompressOptions, kron_q: int | None, curves: Curves) -> dict[str, Choices]:
    """Each group's choices on :data:`GRID`: exact parameter counts, and the error interpolated (in the
    fraction of parameters actually kept) from the measured ``curves`` (dense: error 0)."""
    groups: dict[str, Choices] = {}
    for name, es in members.items():
        dense = sum(e.shape[0] * e.shape[1] for e in es)
        xs, ys = zip(*sorted(curves[name] + [(1.0, 0.0)]))
        seen = {}
        for keep in GRID:
            params = sum(s.params() for s in _structures(es, options, kron_q, keep))
            if params not in seen:
                seen[params] = (keep, params, float(np.interp(params / dense, xs, ys)))
        groups[name] = [seen[p] for p in sorted(seen)]
    return groups


def _hull(choices: Choices) -> list[int]:
    """Indices of the lower convex hull of (params, error), cheapest first, error decreasing."""
    hull: list[int] = []
    for i, (_, p, e) in enumerate(choices):
        if hull and e >= choices[hull[-1]][2]:
            continue
        while len(hull) >= 2:
            (_, pa, ea), (_, pb, eb) = choices[hull[-2]], choices[hull[-1]]
            if (eb - ea) * (p - pa) <= (e - ea) * (pb - pa) + 1e-12 * (abs(ea) + abs(e)) * (p - pa):
                break  # b is not above the segment a -> c (points on it stay: finer steps)
            hull.pop()
        hull.append(i)
    return hull


def allocate(groups: dict[str, Choices], budget: int) -> dict[str, int]:
    """The choice (its index) per group minimising the summed error with at most ``budget`` parameters in all."""
    total = sum(choices[0][1] for choices in groups.values())
    if total > budget:
        raise ValueError(f"the parameter budget {budget:,} is below the smallest allocation ({total:,})")
    hulls = {name: _hull(choices) for name, choices in groups.items()}
    pos = dict.fromkeys(groups, 0)  # position on the hull
    heap = []

    def push(name):
        h, p = hulls[name], pos[name]
        if p + 1 < len(h):
            (_, pa, ea), (_, pb, eb) = groups[name][h[p]], groups[name][h[p + 1]]
            # ties (piecewise linear curves): the group holding the fewest parameters goes first
            heapq.heappush(heap, (-float(f"{(ea - eb) / max(pb - pa, 1):.6g}"), pa, name, pb - pa))

    for name in groups:
        push(name)
    while heap:
        *_, name, step = heapq.heappop(heap)
        if total + step <= budget:  # else this group cannot afford its next hull point
            total += step
            pos[name] += 1
            push(name)
    return fill(groups, {name: hulls[name][p] for name, p in pos.items()}, budget)


def fill(
    groups: dict[str, Choices], chosen: dict[str, int], budget: int, total_of=None, first_fit: bool = False
) -> dict[str, int]:
    """While one fits, take the single upgrade (off the hull too) lowering the error most per parameter
    (``total_of``: the parameters at a choice per group, by default the sum of the choices'); with ``first_fit``,
    only each group's first that fits."""
    total_of = total_of or (lambda c: sum(groups[name][i][1] for name, i in c.items()))
    while True:
        total, upgrades = total_of(chosen), []
        for name, choices in groups.items():
            error = choices[chosen[name]][2]
            lower = [j for j in range(chosen[name] + 1, len(choices)) if choices[j][2] < error]
            for j in lower:
                extra = total_of({**chosen, name: j}) - total
                if total + extra <= budget:
                    upgrades.append(((error - choices[j][2]) / max(extra, 1), name, j))
                    if first_fit:
                        break
        if not upgrades:
            return chosen
        _, name, j = max(upgrades, key=lambda u: u[0])  # the first of equal gains
        chosen[name] = j


def trace_of(t: torch.Tensor) -> float:
    return float(t.diagonal().sum())


def _distance(a: torch.Tensor, ab: torch.Tensor, b: torch.Tensor) -> float:
    """``Σ‖a − b‖²`` over the tokens from the Grams ``Σaᵀa``, ``Σaᵀb``, ``Σbᵀb``."""
    return trace_of(a) - 2 * trace_of(ab) + trace_of(b)


def layer_sensitivity(calib: CompressRun, request: StatsRequest, reference, variants) -> Curves:
    """Per decoder layer ``layers.i``: ``[(x, Σ‖ŷ − y‖² / reference(step.stats))]`` for each ``(x, changed
    layer)`` that ``variants(step)`` yields (none: the layer is not measured); ``request`` holds what
    ``reference`` reads, ``layer_out`` among it."""
    curves: Curves = {}
    changed = StatsRequest(grams=("layer_out",), cross=(("layer_out", "layer_out"),))

    def on_layer(step):
        norm, y, curve = max(reference(step.stats), 1e-300), step.stats.grams["layer_out"], []
        for x, module in variants(step):
            got = step.collect(changed, module=module)  # ŷ on the original layer's inputs; y: its outputs
            error = _distance(got.grams["layer_out"], got.cross[("layer_out", "layer_out")], y)
            curve.append((x, max(error, 0.0) / norm))
        if curve:
            curves[f"layers.{step.index}"] = curve

    engine = calib.engine()
    engine.collect(batches(calib.ids, calib.seq_len), request, on_layer=on_layer, carry_original=True)
    return curves


def _compressed_layer(module: torch.nn.Module, es: list[MatrixPlan], structures, adapter) -> torch.nn.Module:
    """A copy of decoder layer ``module`` with its matrices ``es`` projected onto their ``structures``."""
    new, spec = copy.deepcopy(module), adapter.spec
    with torch.no_grad():
        for e, s in zip(es, structures):
            W = new.get_submodule(getattr(spec.ffn if e.canon in ("gate", "up", "down") else spec.attention, e.canon))
            M = W.weight if e.role == "reader" else W.weight.T
            Mh = s.dense(s.project(M.to(torch.float64))).to(M.dtype)
            W.weight.copy_(Mh if e.role == "reader" else Mh.T)
    return new


def measure_sensitivity(calib: CompressRun, adapter, members: Members, kron_q: int | None) -> Curves:
    """Per group: ``[(fraction of parameters kept, relative error)]`` at the sizes of :data:`MEASURED`
    (step 1 above; the embedding's rows weighted by their token counts + 1); ``kron_q``: the plan's Kronecker factor."""
    options = calib.options

    def update(s):  # Σ‖y − x‖²
        return _distance(s.grams["layer_out"], s.joint[("layer_in", "layer_out")], s.grams["layer_in"])

    def variants(step):
        es = members.get(f"layers.{step.index}")
        if not es:
            return
        dense = sum(e.shape[0] * e.shape[1] for e in es)
        for keep in MEASURED:
            structures = _structures(es, options, kron_q, keep)
            yield sum(s.params() for s in structures) / dense, _compressed_layer(step.module, es, structures, adapter)

    request = StatsRequest(grams=("layer_in", "layer_out"), joint=(("layer_in", "layer_out"),))
    curves = layer_sensitivity(calib, request, update, variants)
    counts = None if calib.stats is None else calib.stats.token_counts
    for name in [n for n in ("embed", "lm_head") if n in members]:
        key = f"{adapter.prefix}{adapter.spec.embed}.weight" if name == "embed" else f"{adapter.spec.lm_head}.weight"
        E = calib.source.get([key])[key].to(torch.float64)
        w = (torch.ones(len(E), dtype=torch.float64) if counts is None else counts[: len(E)].double() + 1)[:, None]
        energy = max(float((w * E.pow(2)).sum()), 1e-300)
        curve = []
        for keep in MEASURED:
            s = _structures(members[name], options, kron_q, keep)[0]
            curve.append((s.params() / E.numel(), float((w * (E - s.dense(s.project(E))).pow(2)).sum()) / energy))
        curves[name] = curve
        del E
    return curves


def budget_of(uniform) -> int:
    """Parameters the compressed matrices may have so that the model meets the ratio's target total:
    the uniform plan's structured parameters, corrected by its rounding."""
    acc = uniform.accounting
    return acc.structured_params_of_compressed_matrices + acc.target_params - acc.compressed_model_params


def allocate_for(run: CompressRun):
    """``(keep map, report)``: each group's sensitivity measured on ``run``'s calibration, then the budget of
    its uniform plan ``run.plan`` (same ratio, rotations and skips) allocated between the groups."""
    adapter = check_family(run.config, run.source.keys())
    entries = matrix_entries(run.config, run.source.keys(), adapter)
    members, kron_q = group_entries(entries, run.options), run.plan.accounting.kron_factor
    curves = measure_sensitivity(run, adapter, members, kron_q)
    budget = budget_of(run.plan)
    groups = build_groups(members, run.options, kron_q, curves)
    chosen = {name: groups[name][i] for name, i in allocate(groups, budget).items()}
    keep = {e.name: chosen[name][0] for name, es in members.items() for e in es}
    return keep, {
        "budget": budget,
        "allocated": sum(params for _, params, _ in chosen.values()),
        "groups": {name: {"keep": k, "params": p, "error": e} for name, (k, p, e) in chosen.items()},
        "sensitivity": curves,
    }
