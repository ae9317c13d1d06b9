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

The result is a ``keep`` map (matrix name → κ) for the plan.

SliceGPT with one global PCA allocates per-segment residual widths by the same knapsack (:func:`allocate_slice_for`):
all segments share one basis, so a segment narrower or wider than the one before is the same stream with
coordinates dropped or zero-padded, and no skip matrix is needed. Its groups are the embedding's segment and the
decoder layers (the two segments layer i writes, at one width); a group's choices are ``(width / d, params, error)``."""

from __future__ import annotations

import copy
import heapq

import numpy as np
import torch

from ...calibration import StatsRequest
from ...calibration import token_batches as batches
from ...solvers import structures as st
from .moments import collect_statistics
from .options import CompressOptions
from .pca import global_rotation
from .plan import MatrixPlan, check_family, final_gamma, in_policy, matrix_entries, params_at, structure_for
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


#: widths (fractions of the hidden size) at which the sliced layers are measured; full width is exact
MEASURED_WIDTHS = (0.15, 0.3, 0.45, 0.6, 0.7, 0.8, 0.9)


def slice_groups(n_layers: int) -> dict[str, tuple[int, ...]]:
    """Each group's segments: ``embed`` writes 0; layer ``i`` ``2i + 1`` (after attention) and ``2i + 2`` (MLP)."""
    return {"embed": (0,), **{f"layers.{i}": (2 * i + 1, 2 * i + 2) for i in range(n_layers)}}


def build_slice_groups(
    entries: list[MatrixPlan], n_layers: int, d: int, tied: bool, head_width: int, curves: Curves
) -> dict[str, Choices]:
    """Each group's choices at the multiples of ``d // 72`` (8 for 576) and ``d``, errors interpolated in the
    width from ``curves``. Parameters are linear in the width: per segment, the columns of the matrices that
    read it, the rows (and bias) of those that write it, and a tied head's mix ``[w_0, w_2L]`` charged to the
    final segment at ``head_width`` for ``w_0`` (the total is checked exactly afterwards)."""
    slope = dict.fromkeys(range(2 * n_layers + 1), 0)
    for e in entries:
        slope[e.segment] += params_at([e], lambda _: 1) - params_at([e], lambda _: 0)
    if tied:
        slope[2 * n_layers] += head_width
    step = max(1, d // 72)
    grid = sorted(set(range(step, d, step)) | {d})
    groups = {}
    for name, segs in slice_groups(n_layers).items():
        unit = sum(slope[k] for k in segs)
        # full width loses nothing; no width below the narrowest measured one is offered, and the
        # error is made non-increasing in the width (a wider slice contains the narrower one)
        xs, ys = zip(*sorted(curves[name] + [(1.0, 0.0)]))
        ys = np.maximum.accumulate(np.asarray(ys)[::-1])[::-1]
        groups[name] = [(w / d, unit * w, float(np.interp(w / d, xs, ys))) for w in grid if w / d >= xs[0]]
    return groups


def _first_output(out, f):
    return (f(out[0]), *out[1:]) if isinstance(out, tuple) else f(out)


def _sliced_layer(module: torch.nn.Module, adapter, P: torch.Tensor) -> torch.nn.Module:
    """A copy of decoder layer ``module`` as SliceGPT with one global basis computes it when the two segments
    it writes are ``w`` wide: the stream after its attention, ``x + a``, and after its MLP are projected onto
    the first ``w`` principal directions (``P``, original basis; the MLP's norm sees ``‖P(x + a)‖`` as the
    sliced model's does). Its input ``x`` is left as it comes (the previous group's width)."""
    new, x = copy.deepcopy(module), []

    def keep_input(_module, args, kwargs):
        x[:] = [args[0] if args else kwargs["hidden_states"]]

    def attention(_module, _args, out):  # the layer adds x back: x + a -> P(x + a)
        return _first_output(out, lambda a: (x[0] + a) @ P - x[0])

    new.register_forward_pre_hook(keep_input, with_kwargs=True)
    new.get_submodule(adapter.spec.attention.o.rsplit(".", 1)[0]).register_forward_hook(attention)
    new.register_forward_hook(lambda _module, _args, out: _first_output(out, lambda y: y @ P))
    return new


def measure_slice_sensitivity(calib: CompressRun, adapter, Q: torch.Tensor, stream: list, tied: bool) -> Curves:
    """Per group: ``[(width / d, relative error)]`` at :data:`MEASURED_WIDTHS`. A decoder layer's is
    ``Σ‖ŷ − y‖² / Σ‖y‖²``, ``ŷ`` the layer with the segments it writes sliced (relative to the stream, which
    the next layers read normalised); the embedding's, the share ``tr((I − P) C₀) / tr C₀`` of its output's
    energy outside the kept directions (``C`` the stream's second moments), plus for a tied head (reading the
    embedding at its width) the logits' ``h γ (I − P) Eᵀ`` relative error over the final stream ``h`` (the
    norm's per-token scale left out), ``tr(B₂₂ A₂₂) / tr(B A)`` with ``B = Qᵀ EᵀE Q``, ``A = Qᵀ γ C γ Q``.

    Measured on SmolLM2 (BENCHMARKS.md), neither this nor the structured classes' normalisation (the
    layer's residual update) gives widths that beat one uniform width: a direction dropped at one
    segment is gone from every later one, which no layer-local error sees."""
    d = Q.shape[0]
    widths = [max(1, round(f * d)) for f in MEASURED_WIDTHS]

    def variants(step):
        engine = step.run.engine
        for w in widths:
            P = (Q[:, :w] @ Q[:, :w].T).to(device=engine.device, dtype=engine.dtype)
            yield w / d, _sliced_layer(step.module, adapter, P)

    curves = layer_sensitivity(
        calib, StatsRequest(grams=("layer_out",)), lambda s: trace_of(s.grams["layer_out"]), variants
    )
    C = Q.T @ stream[0].to(Q) @ Q  # the moments of the embedding's output, in the principal basis
    curves["embed"] = [(w / d, float(C.diagonal()[w:].sum()) / max(trace_of(C), 1e-300)) for w in widths]
    if tied:
        key = f"{adapter.prefix}{adapter.spec.embed}.weight"
        E = calib.source.get([key])[key].to(torch.float64) @ Q
        B = E.T @ E
        del E
        gamma = final_gamma(calib.source, adapter).to(Q)
        A_ = Q.T @ (gamma[:, None] * stream[-1].to(Q) * gamma[None, :]) @ Q
        total = float((B * A_).sum())
        head = [float((B[w:, w:] * A_[w:, w:]).sum()) / max(total, 1e-300) for w in widths]
        curves["embed"] = [(x, e + h) for (x, e), h in zip(curves["embed"], head)]
    return curves


def _exact_slice_total(widths: list[int], entries: list[MatrixPlan], tied: bool) -> int:
    """Parameters at per-segment ``widths``: the matrices' and the tied head's mix ``[w_0, w_2L]``."""
    return params_at(entries, widths.__getitem__) + (widths[0] * widths[-1] if tied else 0)


def allocate_slice(
    entries: list[MatrixPlan], n_layers: int, d: int, tied: bool, target: int, curves: Curves, head_width: int
) -> tuple[list[int], dict[str, tuple[float, int, float]]]:
    """Per-segment widths minimising the summed errors with the model at most ``target`` parameters, and each
    group's choice. A tied head's mix ``[w_0, w_2L]`` couples two groups, so the knapsack is repeated with the
    first width it chose (``head_width`` to start) until that width settles. Then, on the exact total: while
    over, the group whose next narrower width costs the least error per parameter is narrowed; while one
    fits, the next wider width of a group that lowers the error most per parameter is taken."""
    segments = slice_groups(n_layers)

    def widths_of(chosen):  # chosen: a choice of ``groups`` per group
        out = [0] * (2 * n_layers + 1)
        for name, i in chosen.items():
            for k in segments[name]:
                out[k] = round(groups[name][i][0] * d)
        return out

    def total_of(chosen):
        return _exact_slice_total(widths_of(chosen), entries, tied)

    def narrowing_cost(name):  # error added per parameter saved
        (_, pa, ea), (_, pb, eb) = groups[name][chosen[name] - 1], groups[name][chosen[name]]
        return (ea - eb) / max(pb - pa, 1)

    constant = params_at(entries, lambda _: 0)  # what does not depend on the widths: the readers' biases
    for _ in range(5):
        groups = build_slice_groups(entries, n_layers, d, tied, head_width, curves)
        chosen = allocate(groups, target - constant)
        if not tied or widths_of(chosen)[0] == head_width:
            break
        head_width = widths_of(chosen)[0]
    while total_of(chosen) > target:
        narrower = [name for name, i in chosen.items() if i > 0]
        if not narrower:
            raise ValueError(f"the parameter budget {target:,} is below the narrowest SliceGPT widths")
        chosen[min(narrower, key=narrowing_cost)] -= 1  # the first of equal costs
    chosen = fill(groups, chosen, target, total_of, first_fit=True)
    return widths_of(chosen), {name: groups[name][i] for name, i in chosen.items()}


def allocate_slice_for(run: CompressRun):
    """``(keep map, report)``: the global rotation from ``run.stats`` (one-pass stream moments, as the solve
    takes it), each group's sensitivity measured at several widths, then per-segment widths at the total of
    the uniform plan ``run.plan`` (``keep``: ``segment{k}`` → width / d)."""
    stats, uniform = run.stats, run.plan
    adapter = check_family(run.config, run.source.keys())
    entries = matrix_entries(run.config, run.source.keys(), adapter)
    if stats is None or stats.stream is None:
        stats = collect_statistics(run, want_normed=False, want_stream=True)
    Q = global_rotation(stats)
    d = adapter.hidden
    curves = measure_slice_sensitivity(run, adapter, Q, stats.stream, uniform.tied)
    target = uniform.accounting.target_params
    widths, chosen = allocate_slice(entries, adapter.n_layers, d, uniform.tied, target, curves, uniform.residual)
    keep = {f"segment{k}": w / d for k, w in enumerate(widths)}
    return keep, {
        "budget": target,
        "allocated": _exact_slice_total(widths, entries, uniform.tied),
        "uniform_width": uniform.residual,
        "widths": widths,
        "groups": {
            name: {"keep": k, "width": round(k * d), "params": p, "error": e} for name, (k, p, e) in chosen.items()
        },
        "sensitivity": curves,
    }
