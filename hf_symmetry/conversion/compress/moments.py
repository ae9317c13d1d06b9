"""Step 2, calibration moments: the second moments the solvers weight by.

One pass of the original model (:func:`collect_statistics`): per residual segment the covariance of the
normalised stream (readers' inputs; rotating the model moves it to ``Qᵀ Σ Q`` exactly, so the "rotated,
uncompressed model" statistics of the paper come from this one pass), the inputs of ``o_proj`` and
``down_proj`` (writers), token counts (``√(D+1)`` weights of the embedding/head) and, for SliceGPT, the
raw stream covariance.

Sequential calibration: segment k's statistics come instead from the model whose segments before k are
already compressed (as SliceGPT and GPTQ calibrate), both on the calibration engine's sequential mode
(one decoder layer in memory). Stage W: :func:`sequential_weighted`, each layer run as the family's own
module with its norms folded and its matrices replaced by their approximations; SliceGPT:
:func:`.pca.sequential_stream_pca`. Also here: the calibration text read into token ids (:func:`read_calibration`)
and the one-pass statistics a set of options needs (:func:`one_pass_statistics`). Every pass runs on a
:class:`.routes.CompressRun`: its source and config, its calibration ids in sequences of its ``seq_len``, on its
placement."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...calibration import CalibrationEngine, StatsRequest
from ...calibration import token_batches as batches
from ...calibration.run import Activations
from ...calibration.statistics import base_site
from ...evaluation.compare import load_tokenizer
from ...symmetry import actions
from ...text import read_text, tokenize_text

if TYPE_CHECKING:  # annotations only: the run imports nothing of this module
    from .routes import CompressRun

Tensors = dict[str, torch.Tensor]


@dataclass
class CalibrationStats:
    """Per-token second moments in the original basis (float64). Segment ``2i`` is read by layer i's
    attention, ``2i+1`` by its FFN, ``2L`` by the head."""

    tokens: int
    token_counts: torch.Tensor
    normed: list[torch.Tensor] | None = None  # RMSNorm(h) without γ: the folded readers' inputs
    stream: list[torch.Tensor] | None = None  # h itself (SliceGPT's PCA)
    attn_out: list[torch.Tensor] | None = None  # o_proj inputs
    mlp_hidden: list[torch.Tensor] | None = None  # down_proj inputs
    # sequential calibration matching the original model: X̂ᵀX / n, the partly compressed model's
    # normalised stream (the readers' inputs) against the original model's at the same place
    normed_cross: list[torch.Tensor] | None = None
    # ... and per writer X̂ᵀ(H' − b − Ĥ) / n (``[k, d]``): its inputs X̂ against what it must add to the
    # partly compressed stream Ĥ before it to give the original stream H' after it (bias b aside); with
    # the original stream H before it that is X̂ᵀ(X M + H − Ĥ) / n, M the writer: the original outputs
    # plus the stream's drift, without the ``[k, k]`` cross moment X̂ᵀX
    attn_out_target: list[torch.Tensor] | None = None
    mlp_hidden_target: list[torch.Tensor] | None = None
    # one global PCA: Σ_k C_k / tr C_k over the raw-stream moments, in segment order (instead of ``stream``)
    stream_sum: torch.Tensor | None = None


def token_sequences(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``seq_len`` tokens (the last one may be shorter, never below 2): the 1-D
    view of :func:`hf_symmetry.calibration.data.token_batches`, which the engine runs."""
    return [b.reshape(-1) for b in batches(ids, seq_len)]


def read_calibration(src, calibration, options) -> torch.Tensor | None:
    """The text of ``calibration`` (a :class:`...calibration.CalibrationText`: a UTF-8 file or an embedded name;
    ``None``: none given) as token ids of the tokenizer of the folder ``src``, at most ``calibration.tokens``;
    ``None`` where ``options`` needs no calibration. The text is read even then, so an empty file fails before
    any work."""
    calib = read_text(calibration.text) if calibration is not None else None
    if options.needs_calibration and calib is None:
        raise ValueError(
            f"--calib is required for {options.label} (calibration text: a UTF-8 file or an embedded name)"
        )
    if not options.needs_calibration:
        return None
    calib_ids = tokenize_text(load_tokenizer(src), calib, max_tokens=calibration.tokens)
    if calib_ids.numel() < 2:
        raise ValueError(f"calibration text {calibration.text} has fewer than two tokens")
    return calib_ids


def one_pass_statistics(run: CompressRun, on_demand: bool = False) -> CalibrationStats | None:
    """The statistics of one pass of the original model that ``run.options`` (a :class:`.CompressOptions`)
    needs (token counts only where it needs no activations; ``None`` where it needs no calibration),
    layer by layer from ``run.source`` (``run``: a :class:`.routes.CompressRun`). ``on_demand`` (for a
    solver that releases each segment's statistics once solved): where
    :attr:`CompressOptions.statistics_on_demand`, measured as the solver first reads them
    (:func:`one_pass_on_demand`)."""
    options = run.options
    if not options.needs_calibration:
        return None
    run.require_calibration()
    if on_demand and options.statistics_on_demand:
        return one_pass_on_demand(run, progress=run.progress)
    return collect_statistics(
        run,
        want_normed=options.want_normed,
        want_stream=options.want_stream,
        progress=run.progress,
        stream_sum=options.stream_sum,
    )


_ONE_PASS_SITES = {
    "normed": ("normed:layer_in", "normed:ffn_norm_in", "normed:final_in"),
    "stream": ("layer_in", "ffn_norm_in", "final_in"),
}


def collect_statistics(
    calib: CompressRun,
    want_normed: bool,
    want_stream: bool,
    progress: bool = True,
    stream_sum: bool = False,
) -> CalibrationStats:
    """One pass of the original model over ``calib.ids`` in chunks of ``calib.seq_len``, layer by layer
    from the checkpoint (:class:`hf_symmetry.calibration.CalibrationEngine`: one decoder layer in memory
    at a time, on ``calib.placement``'s device): per residual segment the second moments of the
    normalised and/or raw stream, and the inputs of ``o_proj`` and ``down_proj``; ``calib`` is a
    :class:`.routes.CompressRun`, whose ``source`` is a checkpoint reader or any tensor source with its
    ``config``. Each layer's moments are taken as the engine reaches it.
    ``stream_sum``: keep only the running sum of the trace-normalised raw-stream moments
    (``stats.stream_sum``, all one global PCA needs: one ``d × d`` matrix whatever the depth) instead of
    every segment's (``stats.stream``)."""
    source, config, ids, seq_len, placement = calib.source, calib.config, calib.ids, calib.seq_len, calib.placement
    vocab = int(config["vocab_size"])
    stats = CalibrationStats(0, torch.bincount(ids.reshape(-1), minlength=vocab).to(torch.float64)[:vocab])
    if not (want_normed or want_stream):
        stats.tokens = ids.numel()
        return stats
    layer_sites, final_sites = [], []
    for want, stream in ((want_normed, "normed"), (want_stream, "stream")):
        if want:
            layer_sites += _ONE_PASS_SITES[stream][:2]
            final_sites.append(_ONE_PASS_SITES[stream][2])
    if want_normed:
        layer_sites += ["o_in", "down_in"]
        stats.normed, stats.attn_out, stats.mlp_hidden = [], [], []
    if want_stream and not stream_sum:
        stats.stream = []

    def stream_moment(C: torch.Tensor) -> None:  # the segments in order, as sum() would add them
        if stream_sum:
            C = C / C.trace().clamp_min(1e-300)
            stats.stream_sum = C if stats.stream_sum is None else stats.stream_sum + C
        else:
            stats.stream.append(C)

    def record(grams: dict, sites: tuple[str, ...], n: int) -> None:
        if want_normed:
            stats.normed += [grams[s] / n for s in sites if s.startswith("normed:")]
        if want_stream:
            for s in sites:
                if not s.startswith("normed:"):
                    stream_moment(grams[s] / n)

    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    run = engine.start(batches(ids, seq_len))
    stats.tokens = n = run.tokens
    for step in run.layers(StatsRequest(grams=tuple(layer_sites))):
        grams = step.stats.grams
        record(grams, tuple(s for s in layer_sites if s not in ("o_in", "down_in")), n)  # segments 2i, 2i + 1
        if want_normed:
            stats.attn_out.append(grams["o_in"] / n)
            stats.mlp_hidden.append(grams["down_in"] / n)
        del grams
        step.stats = None
    final = run.final(StatsRequest(grams=tuple(final_sites)))
    record(final.grams, tuple(final_sites), n)
    return stats


class _OnDemand:
    """A list of per-segment (or per-layer) moments that are measured when first read: reading entry
    ``k`` runs the calibration pass on to the layer that produces it (``advance(layer_of(k))``).
    Setting an entry (to ``None``: released) stores it as given."""

    def __init__(self, n: int, advance, layer_of):
        self.items: list = [None] * n
        self._advance, self._layer_of = advance, layer_of

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, k: int):
        self._advance(self._layer_of(k))
        return self.items[k]

    def __setitem__(self, k: int, value) -> None:
        self.items[k] = value


def one_pass_on_demand(calib: CompressRun, progress: bool = True) -> CalibrationStats:
    """The one-pass statistics of :func:`collect_statistics` (``want_normed``: the normalised stream per
    segment, the writers' inputs per layer), measured as they are first read instead of all up front:
    reading segment k's entries runs the calibration pass on to the layer that produces them (segment
    0 and ``2i+1``, ``2i+2`` at layer i: its input, mid-layer and output stream). A solver that goes
    through the segments in order and releases each one's entries once solved
    (``stats.release_segment(k)``) then holds about one layer's moments (the FFN's ``4d × 4d`` input
    moments among them), not every layer's. The values are those of :func:`collect_statistics` bit for
    bit (the output stream of layer i is the input stream of layer i + 1 and, after the last, the final one)."""
    vocab = int(calib.config["vocab_size"])
    engine = CalibrationEngine(calib.source, calib.config, placement=calib.placement, progress=progress)
    L = engine.adapter.n_layers
    run = engine.start(batches(calib.ids, calib.seq_len))
    n = run.tokens
    request = StatsRequest(grams=("normed:layer_in", "normed:ffn_norm_in", "normed:layer_out", "o_in", "down_in"))
    state = {"steps": run.layers(request), "measured": 0}
    del run

    def advance(layer: int) -> None:
        while state["measured"] <= layer and state["steps"] is not None:
            step = next(state["steps"])
            i, grams = step.index, step.stats.grams
            step.stats = None
            step.release()  # the outputs are made: the original layer can go
            first = grams.pop("normed:layer_in")  # layer 0's is segment 0; later ones equal the previous output's
            if i == 0:
                normed.items[0] = first.div_(n)
            del first
            normed.items[2 * i + 1] = grams.pop("normed:ffn_norm_in").div_(n)
            normed.items[2 * i + 2] = grams.pop("normed:layer_out").div_(n)
            attn_out.items[i] = grams.pop("o_in").div_(n)
            mlp_hidden.items[i] = grams.pop("down_in").div_(n)
            del step, grams
            state["measured"] = i + 1
            if i == L - 1:  # nothing runs after the last layer
                state["steps"].close()
                state["steps"] = None

    normed = _OnDemand(2 * L + 1, advance, lambda k: max(0, (k - 1) // 2))
    attn_out = _OnDemand(L, advance, lambda i: i)
    mlp_hidden = _OnDemand(L, advance, lambda i: i)
    stats = CalibrationStats(
        n,
        torch.bincount(calib.ids.reshape(-1), minlength=vocab).to(torch.float64)[:vocab],
        normed=normed,
        attn_out=attn_out,
        mlp_hidden=mlp_hidden,
    )

    def release_segment(k: int) -> None:
        """Drop segment k's moments (and its writer's), once it is solved."""
        normed[k] = None
        if k % 2 == 1:
            attn_out[(k - 1) // 2] = None
        elif k > 0:
            mlp_hidden[k // 2 - 1] = None

    stats.release_segment = release_segment
    return stats


#: per segment kind: the writer's input site, the stream before the writer adds to it, the stream
#: the segment's readers see (normalised), the stream after the writer, on a decoder layer of the
#: calibration engine
_ATTN_SITES = ("o_in", "layer_in", "normed:ffn_norm_in", "ffn_norm_in")
_FFN_SITES = ("down_in", "ffn_norm_in", "normed:layer_out", "layer_out")


def _request(sites: tuple[str, str, str, str], match_original: bool):
    writer, before, normed, after = sites
    if not match_original:
        return StatsRequest(grams=(writer, normed))
    return StatsRequest(
        grams=(writer, normed), sums=(writer,), cross=((normed, normed),), drift=((writer, after, before),)
    )


def _record(
    stats: CalibrationStats, got, sites, segment: int, layer: int, writer_moments: str, bias: torch.Tensor | None = None
) -> None:
    """Segment ``segment``'s statistics (``writer_moments``: ``attn_out`` or ``mlp_hidden``) from one
    :meth:`LayerStep.collect`, per token: the writer's inputs X̂ᵀX̂, the readers' normalised stream,
    and when matching the original model the readers' cross moments X̂ᵀX and the writer's target
    moment X̂ᵀ(H' − b − Ĥ) (``bias`` b: the writer's, which it keeps)."""
    writer, before, normed, after = sites
    n = got.tokens
    # in place (the sums are not needed again): no second copy of the FFN's [4d, 4d]-sized moments
    getattr(stats, writer_moments)[layer] = got.grams.pop(writer).div_(n)
    stats.normed[segment] = got.grams.pop(normed).div_(n)
    if stats.normed_cross is not None:
        stats.normed_cross[segment] = got.cross.pop((normed, normed)).div_(n)
        target = got.drift.pop((writer, after, before))
        total = got.sums.pop(writer)
        if bias is not None:
            target.sub_(torch.outer(total, bias.to(target)))
        getattr(stats, writer_moments + "_target")[layer] = target.div_(n)


def sequential_weighted(
    calib: CompressRun,
    token_counts: torch.Tensor,
    match_original: bool,
    solve_segment,
    progress: bool = True,
    keep: bool = True,
    folded=None,
) -> CalibrationStats:
    """Stage W with sequential calibration on the calibration engine (its sequential mode, one decoder
    layer in memory): the segments ``0, 1, …, 2L`` in order, each measured on the model whose earlier
    segments are already compressed, and with ``match_original`` also the original model's stream
    carried alongside. ``solve_segment(k, stats)`` solves segment ``k`` from ``stats`` (its entries
    for segment k are filled) and returns ``[(MatrixPlan, M̂)]``: the approximations, in the solver's
    ``[k, d]`` orientation and the original basis, that replace the segment's matrices from then on
    (``M̂`` or a function making it, called when it is applied; the embedding's may be a function of
    the token ids giving its rows).
    A segment's own writer still counts as dense in what its statistics measure. ``keep=False`` drops
    each segment's statistics once it is solved (memory flat in depth; the returned statistics are then
    empty but for the token counts). ``folded``: the norm-folded float64 layers the solver reads
    (:class:`.assemble.FoldedLayers`), shared instead of read and folded a second time.

    Each layer runs as the family's own decoder-layer module with its norms folded (γ = 1, γ in the
    readers): with one rotation per residual segment the compressed model *is* this model with every
    compressed matrix replaced by its approximation in the original basis (RMSNorm commutes with the
    rotations, the skips are exact). Per layer i: segment 2i+1 (o, gate, up) is measured with q/k/v
    replaced, segment 2i+2 (down, and the next layer's q/k/v or the head) with o/gate/up replaced too;
    the fully replaced layer's outputs are handed on. Segment 0 (the embedding and layer 0's q/k/v) is
    measured on the embeddings, and the compressed embedding's rows then enter layer 0."""
    engine = CalibrationEngine(calib.source, calib.config, placement=calib.placement, progress=progress)
    adapter = engine.adapter
    stats = _sequential_stats(adapter.n_layers, token_counts, match_original)
    chunks = batches(calib.ids, calib.seq_len)
    run = engine.start(chunks, carry_original=match_original)
    stats.tokens = run.tokens
    first = StatsRequest(
        grams=("normed:layer_in",), cross=(("normed:layer_in", "normed:layer_in"),) if match_original else ()
    )
    apply = _Replacements(engine, run, chunks)

    def module(i: int, like: dict, canon: "_Overlay") -> torch.nn.Module:
        """Layer ``i``'s module with the canonical tensors ``canon`` (norm-folded), built from the
        family's meta skeleton (the original layer's weights are not copied)."""
        return engine.layer_module(i, adapter.write_layer(i, canon, like))

    pending = apply.pending
    kept = _kept_original_sites() if match_original else ()
    for step in run.layers(first, only={0}, keep_original=tuple(s for s in kept if s != "layer_out"), replaced=True):
        i = step.index
        layer = folded[i] if folded is not None else actions.fold_layer_norms(adapter.read_layer(i, step.tensors()))
        canon = _Overlay(layer, engine.dtype)
        like = {adapter.layer_prefix(i) + n: engine.dtype for n, _ in step.module.named_parameters()}
        step.release()
        if i == 0:
            n = step.stats.tokens
            stats.normed[0] = step.stats.grams["normed:layer_in"] / n
            if match_original:
                stats.normed_cross[0] = step.stats.cross[("normed:layer_in", "normed:layer_in")] / n
            step.stats = None
            apply(solve_segment(0, stats), -1, canon)
            if not keep:
                _release(stats, 0, None, None)
        canon.update(pending)
        pending.clear()
        for k, sites, moments, bias in (
            (2 * i + 1, _ATTN_SITES, "attn_out", "o.bias"),
            (2 * i + 2, _FFN_SITES, "mlp_hidden", "down.bias"),
        ):
            partial = module(i, like, canon)
            got = step.collect(_request(sites, match_original), module=partial)
            del partial
            _record(stats, got, sites, k, i, moments, bias=layer[bias] if bias in layer else None)
            del got
            apply(solve_segment(k, stats), i, canon)
            if not keep:
                _release(stats, k, i, moments)
        step.replace(module(i, like, canon))
    return stats


def _sequential_stats(n_layers: int, token_counts: torch.Tensor, match_original: bool) -> CalibrationStats:
    """Empty per-segment statistics for :func:`sequential_weighted` to fill (and the matched targets'
    cross moments with ``match_original``)."""
    n_seg = 2 * n_layers + 1
    stats = CalibrationStats(
        0, token_counts, normed=[None] * n_seg, attn_out=[None] * n_layers, mlp_hidden=[None] * n_layers
    )
    if match_original:
        stats.normed_cross = [None] * n_seg
        for name in ("attn_out_target", "mlp_hidden_target"):
            setattr(stats, name, [None] * n_layers)
    return stats


def _kept_original_sites() -> tuple[str, ...]:
    """The original stream's sites the segments' cross statistics read (besides the layer's output), kept
    from the first pass: the original layer is released before the segments are measured and solved."""
    return tuple(
        sorted({base_site(b) for sites in (_ATTN_SITES, _FFN_SITES) for b in _request(sites, True).original_sites()})
    )


class _Replacements:
    """Puts a solved segment's approximations into the sequential calibration (:func:`sequential_weighted`):
    the embedding's rows into the run's stream, a layer's matrices into its canonical tensors, the next
    layer's solved readers into :attr:`pending` (nothing runs after the head)."""

    def __init__(self, engine, run, chunks):
        self.engine, self.run, self.chunks = engine, run, chunks
        self.pending: dict[str, torch.Tensor] = {}  # canonical weights of the next layer's solved readers

    def __call__(self, replacements, layer: int, canon: Tensors) -> None:
        dtype = self.engine.dtype
        for m, M in replacements:
            if m.canon == "embed":  # the approximation, or its rows (a function of the token ids)
                rows = M if callable(M) else (lambda idx, E=M.to(dtype): E[idx.to(E.device)])
                home = self.run.stream.batches[0].device
                self.run.stream = Activations([rows(b).to(device=home, dtype=dtype) for b in self.chunks])
                continue
            if m.canon == "lm_head":
                continue  # nothing runs after the head
            if callable(M):
                M = M()  # made now: one float64 approximation at a time
            # in the engine's dtype at once: the layer module is built in it (the same values), half the memory
            W = (M if m.role == "reader" else M.T).to(dtype)
            del M
            if m.layer == layer:
                canon[f"{m.canon}.weight"] = W
            elif m.layer == layer + 1:
                self.pending[f"{m.canon}.weight"] = W
            else:
                raise AssertionError(f"segment solve replaced {m.name} out of order (layer {layer})")


class _Overlay(Mapping):
    """A layer's canonical tensors in ``dtype`` as the sequential calibration builds its modules from
    them: the approximations set so far (``canon[key] = W``), over the norm-folded layer, whose other
    tensors are read and cast when a module is built (so nothing but the approximations is held
    between modules)."""

    def __init__(self, layer, dtype: torch.dtype):
        self.layer, self.dtype, self.replaced = layer, dtype, {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.replaced:
            return self.replaced[key]
        return self.layer[key].to(self.dtype)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if key not in self.layer:
            raise KeyError(key)
        self.replaced[key] = value

    def update(self, other: Tensors) -> None:
        for k, v in other.items():
            self[k] = v

    def __iter__(self):
        return iter(self.layer)

    def __len__(self) -> int:
        return len(self.layer)

    def __contains__(self, key) -> bool:
        return key in self.layer


def _release(stats: CalibrationStats, segment: int, layer: int | None, writer_moments: str | None) -> None:
    """Drop segment ``segment``'s statistics (and its writer's, of ``layer``) once it is solved."""
    for name in ("normed", "normed_cross"):
        if getattr(stats, name) is not None:
            getattr(stats, name)[segment] = None
    if writer_moments is not None:
        for name in (writer_moments, writer_moments + "_target"):
            if getattr(stats, name) is not None:
                getattr(stats, name)[layer] = None
