"""Step 3 for SliceGPT, its rotations: eigenvectors of the residual stream's second moments, largest
first, from one pass of the original model (:func:`pca_rotations`: one per segment, or one global one
of the trace-normalised sum) or sequential (:func:`sequential_stream_pca`: segment k's PCA taken of the
model whose earlier segments are already sliced, each decoder layer run as :class:`SlicedLayer`, the
stream projected onto the kept directions)."""

from __future__ import annotations

import torch

from ...architectures import Adapter
from ...calibration import CalibrationEngine, StatsRequest
from ...calibration import token_batches as batches
from .moments import CalibrationStats


def pca_rotations(stats: CalibrationStats, n_seg: int, q_mode: str) -> list[torch.Tensor]:
    """SliceGPT (one pass): eigenvectors of the residual stream's second moment, largest first; one
    per segment, or (``q_mode`` global) one of ``Σ_k C_k / tr C_k`` for every segment."""
    if q_mode == "global":
        total = (
            stats.stream_sum
            if stats.stream_sum is not None
            else sum(C / C.trace().clamp_min(1e-300) for C in stats.stream)
        )
        Q = pca(total)
        return [Q] * n_seg
    return [pca(C) for C in stats.stream]


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
