"""Non-uniform allocation for SliceGPT with one global PCA: per-segment residual widths at a fixed total
parameter count, by the knapsack of :mod:`.allocate`. All segments share one basis, so a segment narrower
or wider than the one before is the same stream with coordinates dropped or zero-padded, and no skip
matrix is needed. The groups are the embedding's segment and the decoder layers (the two segments layer i
writes, at one width); a group's choices are ``(width / d, params, error)``."""

from __future__ import annotations

import copy

import numpy as np
import torch

from ...calibration import StatsRequest
from .allocate import Choices, Curves, allocate, fill, layer_sensitivity, trace_of
from .moments import collect_statistics
from .pca import pca
from .plan import MatrixPlan, check_family, final_gamma, matrix_entries, params_at
from .routes import CompressRun

#: widths (fractions of the hidden size) at which the sliced layers are measured; full width is exact
MEASURED_WIDTHS = (0.15, 0.3, 0.45, 0.6, 0.7, 0.8, 0.9)


def _measured(d: int) -> list[int]:
    return [max(1, round(f * d)) for f in MEASURED_WIDTHS]


def slice_groups(n_layers: int) -> dict[str, tuple[int, ...]]:
    """Each group's segments: ``embed`` writes segment 0; decoder layer ``i`` writes ``2i + 1`` (after its
    attention) and ``2i + 2`` (after its MLP)."""
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
    entries: list[MatrixPlan], n_layers: int, d: int, tied: bool, head_width: int, curves: Curves
) -> dict[str, Choices]:
    """Each group's choices on :func:`width_grid`: parameters at the slope of
    :func:`slice_params_per_width`, errors interpolated in the width from the measured ``curves``."""
    per = slice_params_per_width(entries, n_layers, tied, head_width)
    groups = {}
    for name, segs in slice_groups(n_layers).items():
        unit = sum(per[k] for k in segs)
        # full width loses nothing; no width below the narrowest measured one is offered, and the
        # error is made non-increasing in the width (a wider slice contains the narrower one)
        xs, ys = zip(*sorted(curves[name] + [(1.0, 0.0)]))
        ys = np.maximum.accumulate(np.asarray(ys)[::-1])[::-1]
        groups[name] = [(w / d, unit * w, float(np.interp(w / d, xs, ys))) for w in width_grid(d) if w / d >= xs[0]]
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
    return _SlicedOutputs(new, new.get_submodule(adapter.spec.attention.o.rsplit(".", 1)[0]), P)


def measure_slice_sensitivity(calib: CompressRun, adapter, Q: torch.Tensor, stream_first: torch.Tensor) -> Curves:
    """Per group: ``[(width / d, relative output error)]`` at :data:`MEASURED_WIDTHS`. A decoder layer's
    error is ``Σ‖ŷ − y‖² / Σ‖y‖²``, ``ŷ`` the layer with the segments it writes sliced — relative to the
    stream, which the next layers read normalised; the embedding's is the share of its output's energy
    outside the kept directions, ``tr((I − P) C₀) / tr C₀``.

    Measured on SmolLM2 (BENCHMARKS.md), neither this nor the structured classes' normalisation (the
    layer's residual update) gives widths that beat one uniform width: a direction dropped at one
    segment is gone from every later one, which no layer-local error sees."""
    d = Q.shape[0]

    def variants(step):
        engine = step.run.engine
        for w in _measured(d):
            P = (Q[:, :w] @ Q[:, :w].T).to(device=engine.device, dtype=engine.dtype)
            yield w / d, _sliced_layer(step.module, adapter, P)

    def energy(s):
        return trace_of(s.grams["layer_out"])

    curves = layer_sensitivity(calib, StatsRequest(grams=("layer_out",)), energy, variants)
    C = Q.T @ stream_first.to(Q) @ Q
    total = float(C.diagonal().sum())
    curves["embed"] = [(w / d, float(C.diagonal()[w:].sum()) / max(total, 1e-300)) for w in _measured(d)]
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
    return [(w / d, float((B[w:, w:] * A_[w:, w:]).sum()) / max(total, 1e-300)) for w in _measured(d)]


def _exact_slice_total(widths: list[int], entries: list[MatrixPlan], tied: bool) -> int:
    """Parameters at per-segment ``widths``: the matrices' and the tied head's mix ``[w_0, w_2L]``."""
    return params_at(entries, widths.__getitem__) + (widths[0] * widths[-1] if tied else 0)


def allocate_slice(
    entries: list[MatrixPlan], n_layers: int, d: int, tied: bool, target: int, curves: Curves, head_width: int
) -> tuple[list[int], dict[str, tuple[float, int, float]]]:
    """Per-segment widths minimising the summed errors with the model at most ``target`` parameters, and
    each group's choice. The tied head's mix ``[w_0, w_2L]`` couples two groups, so the knapsack is repeated
    with the first width it chose (``head_width`` to start) until that width settles; then, on the exact
    total: while over, the group whose next narrower width costs the least error per parameter is
    narrowed; while one fits, the next wider width of a group that lowers the error most per parameter
    is taken."""
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
        stats = collect_statistics(run, want_normed=False, want_stream=True, progress=run.progress)
    Q = pca(sum(C / C.trace().clamp_min(1e-300) for C in stats.stream))
    d = adapter.hidden
    curves = measure_slice_sensitivity(run, adapter, Q, stats.stream[0])
    if uniform.tied:
        head = tied_head_curve(run.source, adapter, Q, stats.stream[-1])
        curves["embed"] = [(x, e + h) for (x, e), (_, h) in zip(curves["embed"], head)]
    target = uniform.accounting.target_params
    widths, chosen = allocate_slice(entries, adapter.n_layers, d, uniform.tied, target, curves, uniform.residual)
    report = {
        "budget": target,
        "allocated": _exact_slice_total(widths, entries, uniform.tied),
        "uniform_width": uniform.residual,
        "widths": widths,
        "groups": {
            name: {"keep": k, "width": round(k * d), "params": p, "error": e} for name, (k, p, e) in chosen.items()
        },
        "sensitivity": curves,
    }
    return {f"segment{k}": w / d for k, w in enumerate(widths)}, report
