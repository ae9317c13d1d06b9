"""Step 2, calibration moments: the per-token second moments (float64, original basis) the solvers weight by.

One pass of the original model (:func:`collect_statistics`) gives per residual segment those of the normalised
stream (the folded readers' inputs; a rotation moves them to ``Qᵀ Σ Q`` exactly, so the paper's "rotated,
uncompressed" statistics come from this one pass), the writers' inputs (``o_proj``, ``down_proj``), token
counts (the embedding's and head's ``√(D+1)`` weights) and, for SliceGPT, the raw stream's. Sequential
calibration (:func:`sequential_weighted`) measures segment k on the model whose earlier segments are already
compressed, as SliceGPT and GPTQ calibrate."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from ...calibration import StatsRequest, token_counts
from ...calibration import token_batches as batches
from ...calibration.run import Activations
from ...calibration.statistics import base_site
from ...symmetry import actions

if TYPE_CHECKING:  # annotations only: the run imports nothing of this module
    from .routes import CompressRun

Tensors = dict[str, torch.Tensor]


@dataclass
class CalibrationStats:
    """Per-token second moments. Segment ``2i`` is read by layer i's attention, ``2i+1`` by its FFN,
    ``2L`` by the head; the writers' lists are per layer."""

    tokens: int
    token_counts: torch.Tensor
    normed: list[torch.Tensor] | None = None  # RMSNorm(h) without γ: the folded readers' inputs
    stream: list[torch.Tensor] | None = None  # h itself (SliceGPT's PCA)
    attn_out: list[torch.Tensor] | None = None  # o_proj inputs
    mlp_hidden: list[torch.Tensor] | None = None  # down_proj inputs
    # sequential calibration matching the original model: the readers' X̂ᵀX / n (partly compressed model's
    # normalised stream against the original's), and per writer X̂ᵀ(H' − b − Ĥ) / n (``[k, d]``): what it
    # must add to the partly compressed stream Ĥ to give the original stream H' after it, bias b aside
    # (= X̂ᵀ(X M + H − Ĥ) / n: the original outputs plus the stream's drift, without the ``[k, k]`` X̂ᵀX)
    normed_cross: list[torch.Tensor] | None = None
    attn_out_target: list[torch.Tensor] | None = None
    mlp_hidden_target: list[torch.Tensor] | None = None
    # one global PCA: Σ_k C_k / tr C_k over the raw-stream moments, in segment order (instead of ``stream``)
    stream_sum: torch.Tensor | None = None

    def writer_moments(self, segment: int, consume: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Segment ``segment``'s writer's (layer ``(segment − 1) // 2``'s o or down) input moments and, matching
        the original model, its target (else ``None``); ``consume``: both dropped from these statistics."""
        name, layer = _WRITERS[segment % 2][0], (segment - 1) // 2
        moments, targets = getattr(self, name), getattr(self, name + "_target")
        out = moments[layer], None if targets is None else targets[layer]
        if consume:
            moments[layer] = None
            if targets is not None:
                targets[layer] = None
        return out


def one_pass_statistics(run: CompressRun, on_demand: bool = False) -> CalibrationStats | None:
    """The one-pass statistics ``run.options`` needs (``None``: no calibration). ``on_demand``, for a solver
    that releases each segment once solved: measured as it reads them where the options allow it."""
    options = run.options
    if not options.needs_calibration:
        return None
    return collect_statistics(
        run,
        want_normed=options.want_normed,
        want_stream=options.want_stream,
        stream_sum=options.stream_sum,
        on_demand=on_demand and options.statistics_on_demand,
    )


class _OnDemand:
    """A list of moments measured when first read: reading entry ``k`` runs the pass on to the layer that
    makes it (``advance(layer_of(k))``); setting an entry (``None``: released) stores it as given."""

    def __init__(self, n: int, advance, layer_of):
        self.items: list = [None] * n
        self._advance, self._layer_of = advance, layer_of

    def __getitem__(self, k: int):
        self._advance(self._layer_of(k))
        return self.items[k]

    def __setitem__(self, k: int, value) -> None:
        self.items[k] = value


#: the stream kinds of one pass and their sites' prefix: the normalised stream, the raw one
_PREFIX = {"normed": "normed:", "stream": ""}


def collect_statistics(
    run: CompressRun, want_normed: bool, want_stream: bool, stream_sum: bool = False, on_demand: bool = False
) -> CalibrationStats:
    """One pass of the original model, one decoder layer in memory: per segment the moments of the normalised
    (``want_normed``, with the writers' inputs) and/or raw stream (``want_stream``; ``stream_sum``: only their
    sum, one ``d × d`` matrix). Layer i measures segments 2i+1 and 2i+2 (layer 0 also 0): its output is the next
    layer's input, and the last one's the final stream, bit for bit. ``on_demand``: each entry measured when
    first read; a solver releasing each segment once solved (``stats.release_segment(k)``) then holds about one
    layer's moments (the FFN's ``4d × 4d`` among them)."""
    ids = run.ids
    stats = CalibrationStats(ids.numel(), token_counts([ids], int(run.config["vocab_size"])))
    kinds = [kind for kind, want in (("normed", want_normed), ("stream", want_stream)) if want]
    if not kinds:
        return stats
    engine = run.engine()
    L = engine.adapter.n_layers
    calibration = engine.start(batches(ids, run.seq_len))
    n = stats.tokens = calibration.tokens
    # layer_in is used at layer 0 only (later ones equal the previous output), but one request keeps one bar
    sites = [_PREFIX[kind] + s for kind in kinds for s in ("layer_in", "ffn_norm_in", "layer_out")]
    steps = calibration.layers(StatsRequest(grams=(*sites, *(["o_in", "down_in"] if want_normed else []))))
    del calibration  # the pass's activations go with its last step
    measured = [0]  # layers measured

    def store(kind: str, k: int, C: torch.Tensor) -> None:
        if kind == "stream" and stream_sum:  # the segments in order, as sum() would add them
            C = C / C.trace().clamp_min(1e-300)
            stats.stream_sum = C if stats.stream_sum is None else stats.stream_sum + C
        else:
            getattr(stats, kind)[k] = C

    def advance(layer: int) -> None:
        while measured[0] <= layer:
            step = next(steps)
            i, grams = step.index, step.stats.grams
            step.stats = None
            step.release()  # the outputs are made: the original layer can go
            segments = [(0, "layer_in")] if i == 0 else []
            segments += [(2 * i + 1, "ffn_norm_in"), (2 * i + 2, "layer_out")]
            for kind in kinds:
                for k, site in segments:  # in place: no second copy of the moments
                    store(kind, k, grams.pop(_PREFIX[kind] + site).div_(n))
            if want_normed:
                stats.attn_out[i] = grams.pop("o_in").div_(n)
                stats.mlp_hidden[i] = grams.pop("down_in").div_(n)
            del step, grams
            measured[0] = i + 1
            if i == L - 1:
                next(steps, None)  # the pass ends (nothing runs after the last layer)

    def entries(n: int, layer_of) -> list | _OnDemand:
        return _OnDemand(n, advance, layer_of) if on_demand else [None] * n

    per_segment, per_layer = (lambda k: max(0, (k - 1) // 2)), (lambda i: i)
    if want_normed:
        stats.normed = entries(2 * L + 1, per_segment)
        stats.attn_out, stats.mlp_hidden = entries(L, per_layer), entries(L, per_layer)
    if want_stream and not stream_sum:
        stats.stream = entries(2 * L + 1, per_segment)
    if on_demand:
        stats.release_segment = partial(release_segment, stats)
    else:
        advance(L - 1)
    return stats


#: the writer of segment k by ``k % 2`` (1: attention's, 0: the FFN's): its moments, its bias and its sites
#: on a decoder layer (its input, the stream before it adds to it, the stream the segment's readers see
#: (normalised), the stream after it)
_WRITERS = {
    1: ("attn_out", "o.bias", ("o_in", "layer_in", "normed:ffn_norm_in", "ffn_norm_in")),
    0: ("mlp_hidden", "down.bias", ("down_in", "ffn_norm_in", "normed:layer_out", "layer_out")),
}


def release_segment(stats: CalibrationStats, k: int) -> None:
    """Drop segment ``k``'s moments and its writer's, once it is solved."""
    for name in ("normed", "normed_cross"):
        if getattr(stats, name) is not None:
            getattr(stats, name)[k] = None
    if k > 0:
        stats.writer_moments(k, consume=True)


def _request(sites: tuple[str, str, str, str], match_original: bool):
    writer, before, normed, after = sites
    if not match_original:
        return StatsRequest(grams=(writer, normed))
    return StatsRequest(
        grams=(writer, normed), sums=(writer,), cross=((normed, normed),), drift=((writer, after, before),)
    )


def _record(stats: CalibrationStats, got, segment: int, bias: torch.Tensor | None) -> None:
    """Segment ``segment``'s statistics from one :meth:`LayerStep.collect`: the writer's X̂ᵀX̂, the readers'
    normalised stream and, matching the original model, the readers' X̂ᵀX and the writer's target
    X̂ᵀ(H' − b − Ĥ) (``bias`` b: the writer's, which it keeps)."""
    name, _, (writer, before, normed, after) = _WRITERS[segment % 2]
    layer, n = (segment - 1) // 2, got.tokens
    # in place (the sums are not needed again): no second copy of the FFN's [4d, 4d]-sized moments
    getattr(stats, name)[layer] = got.grams.pop(writer).div_(n)
    stats.normed[segment] = got.grams.pop(normed).div_(n)
    if stats.normed_cross is not None:
        stats.normed_cross[segment] = got.cross.pop((normed, normed)).div_(n)
        target = got.drift.pop((writer, after, before))
        total = got.sums.pop(writer)
        if bias is not None:
            target.sub_(torch.outer(total, bias.to(target)))
        getattr(stats, name + "_target")[layer] = target.div_(n)


def sequential_weighted(run: CompressRun, solve_segment, keep: bool = True, folded=None) -> CalibrationStats:
    """Stage W with sequential calibration: segments ``0 … 2L`` in order, each measured on the model whose
    earlier segments are compressed (matching the original model: the original stream carried alongside).
    ``solve_segment(k, stats)`` returns ``[(MatrixPlan, M̂)]``: what replaces segment k's matrices from then on
    (``[k, d]``, original basis; ``M̂``, or a function making it or, the embedding's, its rows of token ids).
    ``keep=False``: each segment's statistics dropped once solved. ``folded``: the solver's norm-folded layers.

    With one rotation per segment the compressed model *is* the norm-folded model with each compressed matrix
    replaced by its approximation in the original basis (RMSNorm commutes with rotations, the skips are exact),
    each layer run as the family's own module. Layer i measures segment 2i+1 (o, gate, up) with q/k/v replaced,
    segment 2i+2 (down, the next q/k/v or the head) with o/gate/up replaced too; segment 0 is measured on the
    embeddings. A segment's own writer counts as dense in its statistics."""
    match = run.options.match_original
    engine = run.engine()
    adapter, dtype = engine.adapter, engine.dtype
    L, n_seg = adapter.n_layers, 2 * adapter.n_layers + 1
    stats = CalibrationStats(
        0, run.stats.token_counts, normed=[None] * n_seg, attn_out=[None] * L, mlp_hidden=[None] * L
    )
    if match:
        stats.normed_cross, stats.attn_out_target, stats.mlp_hidden_target = [None] * n_seg, [None] * L, [None] * L
    chunks = batches(run.ids, run.seq_len)
    calibration = engine.start(chunks, carry_original=match)
    stats.tokens = calibration.tokens
    first = StatsRequest(grams=("normed:layer_in",), cross=(("normed:layer_in", "normed:layer_in"),) if match else ())
    # the original stream's sites the cross statistics read, kept: the original layer is released first
    kept = {base_site(b) for *_, sites in _WRITERS.values() for b in _request(sites, True).original_sites()}
    kept = tuple(sorted(kept - {"layer_out"})) if match else ()  # (the layer's output is kept anyway)
    replaced: dict[int, Tensors] = {}  # per layer, its matrices solved so far (the next layer's readers too)

    def solved(k: int) -> None:
        _replace(solve_segment(k, stats), replaced, calibration, chunks, dtype)
        if not keep:
            release_segment(stats, k)

    def module(i: int, like: dict, canon: _Overlay) -> torch.nn.Module:  # built from the family's meta skeleton
        return engine.layer_module(i, adapter.write_layer(i, canon, like))

    for step in calibration.layers(first, only={0}, keep_original=kept, replaced=True):
        i = step.index
        layer = folded[i] if folded is not None else actions.fold_layer_norms(adapter.read_layer(i, step.tensors()))
        canon = _Overlay(layer, dtype, replaced.setdefault(i, {}))
        like = {adapter.layer_prefix(i) + n: dtype for n, _ in step.module.named_parameters()}
        step.release()
        if i == 0:
            n = step.stats.tokens
            stats.normed[0] = step.stats.grams["normed:layer_in"] / n
            if match:
                stats.normed_cross[0] = step.stats.cross[("normed:layer_in", "normed:layer_in")] / n
            step.stats = None
            solved(0)
        for k in (2 * i + 1, 2 * i + 2):
            _, bias, sites = _WRITERS[k % 2]
            got = step.collect(_request(sites, match), module=module(i, like, canon))
            _record(stats, got, k, layer[bias] if bias in layer else None)
            del got
            solved(k)
        step.replace(module(i, like, canon))
        del replaced[i]
    return stats


def _replace(approximations, replaced: dict[int, Tensors], calibration, chunks, dtype: torch.dtype) -> None:
    """Puts a solved segment's approximations into the sequential calibration: the embedding's rows into the
    stream of ``calibration`` (the engine's run over ``chunks``), a layer's matrices into ``replaced``."""
    for m, M in approximations:
        if m.canon == "embed":  # the approximation, or its rows (a function of the token ids)
            rows = M if callable(M) else (lambda idx, E=M.to(dtype): E[idx.to(E.device)])
            home = calibration.stream.batches[0].device
            calibration.stream = Activations([rows(b).to(device=home, dtype=dtype) for b in chunks])
        elif m.canon != "lm_head":  # (nothing runs after the head)
            M = M() if callable(M) else M  # made now: one float64 approximation at a time
            # in the engine's dtype at once: the layer module is built in it (the same values), half the memory
            replaced.setdefault(m.layer, {})[f"{m.canon}.weight"] = (M if m.role == "reader" else M.T).to(dtype)


class _Overlay(Mapping):
    """A layer's tensors in ``dtype``: ``replaced`` over the norm-folded ``layer``, whose other tensors are read
    and cast when a module is built (only the approximations are held between modules)."""

    def __init__(self, layer, dtype: torch.dtype, replaced: Tensors):
        self.layer, self.dtype, self.replaced = layer, dtype, replaced

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.replaced[key] if key in self.replaced else self.layer[key].to(self.dtype)

    def __iter__(self):
        return iter(self.layer)

    def __len__(self) -> int:
        return len(self.layer)

    def __contains__(self, key) -> bool:
        return key in self.layer
