"""SliceGPT: its rotations and its slice, one piece of code for every output family.

The rotations are eigenvectors of the residual stream's second moments, largest first, from one pass of
the original model (:func:`pca_rotations`: one per segment, or one global one of the trace-normalised
sum, :func:`global_rotation`; a LayerNorm decoder's of its centred stream) or sequential
(:func:`sequential_stream_pca`: segment k's PCA taken of the model whose earlier segments are already
sliced, each decoder layer run as :class:`SlicedLayer`, the stream projected onto the kept directions).

One global rotation and one width: :func:`slice_into` slices the tensors (norms folded, a LayerNorm
decoder centred first; every reader ``W Q′``, every writer ``Q′ᵀ W``, the embeddings ``E Q′``) and a
:class:`SliceOutput` says only what is written: the source's own stock family (:mod:`.stock`) or the
RMS-decoder family (:mod:`.layernorm_decoders.slice`). Per-segment rotations and widths are the
compressed family's (:func:`.core.compress_into`, its assembly), from the same :func:`pca_rotations`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from ...architectures import Adapter
from ...calibration import CalibrationEngine, StatsRequest
from ...calibration import token_batches as batches
from ...symmetry import actions
from ..rms_decoder import centre_globals, centre_layer
from ..stream import StreamOptions, TensorSource, transform_checkpoint
from .moments import CalibrationStats, collect_statistics
from .options import CompressOptions
from .plan import Accounting
from .report import CompressReport
from .routes import CompressRun


def pca_rotations(stats: CalibrationStats, n_seg: int, q_mode: str) -> list[torch.Tensor]:
    """SliceGPT (one pass): eigenvectors of the residual stream's second moment, largest first; one
    per segment, or (``q_mode`` global) :func:`global_rotation` for every segment."""
    if q_mode == "global":
        return [global_rotation(stats)] * n_seg
    return [pca(C) for C in stats.stream]


def global_rotation(stats: CalibrationStats, centred: bool = False) -> torch.Tensor:
    """One rotation for the whole stream: eigenvectors of ``Σ_k C_k / tr C_k`` (``stats.stream_sum``
    where calibration kept only that sum). ``centred``: of a LayerNorm decoder's centred model, whose
    stream is ``P x`` (``P = I − 11ᵀ/d``), from the original model's moments: ``C_k`` is ``P C_k P``."""
    if stats.stream_sum is not None and not centred:
        return pca(stats.stream_sum)
    moments = stats.stream
    if centred:
        d = moments[0].shape[0]
        P = torch.eye(d, dtype=torch.float64) - torch.full((d, d), 1.0 / d, dtype=torch.float64)
        moments = (P @ C.to(torch.float64) @ P for C in moments)
    return pca(sum(C / C.trace().clamp_min(1e-300) for C in moments))


def _project(h: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    if basis is None:
        return h
    B = basis.to(device=h.device, dtype=h.dtype)
    return (h @ B) @ B.T


class SlicedLayer(torch.nn.Module):
    """A family's own decoder layer run as SliceGPT's sliced model runs it, in the original basis: the
    incoming stream is projected onto the kept directions of its segment (``basis_in``, ``[d, d']``
    orthonormal), and the stream after attention onto those of the next segment (``basis_mid``; ``None``:
    not yet chosen, left unprojected). The output is the stream after the FFN *before* its own segment's
    projection — what the next segment's PCA is taken of. The mid-layer projection is applied by a
    forward hook on the attention module, which replaces the attention output ``a`` by
    ``P(x̂ + a) − x̂`` so that the layer's own residual addition yields ``P(x̂ + a)``."""

    def __init__(
        self, layer: torch.nn.Module, attention_path: str, basis_in: torch.Tensor | None, basis_mid: torch.Tensor | None
    ):
        super().__init__()
        self.layer, self.basis_in, self.basis_mid = layer, basis_in, basis_mid
        self._x = None
        self._handle = layer.get_submodule(attention_path).register_forward_hook(self._mid)

    def _mid(self, _module, _args, output):
        if self.basis_mid is None:
            return None
        a = output[0] if isinstance(output, tuple) else output
        a = _project(self._x + a, self.basis_mid) - self._x
        return (a, *output[1:]) if isinstance(output, tuple) else a

    @torch.no_grad()  # calibration only; without it the outputs would keep every layer's autograd graph
    def forward(self, hidden_states, *args, **kwargs):
        self._x = _project(hidden_states, self.basis_in)
        try:
            return self.layer(self._x, *args, **kwargs)
        finally:
            self._x = None

    def get_submodule(self, target: str) -> torch.nn.Module:
        """The wrapped layer's modules by their own paths (the engine hooks its sites on them)."""
        return self.layer.get_submodule(target) if target else self

    def close(self) -> None:
        self._handle.remove()
        self.layer = None


def pca(C: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a second moment, largest eigenvalue first."""
    lam, V = torch.linalg.eigh((C + C.T) / 2)
    return V[:, torch.argsort(lam, descending=True)]


def sequential_stream_pca(
    source, config: dict, ids: torch.Tensor, seq_len: int, width: int, placement=None, progress: bool = True
) -> tuple[list[torch.Tensor], CalibrationStats]:
    """SliceGPT as its reference code calibrates, layer by layer on the calibration engine: segment k's
    PCA is taken of the stream of the model whose segments before k are already sliced to ``width``
    (each decoder layer runs as :class:`SlicedLayer`). Returns the rotations (one per residual segment)
    and the stream second moments they were taken of (``stats.stream``, before each segment's own
    projection). With ``width`` equal to the hidden size nothing is sliced: the statistics are those of
    one pass of the original model."""
    adapter = Adapter.from_config(config, source.keys())
    attention = adapter.spec.attention.o.rsplit(".", 1)[0]
    vocab = int(config["vocab_size"])
    n_seg = 2 * adapter.n_layers + 1
    stats = CalibrationStats(
        0, torch.bincount(ids.reshape(-1), minlength=vocab).to(torch.float64)[:vocab], stream=[None] * n_seg
    )
    Qs: list[torch.Tensor | None] = [None] * n_seg
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)

    used: list[SlicedLayer] = []  # replacements already run by the engine: unhook them (no cycles kept)

    def on_layer(step):
        while used:
            used.pop().close()
        i, n = step.index, step.stats.tokens
        stats.stream[2 * i] = step.stats.grams["layer_in"] / n
        Qs[2 * i] = pca(stats.stream[2 * i])
        probe = SlicedLayer(step.module, attention, Qs[2 * i][:, :width], None)
        try:
            mid = step.collect(StatsRequest(grams=("ffn_norm_in",)), module=probe)
        finally:
            probe.close()
        stats.stream[2 * i + 1] = mid.grams["ffn_norm_in"] / mid.tokens
        Qs[2 * i + 1] = pca(stats.stream[2 * i + 1])
        used.append(SlicedLayer(step.module, attention, Qs[2 * i][:, :width], Qs[2 * i + 1][:, :width]))
        return used[-1]

    result = engine.collect(
        batches(ids, seq_len),
        StatsRequest(grams=("layer_in",)),
        final=StatsRequest(grams=("final_in",)),
        on_layer=on_layer,
    )
    while used:
        used.pop().close()
    stats.tokens = result.tokens
    stats.stream[-1] = result.final.grams["final_in"] / result.final.tokens
    Qs[-1] = pca(stats.stream[-1])
    return Qs, stats


class SliceOutput(ABC):
    """What a SliceGPT output with one global rotation and one width is: its family's width and parameter
    accounting (:meth:`plan`), its config and how its tensors are written (:meth:`output`, which also fixes
    what :meth:`finish_layer` / :meth:`finish_globals` change in the sliced tensors) and its name in the
    report (:meth:`method`). The slice itself is :func:`slice_into`'s, the same for every output."""

    @abstractmethod
    def plan(
        self, source: TensorSource, config: dict, options: CompressOptions, width: int | None = None
    ) -> tuple[Adapter, int, Accounting]:
        """Refuse what this output cannot hold; the source's adapter, the residual width (``width`` given:
        that one) and the parameter accounting."""

    @abstractmethod
    def output(
        self, source: TensorSource, adapter: Adapter, config: dict, width: int, accounting: Accounting
    ) -> tuple[dict, StreamOptions]:
        """The output's config dict and how its tensors are written (``accounting`` completed)."""

    def finish_layer(self, layer: dict) -> dict:
        """A sliced layer as this family holds it."""
        return layer

    def finish_globals(self, g: dict) -> dict:
        """The sliced globals as this family holds them."""
        return g

    @abstractmethod
    def method(self, accounting: Accounting) -> str:
        """What the report says the output is."""


def slice_into(
    run: CompressRun, output: SliceOutput, width: int | None = None, rotation: torch.Tensor | None = None
) -> tuple[dict, CompressReport]:
    """SliceGPT with one global rotation and one width on ``run`` (a :class:`.routes.CompressRun`, its options
    validated by the caller), written by ``output`` into ``run.sink``: (config dict, report). One pass of the
    original model measures the stream's second moments (a LayerNorm decoder's: of its centred stream,
    :func:`global_rotation`); every layer is then read, its norms folded (a LayerNorm decoder's writers
    centred first, its head untied as the centring needs; a tied head of the others untied too), rotated
    into the first ``w`` principal directions and cut to them. ``width`` overrides the planned width,
    ``rotation`` the measured ``Q`` (``[d, d]``, principal directions first)."""
    source, config, options = run.source, run.config, run.options
    t0 = time.perf_counter()
    adapter, w, accounting = output.plan(source, config, options, width)
    centred = adapter.spec.norm_kind == "layer"
    tokens = 0
    if rotation is None:
        stats = collect_statistics(
            run,
            want_normed=False,
            want_stream=True,
            progress=run.progress,
            stream_sum=not centred,  # the centred moments P C P are normalised each by its own trace
        )
        rotation, tokens = global_rotation(stats, centred), stats.tokens
        del stats
    t1 = time.perf_counter()
    Qw = rotation[:, :w].to(torch.float64).contiguous()
    new_config, stream = output.output(source, adapter, config, w, accounting)

    def layer_fn(_i, layer):
        layer = centre_layer(layer) if centred else layer
        return output.finish_layer(actions.rotate_residual_layer(actions.fold_layer_norms(layer), Qw))

    def globals_fn(g):
        g = centre_globals(g) if centred else dict(g)
        if "lm_head.weight" not in g:  # tied: untied here, the final norm's γ folds into it
            g["lm_head.weight"] = g["embed.weight"].clone()
        return output.finish_globals(actions.rotate_residual_globals(actions.fold_final_norm(g), Qw))

    transform_checkpoint(source, adapter, run.sink, layer_fn, globals_fn, run.progress, "slice", stream)
    report = CompressReport(
        source="",
        output=None,
        family=adapter.family,
        options=options.as_dict(run.calibration),
        accounting=accounting,
        relative_errors={},
        objective={},
        calibration_tokens=tokens,
        seconds={"calibration": t1 - t0, "solve": 0.0, "assemble": time.perf_counter() - t1},
        method=f"{options.label}, {output.method(accounting)}",
    )
    return new_config, report
