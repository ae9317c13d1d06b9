"""SliceGPT: its rotations and its slice, one piece of code for every output family.

The rotations are eigenvectors of the residual stream's second moments, largest first: from one pass of the
original model (one per segment, or one global one of the trace-normalised sum; a LayerNorm decoder's of its
centred stream), or sequential (segment k's PCA taken of the model whose earlier segments are already
sliced). :func:`slice_into` slices with one global rotation and one width, whatever the output family (a
:class:`SliceOutput`); per-segment rotations and widths are the compressed family's."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from ...architectures import Adapter
from ...calibration import StatsRequest, token_counts
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
    """SliceGPT's one-pass rotations: one per segment, or (``q_mode`` global) the global one for each."""
    if q_mode == "global":
        return [global_rotation(stats)] * n_seg
    return [pca(C) for C in stats.stream]


def global_rotation(stats: CalibrationStats, centred: bool = False) -> torch.Tensor:
    """The PCA of ``Σ_k C_k / tr C_k``. ``centred``: of a LayerNorm decoder's centred model, whose stream
    is ``P x`` (``P = I − 11ᵀ/d``), from the original model's moments: ``C_k`` is ``P C_k P``."""
    if stats.stream_sum is not None and not centred:
        return pca(stats.stream_sum)
    moments = stats.stream
    if centred:
        d = moments[0].shape[0]
        P = torch.eye(d, dtype=torch.float64) - torch.full((d, d), 1.0 / d, dtype=torch.float64)
        moments = (P @ C.to(torch.float64) @ P for C in moments)
    return pca(sum(C / C.trace().clamp_min(1e-300) for C in moments))


def _project(h: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    B = basis.to(device=h.device, dtype=h.dtype)
    return (h @ B) @ B.T


class SlicedLayer(torch.nn.Module):
    """A family's own decoder layer run as SliceGPT's sliced model runs it, in the original basis: its input
    projected onto its segment's kept directions (``basis_in``, ``[d, d']`` orthonormal), the stream after
    attention onto the next segment's once chosen (``basis_mid``), its output left for the next PCA. A hook on
    the attention replaces its output ``a`` by ``P(x̂ + a) − x̂``, so the residual addition gives ``P(x̂ + a)``."""

    def __init__(self, layer: torch.nn.Module, attention_path: str, basis_in: torch.Tensor):
        super().__init__()
        self.layer, self.basis_in, self.basis_mid = layer, basis_in, None
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


def sequential_stream_pca(run: CompressRun, width: int) -> tuple[list[torch.Tensor], CalibrationStats]:
    """SliceGPT as its reference code calibrates: segment k's PCA is taken of the stream of the model whose
    earlier segments are already sliced to ``width``. Returns the rotations and the moments they were taken of
    (``stats.stream``; at full width, those of one pass of the original model)."""
    engine = run.engine()
    attention = engine.adapter.spec.attention.o.rsplit(".", 1)[0]
    n_seg = 2 * engine.adapter.n_layers + 1
    stats = CalibrationStats(0, token_counts([run.ids], int(run.config["vocab_size"])), stream=[None] * n_seg)
    Qs: list[torch.Tensor | None] = [None] * n_seg

    def kept(k: int, got, site: str) -> torch.Tensor:
        """Segment ``k``'s moments (at ``site`` in ``got``) and PCA; its first ``width`` directions."""
        stats.stream[k] = got.grams[site] / got.tokens
        Qs[k] = pca(stats.stream[k])
        return Qs[k][:, :width]

    calibration = engine.start(batches(run.ids, run.seq_len))
    sliced = None
    for step in calibration.layers(StatsRequest(grams=("layer_in",))):
        if sliced is not None:
            sliced.close()  # the previous layer's, run by the engine: unhooked (no cycles kept)
        i = step.index
        sliced = SlicedLayer(step.module, attention, kept(2 * i, step.stats, "layer_in"))
        mid = step.collect(StatsRequest(grams=("ffn_norm_in",)), module=sliced)
        sliced.basis_mid = kept(2 * i + 1, mid, "ffn_norm_in")
        step.replace(sliced)
    sliced.close()
    kept(n_seg - 1, calibration.final(StatsRequest(grams=("final_in",))), "final_in")
    stats.tokens = calibration.tokens
    return Qs, stats


class SliceOutput(ABC):
    """What a SliceGPT output with one global rotation and one width writes (:func:`slice_into` slices)."""

    @abstractmethod
    def plan(
        self, source: TensorSource, config: dict, options: CompressOptions, width: int | None = None
    ) -> tuple[Adapter, int, Accounting]:
        """Refuse what this output cannot hold; the adapter, the residual width (or ``width``), the accounting."""

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
    """SliceGPT with one global rotation and one width, written by ``output`` into ``run.sink``: (config dict,
    report). Every layer is read, centred (a LayerNorm decoder), its norms folded (a tied head untied), rotated
    into the first ``w`` principal directions (readers ``W Q′``, writers ``Q′ᵀ W``, the embeddings ``E Q′``)
    and cut to them. ``width`` overrides the planned width, ``rotation`` the measured ``Q`` (``[d, d]``)."""
    source, config, options = run.source, run.config, run.options
    t0 = time.perf_counter()
    adapter, w, accounting = output.plan(source, config, options, width)
    centred = adapter.spec.norm_kind == "layer"
    tokens = 0
    if rotation is None:  # (the centred moments P C P are normalised each by its own trace: not summed here)
        stats = collect_statistics(run, want_normed=False, want_stream=True, stream_sum=not centred)
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
