"""Non-uniform allocation for SliceGPT: per-segment residual widths at a fixed total parameter count.

SliceGPT with one global PCA (:func:`allocate_slice_for`) allocates residual *widths* the same way: all
segments share one basis, so a segment narrower or wider than the one before is the same stream with
coordinates dropped or zero-padded, and no skip matrix is needed. The groups are the embedding's
segment and the decoder layers (the two segments layer i writes, at one width); a layer's sensitivity
is its output error with those segments projected onto the first ``w`` principal directions."""

from __future__ import annotations

import copy

import numpy as np
import torch

from ...calibration import CalibrationEngine, StatsRequest
from ...calibration import token_batches as batches
from .allocate import Choice, Group, adapter_path, allocate, output_error, trace_of
from .moments import collect_statistics
from .pca import pca
from .plan import MatrixPlan, check_family, final_gamma, matrix_entries, params_at
from .routes import CompressRun

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


def slice_params_per_width(entries: list[MatrixPlan], n_layers: int, tied: bool, head_width: int) -> dict[int, int]:
    """Parameters per unit of width of each residual segment: the columns of the matrices that read
    it, the rows (and bias) of those that write it; the tied head's mix ``[w_0, w_2L]`` is charged to
    the final segment at ``head_width`` for ``w_0`` (the allocation is checked exactly afterwards)."""
    per = {k: 0 for k in range(2 * n_layers + 1)}
    for e in entries:  # the count is linear in the width: its slope
        per[e.segment] += params_at([e], lambda _: 1) - params_at([e], lambda _: 0)
    if tied:
        per[2 * n_layers] += head_width
    return per


def build_slice_groups(
    entries: list[MatrixPlan],
    n_layers: int,
    d: int,
    tied: bool,
    head_width: int,
    curves: dict[str, list[tuple[float, float]]],
) -> list[Group]:
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
        a = (self._x + a) @ self.P - self._x  # the layer adds x back: x + a -> P(x + a)
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
    part = adapter_path(adapter, "self_attn.o_proj").rsplit(".", 1)[0]  # the attention block
    return _SlicedOutputs(new, new.get_submodule(part), P)


def measure_slice_sensitivity(
    calib: CompressRun,
    adapter,
    Q: torch.Tensor,
    stream_first: torch.Tensor,
    progress: bool = True,
) -> dict[str, list[tuple[float, float]]]:
    """Per group: ``[(width / d, relative output error)]`` at :data:`MEASURED_WIDTHS`. A decoder layer's
    error is ``Σ‖ŷ − y‖² / Σ‖y‖²`` over the calibration tokens, ``ŷ`` the layer run with the segments it
    writes sliced (:class:`_SlicedOutputs`) on the original layer's inputs — relative to the stream,
    which the next layers read normalised; the embedding's is the share of its output's energy outside
    the kept directions, ``tr((I − P) C₀) / tr C₀``.

    Measured on SmolLM2 (BENCHMARKS.md), neither this nor the structured classes' normalisation (the
    layer's residual update) gives widths that beat one uniform width: a direction dropped at one
    segment is gone from every later one, which no layer-local error sees."""
    source, config, ids, placement = calib.source, calib.config, calib.ids, calib.placement
    d = Q.shape[0]
    widths = [max(1, round(f * d)) for f in MEASURED_WIDTHS]
    curves: dict[str, list[tuple[float, float]]] = {}
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    projections = {w: (Q[:, :w] @ Q[:, :w].T).to(device=engine.device, dtype=engine.dtype) for w in widths}

    def on_layer(step):
        energy = trace_of(step.stats.grams["layer_out"])
        curve = []
        for w in widths:
            err = output_error(step, _sliced_layer(step.module, adapter, projections[w]))
            curve.append((w / d, max(err, 0.0) / max(energy, 1e-300)))
        curves[f"layers.{step.index}"] = curve
        return None

    engine.collect(
        batches(ids, calib.seq_len), StatsRequest(grams=("layer_out",)), on_layer=on_layer, carry_original=True
    )
    C = Q.T @ stream_first.to(Q) @ Q
    total = float(C.diagonal().sum())
    curves["embed"] = [(w / d, float(C.diagonal()[w:].sum()) / max(total, 1e-300)) for w in widths]
    return curves


def tied_head_curve(source, adapter, Q: torch.Tensor, stream_last: torch.Tensor) -> list[tuple[float, float]]:
    """A tied head reads the embedding matrix sliced to the first segment's width: the relative error
    of the logits ``h γ (I − P) Eᵀ`` over the calibration tokens' final stream ``h`` (its raw second
    moment, the norm's per-token scale left out), ``tr(B₂₂ A₂₂) / tr(B A)`` in the principal basis with
    ``B = Qᵀ EᵀE Q``, ``A = Qᵀ γ C γ Q``. Added to the embedding's group error."""
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


def _exact_slice_total(widths: list[int], entries: list[MatrixPlan], tied: bool) -> int:
    """Parameters at per-segment ``widths``: the matrices' and the tied head's mix ``[w_0, w_2L]``."""
    return params_at(entries, widths.__getitem__) + (widths[0] * widths[-1] if tied else 0)


def allocate_slice(
    entries: list[MatrixPlan],
    n_layers: int,
    d: int,
    tied: bool,
    target: int,
    curves: dict[str, list[tuple[float, float]]],
    head_width: int,
) -> tuple[list[int], dict[str, Choice], list[Group]]:
    """Per-segment widths minimising the summed errors with the model at most ``target`` parameters:
    the knapsack of :func:`allocate`. The tied head's mix ``[w_0, w_2L]`` couples two groups, so the
    knapsack is repeated with the first width it chose (``head_width`` to start) until that width
    settles; then the exact total is checked — while over, the group whose next narrower width costs
    the least error per parameter is narrowed; while an upgrade fits, the one that lowers the error
    most per parameter is taken."""
    constant = params_at(entries, lambda _: 0)  # what does not depend on the widths: the readers' biases
    n_seg = 2 * n_layers + 1

    def widths_of(groups, ch):
        out = [0] * n_seg
        for g in groups:
            for m in g.matrices:
                out[int(m[len("segment") :])] = round(ch[g.name].keep * d)
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

    while _exact_slice_total(widths, entries, tied) > target:
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
        total, best = _exact_slice_total(widths, entries, tied), None
        for g in groups:
            i = index(g.name)
            c = g.choices[i]
            for o in g.choices[i + 1 :]:
                trial = dict(chosen, **{g.name: o})
                extra = _exact_slice_total(widths_of(groups, trial), entries, tied) - total
                if o.error < c.error and total + extra <= target:
                    gain = (c.error - o.error) / max(extra, 1)
                    if best is None or gain > best[0]:
                        best = (gain, g.name, o)
                    break  # the next wider width that fits is enough per group
        if best is None:
            break
        chosen[best[1]] = best[2]
        widths = widths_of(groups, chosen)
    return widths, chosen, groups


def allocate_slice_for(run):
    """``(keep map, report)`` for SliceGPT with one global PCA (``run``: a :class:`.routes.CompressRun`):
    the global rotation from ``run.stats`` (one-pass stream moments, as the solve takes it), each group's
    sensitivity measured at several widths, then per-segment widths at the total of the uniform plan
    ``run.plan`` (``keep``: ``segment{k}`` → width / d)."""
    calib, stats, uniform, progress = run, run.stats, run.plan, run.progress
    source = calib.source
    adapter = check_family(calib.config, source.keys())
    entries = matrix_entries(calib.config, source.keys(), adapter)
    if stats is None or stats.stream is None:
        stats = collect_statistics(calib, want_normed=False, want_stream=True, progress=progress)
    Q = pca(sum(C / C.trace().clamp_min(1e-300) for C in stats.stream))
    n_layers, d = adapter.n_layers, adapter.hidden
    curves = measure_slice_sensitivity(calib, adapter, Q, stats.stream[0], progress)
    if uniform.tied:
        curves["embed"] = [
            (x, e + h) for (x, e), (_, h) in zip(curves["embed"], tied_head_curve(source, adapter, Q, stats.stream[-1]))
        ]
    target = uniform.accounting.target_params
    widths, chosen, _ = allocate_slice(entries, n_layers, d, uniform.tied, target, curves, uniform.residual)
    keep = {f"segment{k}": w / d for k, w in enumerate(widths)}
    report = {
        "budget": target,
        "allocated": _exact_slice_total(widths, entries, uniform.tied),
        "uniform_width": uniform.residual,
        "widths": widths,
        "groups": {
            n: {"keep": c.keep, "width": round(c.keep * d), "params": c.params, "error": c.error}
            for n, c in chosen.items()
        },
        "sensitivity": curves,
    }
    return keep, report
