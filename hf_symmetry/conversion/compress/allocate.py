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

SliceGPT with one global PCA (:func:`allocate_slice_for`) allocates residual *widths* the same way: all
segments share one basis, so a segment narrower or wider than the one before is the same stream with
coordinates dropped or zero-padded, and no skip matrix is needed. The groups are the embedding's
segment and the decoder layers (the two segments layer i writes, at one width); a layer's sensitivity
is its output error with those segments projected onto the first ``w`` principal directions."""

from __future__ import annotations

import copy
import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from ...symmetry import structured as st
from .options import CompressOptions
from .plan import Entry, choose_kron_factor, in_policy, structure_for

#: sizes at which sensitivity is measured, and the finer grid the allocator chooses from
MEASURED = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)
GRID = tuple(round(0.05 + 0.01 * i, 2) for i in range(95)) + (1.0,)
BUDGET_TOLERANCE = 1e-3        # of the model's total parameters


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


def group_entries(entries: list[Entry], options: CompressOptions) -> dict[str, list[Entry]]:
    """The compressed matrices by group: ``layers.i`` per decoder layer, ``embed``, ``lm_head``."""
    groups: dict[str, list[Entry]] = {}
    for e in entries:
        if in_policy(e.canon, options):
            groups.setdefault(e.name if e.layer is None else f"layers.{e.layer}", []).append(e)
    return groups


def _structures(es: list[Entry], options: CompressOptions, kron_q: int | None, keep: float) -> list[st.Structure]:
    return [structure_for(options.structure, e.name, *e.shape, keep, options, kron_q, e.canon in ("embed", "lm_head"))
            for e in es]


def kron_factor(entries: list[Entry], options: CompressOptions, kappa: float) -> int | None:
    d = entries[0].shape[1]
    return choose_kron_factor(d, kappa, options.kron_factor) if options.structure == "kron" else None


def build_groups(entries: list[Entry], options: CompressOptions, kron_q: int | None,
                 curves: dict[str, list[tuple[float, float]]]) -> list[Group]:
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
                    abs(a.error) + abs(c.error)) * (c.params - a.params):
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
    pos = {g.name: 0 for g in groups}       # position on the hull
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
            continue                        # this group cannot afford its next hull point
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


def _compressed_layer(module: torch.nn.Module, es: list[Entry], options, kron_q, keep, adapter) -> torch.nn.Module:
    from .options import LAYER_MODULES

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
    table = {"q_proj": a.q, "k_proj": a.k, "v_proj": a.v, "o_proj": a.o, "gate_proj": f.gate, "up_proj": f.up,
             "down_proj": f.down}
    return table[proj]


def _trace(t: torch.Tensor) -> float:
    return float(t.diagonal().sum())


def measure_sensitivity(source, config: dict, adapter, entries: list[Entry], options: CompressOptions,
                        ids: torch.Tensor, token_counts: torch.Tensor | None = None, placement=None,
                        progress: bool = True, kron_q: int | None = None) -> dict[str, list[tuple[float, float]]]:
    """Per group: ``[(fraction of parameters kept, relative output error)]`` at the sizes of
    :data:`MEASURED` (see the module docstring)."""
    from ...calibration import CalibrationEngine, StatsRequest
    from ...calibration import calibration_batches as batches

    groups = group_entries(entries, options)
    if options.structure == "kron" and kron_q is None:
        kron_q = kron_factor(entries, options, 1 - options.ratio)
    curves: dict[str, list[tuple[float, float]]] = {}
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    compressed_request = StatsRequest(grams=("layer_out",), cross=(("layer_out", "layer_out"),))

    def on_layer(step):
        name = f"layers.{step.index}"
        es = groups.get(name)
        if not es:
            return None
        s = step.stats
        update = _trace(s.grams["layer_out"]) - 2 * _trace(s.joint[("layer_in", "layer_out")]) + \
            _trace(s.grams["layer_in"])
        dense = sum(e.shape[0] * e.shape[1] for e in es)
        curve = []
        for keep in MEASURED:
            params = sum(x.params() for x in _structures(es, options, kron_q, keep))
            got = step.collect(compressed_request, module=_compressed_layer(step.module, es, options, kron_q, keep,
                                                                          adapter))
            err = _trace(got.grams["layer_out"]) - 2 * _trace(got.cross[("layer_out", "layer_out")]) + \
                _trace(s.grams["layer_out"])
            curve.append((params / dense, max(err, 0.0) / max(update, 1e-300)))
        curves[name] = curve
        return None

    engine.collect(batches(ids, options.calib_seq_len),
                   StatsRequest(grams=("layer_in", "layer_out"), joint=(("layer_in", "layer_out"),)),
                   on_layer=on_layer, carry_original=True)
    # embedding / untied head: token-weighted relative error of their rows
    weights = None if token_counts is None else token_counts.to(torch.float64) + 1.0
    for name in ("embed", "lm_head"):
        es = groups.get(name)
        if not es:
            continue
        key = (f"{adapter.prefix}{adapter.spec.embed}.weight" if name == "embed"
               else f"{adapter.spec.lm_head}.weight")
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
    return acc["structured_params_of_compressed_matrices"] + acc["target_params"] - acc["compressed_model_params"]


def allocate_for(source, config: dict, options: CompressOptions, uniform, ids: torch.Tensor,
                 token_counts: torch.Tensor | None = None, placement=None, progress: bool = True, stats=None):
    """``(keep map, report)``: measure each group's sensitivity and allocate the budget of the
    ``uniform`` plan (same ratio, same rotations and skips) between the groups. SliceGPT: per-segment
    widths (:func:`allocate_slice_for`; ``stats``: the one-pass stream moments, measured if absent)."""
    from .plan import check_family, matrix_entries

    if options.slicing:
        return allocate_slice_for(source, config, options, uniform, ids, stats, placement, progress)

    adapter = check_family(config, source.keys())
    entries = matrix_entries(config, source.keys(), adapter)
    kron_q = uniform.accounting.get("kron_factor")
    curves = measure_sensitivity(source, config, adapter, entries, options, ids, token_counts, placement, progress,
                                 kron_q)
    budget = budget_of(uniform)
    groups = build_groups(entries, options, kron_q, curves)
    chosen = allocate(groups, budget)
    report = {"budget": budget, "allocated": sum(c.params for c in chosen.values()),
              "groups": {n: {"keep": c.keep, "params": c.params, "error": c.error} for n, c in chosen.items()},
              "sensitivity": curves}
    return keep_map(groups, chosen), report


# ---------------------------------------------------------------------------------------------
# SliceGPT: per-segment residual widths
# ---------------------------------------------------------------------------------------------
#: widths (fractions of the hidden size) at which the sliced layers are measured; full width is exact
MEASURED_WIDTHS = (0.15, 0.3, 0.45, 0.6, 0.7, 0.8, 0.9)


def slice_groups(n_layers: int) -> dict[str, tuple[int, ...]]:
    """SliceGPT's groups: ``embed`` is the segment the embedding writes (0); decoder layer ``i`` writes
    segments ``2i + 1`` (after its attention) and ``2i + 2`` (after its MLP), at one width."""
    groups = {"embed": (0,)}
    groups.update({f"layers.{i}": (2 * i + 1, 2 * i + 2) for i in range(n_layers)})
    return groups


def width_grid(d: int) -> list[int]:
    """The widths the allocator chooses from: multiples of ``d // 72`` (8 for 576) and ``d`` itself."""
    step = max(1, d // 72)
    return sorted(set(range(step, d, step)) | {d})


def slice_params_per_width(entries: list[Entry], n_layers: int, tied: bool, head_width: int) -> dict[int, int]:
    """Parameters per unit of width of each residual segment: the columns of the matrices that read
    it, the rows (and bias) of those that write it; the tied head's mix ``[w_0, w_2L]`` is charged to
    the final segment at ``head_width`` for ``w_0`` (the allocation is checked exactly afterwards)."""
    per = {k: 0 for k in range(2 * n_layers + 1)}
    for e in entries:
        per[e.segment] += e.shape[0] + (1 if e.bias and e.role == "writer" else 0)
    if tied:
        per[2 * n_layers] += head_width
    return per


def slice_constant(entries: list[Entry]) -> int:
    """Parameters that do not depend on the widths (the readers' biases)."""
    return sum(e.shape[0] for e in entries if e.bias and e.role == "reader")


def build_slice_groups(entries: list[Entry], n_layers: int, d: int, tied: bool, head_width: int,
                       curves: dict[str, list[tuple[float, float]]]) -> list[Group]:
    """Each group's choices on :func:`width_grid` (``keep`` = width / d), exact parameters, errors
    interpolated in the width from the measured ``curves`` (full width: error 0)."""
    per = slice_params_per_width(entries, n_layers, tied, head_width)
    groups = []
    for name, segs in slice_groups(n_layers).items():
        unit = sum(per[k] for k in segs)
        # full width loses nothing; no width below the narrowest measured one is offered, and the
        # error is made non-increasing in the width (a wider slice contains the narrower one)
        xs, ys = zip(*sorted(curves[name] + [(1.0, 0.0)]))
        ys = np.maximum.accumulate(np.asarray(ys)[::-1])[::-1]
        choices = [Choice(w / d, unit * w, float(np.interp(w / d, xs, ys))) for w in width_grid(d) if w / d >= xs[0]]
        groups.append(Group(name, [f"segment{k}" for k in segs], choices))
    return groups


class _SlicedOutputs(torch.nn.Module):
    """A decoder layer as SliceGPT with one global basis computes it when the two segments it writes
    are ``w`` wide: the stream after its attention, ``x + a``, and after its MLP are projected onto the
    first ``w`` principal directions (``P``, original basis; the MLP's norm sees ``‖P(x + a)‖`` as the
    sliced model's does). Its input is left as it comes (the previous group's width)."""

    def __init__(self, layer: torch.nn.Module, attention: torch.nn.Module, P: torch.Tensor):
        super().__init__()
        self.layer, self.P, self._x = layer, P, None
        attention.register_forward_hook(self._project_attention)

    def _project_attention(self, _module, _args, out):
        a, *rest = out if isinstance(out, tuple) else (out,)
        a = (self._x + a) @ self.P - self._x                  # the layer adds x back: x + a -> P(x + a)
        return (a, *rest) if isinstance(out, tuple) else a

    def forward(self, hidden_states, *args, **kwargs):
        self._x = hidden_states
        try:
            out = self.layer(hidden_states, *args, **kwargs)
        finally:
            self._x = None
        if isinstance(out, tuple):
            return (out[0] @ self.P, *out[1:])
        return out @ self.P


def _sliced_layer(module: torch.nn.Module, adapter, P: torch.Tensor) -> torch.nn.Module:
    new = copy.deepcopy(module)
    part = adapter_path(adapter, "self_attn.o_proj").rsplit(".", 1)[0]    # the attention block
    return _SlicedOutputs(new, new.get_submodule(part), P)


def measure_slice_sensitivity(source, config: dict, adapter, Q: torch.Tensor, stream_first: torch.Tensor,
                              options: CompressOptions, ids: torch.Tensor, placement=None,
                              progress: bool = True) -> dict[str, list[tuple[float, float]]]:
    """Per group: ``[(width / d, relative output error)]`` at :data:`MEASURED_WIDTHS`. A decoder layer's
    error is ``Σ‖ŷ − y‖² / Σ‖y‖²`` over the calibration tokens, ``ŷ`` the layer run with the segments it
    writes sliced (:class:`_SlicedOutputs`) on the original layer's inputs — relative to the stream,
    which the next layers read normalised; the embedding's is the share of its output's energy outside
    the kept directions, ``tr((I − P) C₀) / tr C₀``.

    Measured on SmolLM2 (BENCHMARKS.md), neither this nor the structured classes' normalisation (the
    layer's residual update) gives widths that beat one uniform width: a direction dropped at one
    segment is gone from every later one, which no layer-local error sees."""
    from ...calibration import CalibrationEngine, StatsRequest
    from ...calibration import calibration_batches as batches

    d = Q.shape[0]
    widths = [max(1, round(f * d)) for f in MEASURED_WIDTHS]
    curves: dict[str, list[tuple[float, float]]] = {}
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    request = StatsRequest(grams=("layer_out",), cross=(("layer_out", "layer_out"),))
    projections = {w: (Q[:, :w] @ Q[:, :w].T).to(device=engine.device, dtype=engine.dtype) for w in widths}

    def on_layer(step):
        energy = _trace(step.stats.grams["layer_out"])
        curve = []
        for w in widths:
            got = step.collect(request, module=_sliced_layer(step.module, adapter, projections[w]))
            err = _trace(got.grams["layer_out"]) - 2 * _trace(got.cross[("layer_out", "layer_out")]) + energy
            curve.append((w / d, max(err, 0.0) / max(energy, 1e-300)))
        curves[f"layers.{step.index}"] = curve
        return None

    engine.collect(batches(ids, options.calib_seq_len), StatsRequest(grams=("layer_out",)), on_layer=on_layer,
                   carry_original=True)
    C = Q.T @ stream_first.to(Q) @ Q
    total = float(C.diagonal().sum())
    curves["embed"] = [(w / d, float(C.diagonal()[w:].sum()) / max(total, 1e-300)) for w in widths]
    return curves


def tied_head_curve(source, adapter, Q: torch.Tensor, stream_last: torch.Tensor) -> list[tuple[float, float]]:
    """A tied head reads the embedding matrix sliced to the first segment's width: the relative error
    of the logits ``h γ (I − P) Eᵀ`` over the calibration tokens' final stream ``h`` (its raw second
    moment, the norm's per-token scale left out), ``tr(B₂₂ A₂₂) / tr(B A)`` in the principal basis with
    ``B = Qᵀ EᵀE Q``, ``A = Qᵀ γ C γ Q``. Added to the embedding's group error."""
    from .plan import final_gamma

    key = f"{adapter.prefix}{adapter.spec.embed}.weight"
    E = source.get([key])[key].to(torch.float64) @ Q
    gamma = final_gamma(source, adapter).to(Q)
    A_ = Q.T @ (gamma[:, None] * stream_last.to(Q) * gamma[None, :]) @ Q
    B = E.T @ E
    del E
    total = float((B * A_).sum())
    d = Q.shape[0]
    widths = [max(1, round(f * d)) for f in MEASURED_WIDTHS]
    return [(w / d, float((B[w:, w:] * A_[w:, w:]).sum()) / max(total, 1e-300)) for w in widths]


def _exact_slice_total(widths: list[int], entries: list[Entry], n_layers: int, tied: bool) -> int:
    per = slice_params_per_width(entries, n_layers, tied, 0)
    head = widths[0] * widths[-1] if tied else 0
    return sum(per[k] * w for k, w in enumerate(widths)) + head + slice_constant(entries)


def allocate_slice(entries: list[Entry], n_layers: int, d: int, tied: bool, target: int,
                   curves: dict[str, list[tuple[float, float]]], head_width: int
                   ) -> tuple[list[int], dict[str, Choice], list[Group]]:
    """Per-segment widths minimising the summed errors with the model at most ``target`` parameters:
    the knapsack of :func:`allocate`. The tied head's mix ``[w_0, w_2L]`` couples two groups, so the
    knapsack is repeated with the first width it chose (``head_width`` to start) until that width
    settles; then the exact total is checked — while over, the group whose next narrower width costs
    the least error per parameter is narrowed; while an upgrade fits, the one that lowers the error
    most per parameter is taken."""
    constant = slice_constant(entries)
    n_seg = 2 * n_layers + 1

    def widths_of(groups, ch):
        out = [0] * n_seg
        for g in groups:
            for m in g.matrices:
                out[int(m[len("segment"):])] = round(ch[g.name].keep * d)
        return out

    for _ in range(5):
        groups = build_slice_groups(entries, n_layers, d, tied, head_width, curves)
        chosen = allocate(groups, target - constant)
        widths = widths_of(groups, chosen)
        if widths[0] == head_width or not tied:
            break
        head_width = widths[0]
    by_name = {g.name: g for g in groups}

    def index(name):
        return next(j for j, c in enumerate(by_name[name].choices) if c.keep == chosen[name].keep)

    while _exact_slice_total(widths, entries, n_layers, tied) > target:
        best = None
        for g in groups:
            i = index(g.name)
            if i == 0:
                continue
            a, b = g.choices[i - 1], g.choices[i]
            cost = (a.error - b.error) / max(b.params - a.params, 1)
            if best is None or cost < best[0]:
                best = (cost, g.name, a)
        if best is None:
            raise ValueError(f"the parameter budget {target:,} is below the narrowest SliceGPT widths")
        chosen[best[1]] = best[2]
        widths = widths_of(groups, chosen)
    while True:
        total, best = _exact_slice_total(widths, entries, n_layers, tied), None
        for g in groups:
            i = index(g.name)
            c = g.choices[i]
            for o in g.choices[i + 1:]:
                trial = dict(chosen, **{g.name: o})
                extra = _exact_slice_total(widths_of(groups, trial), entries, n_layers, tied) - total
                if o.error < c.error and total + extra <= target:
                    gain = (c.error - o.error) / max(extra, 1)
                    if best is None or gain > best[0]:
                        best = (gain, g.name, o)
                    break                       # the next wider width that fits is enough per group
        if best is None:
            break
        chosen[best[1]] = best[2]
        widths = widths_of(groups, chosen)
    return widths, chosen, groups


def allocate_slice_for(source, config: dict, options: CompressOptions, uniform, ids: torch.Tensor, stats,
                       placement=None, progress: bool = True):
    """``(keep map, report)`` for SliceGPT with one global PCA: the global rotation from ``stats``
    (one-pass stream moments, as the solve takes it), each group's sensitivity measured at several
    widths, then per-segment widths at the uniform plan's total (``keep``: ``segment{k}`` → width / d)."""
    from .calibration import collect_statistics, pca
    from .plan import check_family, matrix_entries

    adapter = check_family(config, source.keys())
    entries = matrix_entries(config, source.keys(), adapter)
    if stats is None or stats.stream is None:
        stats = collect_statistics(source, config, ids, options.calib_seq_len, want_normed=False, want_stream=True,
                                   placement=placement, progress=progress)
    Q = pca(sum(C / C.trace().clamp_min(1e-300) for C in stats.stream))
    n_layers, d = adapter.n_layers, adapter.hidden
    curves = measure_slice_sensitivity(source, config, adapter, Q, stats.stream[0], options, ids, placement, progress)
    if uniform.tied:
        curves["embed"] = [(x, e + h) for (x, e), (_, h) in zip(curves["embed"], tied_head_curve(source, adapter, Q,
                                                                                                 stats.stream[-1]))]
    target = uniform.accounting["target_params"]
    widths, chosen, _ = allocate_slice(entries, n_layers, d, uniform.tied, target, curves, uniform.residual)
    keep = {f"segment{k}": w / d for k, w in enumerate(widths)}
    report = {"budget": target, "allocated": _exact_slice_total(widths, entries, n_layers, uniform.tied),
              "uniform_width": uniform.residual, "widths": widths,
              "groups": {n: {"keep": c.keep, "width": round(c.keep * d), "params": c.params, "error": c.error}
                         for n, c in chosen.items()},
              "sensitivity": curves}
    return keep, report
