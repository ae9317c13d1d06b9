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
from .pca import global_rotation
from .plan import MatrixPlan, check_family, final_gamma, matrix_entries, params_at
from .routes import CompressRun

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
