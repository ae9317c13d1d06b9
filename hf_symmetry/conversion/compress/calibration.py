"""Step 2, calibration: the second moments the solvers weight by.

One pass of the original model (:func:`collect_statistics`): per residual segment the covariance of the
normalised stream (readers' inputs; rotating the model moves it to ``Qᵀ Σ Q`` exactly, so the "rotated,
uncompressed model" statistics of the paper come from this one pass), the inputs of ``o_proj`` and
``down_proj`` (writers), token counts (``√(D+1)`` weights of the embedding/head) and, for SliceGPT, the
raw stream covariance.

Sequential calibration: segment k's statistics come instead from the model whose segments before k are
already compressed (as SliceGPT and GPTQ calibrate). Stage W: :class:`FoldedLlama`, the norm-folded
model with matrices replaced by their approximations; SliceGPT: :func:`sequential_stream_pca` on the
calibration engine, each decoder layer run as :class:`SlicedLayer` (the stream projected onto the kept
directions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ...architectures import Adapter
from .plan import MatrixPlan

Tensors = dict[str, torch.Tensor]


@dataclass
class CalibrationStats:
    """Per-token second moments in the original basis (float64). Segment ``2i`` is read by layer i's
    attention, ``2i+1`` by its FFN, ``2L`` by the head."""
    tokens: int
    token_counts: torch.Tensor
    normed: list[torch.Tensor] | None = None      # RMSNorm(h) without γ: the folded readers' inputs
    stream: list[torch.Tensor] | None = None      # h itself (SliceGPT's PCA)
    attn_out: list[torch.Tensor] | None = None    # o_proj inputs
    mlp_hidden: list[torch.Tensor] | None = None  # down_proj inputs
    # sequential calibration matching the original model: X̂ᵀX / n, the partly compressed model's inputs
    # (those above) against the original model's at the same place
    normed_cross: list[torch.Tensor] | None = None
    attn_out_cross: list[torch.Tensor] | None = None
    mlp_hidden_cross: list[torch.Tensor] | None = None
    # ... and the writers' inputs X̂ against the residual stream's drift before them, X̂ᵀ(H − Ĥ) / n
    attn_out_drift: list[torch.Tensor] | None = None
    mlp_hidden_drift: list[torch.Tensor] | None = None


def calibration_batches(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``seq_len`` tokens (the last one may be shorter, never below 2): the 1-D
    view of :func:`hf_symmetry.calibration.data.calibration_batches`, which the engine runs."""
    from ...calibration import calibration_batches as batches

    return [b.reshape(-1) for b in batches(ids, seq_len)]


_ONE_PASS_SITES = {"normed": ("normed:layer_in", "normed:ffn_norm_in", "normed:final_in"),
                   "stream": ("layer_in", "ffn_norm_in", "final_in")}


def collect_statistics(source, config: dict, ids: torch.Tensor, seq_len: int, want_normed: bool, want_stream: bool,
                       placement=None, progress: bool = True) -> CalibrationStats:
    """One pass of the original model over ``ids`` in chunks of ``seq_len``, layer by layer from the
    checkpoint (:class:`hf_symmetry.calibration.CalibrationEngine`: one decoder layer in memory at a
    time, on ``placement``'s device): per residual segment the second moments of the normalised and/or
    raw stream, and the inputs of ``o_proj`` and ``down_proj``; ``source`` is a checkpoint reader or
    any tensor source with ``config``."""
    from ...calibration import CalibrationEngine, StatsRequest
    from ...calibration import calibration_batches as batches

    vocab = int(config["vocab_size"])
    stats = CalibrationStats(0, torch.bincount(ids.reshape(-1), minlength=vocab).to(torch.float64)[:vocab])
    if not (want_normed or want_stream):
        stats.tokens = ids.numel()
        return stats
    layer_sites, final_sites = [], []
    for want, kind in ((want_normed, "normed"), (want_stream, "stream")):
        if want:
            layer_sites += _ONE_PASS_SITES[kind][:2]
            final_sites.append(_ONE_PASS_SITES[kind][2])
    if want_normed:
        layer_sites += ["o_in", "down_in"]
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    result = engine.collect(batches(ids, seq_len), StatsRequest(grams=tuple(layer_sites)),
                            final=StatsRequest(grams=tuple(final_sites)))
    stats.tokens = n = result.tokens
    per_segment = lambda site, final: [g for ls in result.layers for g in (ls.grams[site[0]], ls.grams[site[1]])] \
        + [final.grams[site[2]]]  # noqa: E731
    if want_normed:
        stats.normed = [g / n for g in per_segment(_ONE_PASS_SITES["normed"], result.final)]
        stats.attn_out = [ls.grams["o_in"] / n for ls in result.layers]
        stats.mlp_hidden = [ls.grams["down_in"] / n for ls in result.layers]
    if want_stream:
        stats.stream = [g / n for g in per_segment(_ONE_PASS_SITES["stream"], result.final)]
    return stats


def _rms_normalised(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without γ (γ is folded into the readers)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _moment(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token (cross) second moment ``xᵀy / n``, ``y = x`` by default (float32 product, float64 result,
    as :func:`collect_statistics`)."""
    return (x.T @ (x if y is None else y)).double() / x.shape[0]


class FoldedLlama:
    """The norm-folded model (RMSNorm without γ, γ in the readers) in float32 on all calibration batches
    at once, for sequential calibration. With one rotation per residual segment the compressed model
    *is* this model with every compressed matrix replaced by its approximation in the original basis,
    ``Ŵ Qᵀ`` (:meth:`replace`): RMSNorm commutes with the rotations and the skips are exact. :meth:`walk`
    visits the segments in order and measures each one on the model whose earlier segments are
    replaced (and, to match the original model, also runs the original alongside). Memory: the
    calibration activations (tokens × intermediate size), float32, and the approximations of the layer
    being walked; the weights are the caller's tensors, cast per use. One walk per instance."""

    def __init__(self, layers: list[Tensors], globals_: Tensors, adapter: Adapter, model_config: dict,
                 ids: torch.Tensor, seq_len: int):
        from transformers.activations import ACT2FN

        # references to the caller's (float64) tensors, cast per use: no second copy of the model; a
        # layer's entries are dropped once the walk has passed it
        self.weights = {f"{i}.{k}": v for i, lw in enumerate(layers) for k, v in lw.items() if "norm" not in k}
        self.weights["embed.weight"] = globals_["embed.weight"]
        self.original = dict(self.weights)      # replace() rebinds entries of self.weights only
        self.batches = [b.numel() for b in calibration_batches(ids, seq_len)]
        self.ids = ids[: sum(self.batches)]
        self.layout, self.eps, self.n_layers = adapter.layout, adapter.eps, len(layers)
        self.act = ACT2FN[model_config["hidden_act"]]
        self.cos, self.sin = _rope_tables(model_config, max(self.batches))

    def replace(self, m: MatrixPlan, M: torch.Tensor) -> None:
        """Use ``M`` (the solver's ``[k, d]`` orientation, original basis) for the matrix of ``m``."""
        key = f"{m.canon}.weight" if m.layer is None else f"{m.layer}.{m.canon}.weight"
        self.weights[key] = (M if m.role == "reader" or m.canon == "embed" else M.T).float()

    def walk(self, stats: CalibrationStats):
        """Yield the segments ``0, 1, …, 2L`` in order, each once its statistics (``normed``, its writer's
        ``attn_out``/``mlp_hidden``, ``stream`` when asked for, and with ``stats.normed_cross`` set the
        ``*_cross`` and ``*_drift`` moments against the original model) are in ``stats``; the matrices
        replaced before resuming are used from then on (a segment's own writers still count as dense in
        what its statistics measure)."""
        original = self._segments(self.original) if stats.normed_cross is not None else None
        for k, (z, s, h) in enumerate(self._segments(self.weights)):
            writer, i = ("attn_out" if k % 2 else "mlp_hidden"), (k - 1) // 2
            if z is not None and getattr(stats, writer) is not None:
                getattr(stats, writer)[i] = _moment(z)
            if stats.stream is not None:
                stats.stream[k] = _moment(s)
            x = self._norm(s)
            if stats.normed is not None:
                stats.normed[k] = _moment(x)
            if original is not None:
                z0, s0, h0 = next(original)
                stats.normed_cross[k] = _moment(x, self._norm(s0))
                if z is not None:
                    getattr(stats, writer + "_cross")[i] = _moment(z, z0)
                    getattr(stats, writer + "_drift")[i] = _moment(z, h0 - h)
                del z0, s0, h0
            del z, s, h, x
            yield k

    def _segments(self, weights: Tensors):
        """Per segment, in order: (its writer's input, the stream its readers see, the stream before the
        writer — none for the embedding), reading ``weights`` anew after each yield."""
        embed = lambda: weights["embed.weight"][self.ids].float()  # noqa: E731
        yield None, embed(), None
        h = embed()
        weights.pop("embed.weight")
        for i in range(self.n_layers):
            z = self._attention(self._norm(h), i, weights)
            yield z, h + self._linear(z, i, "o", weights), h
            h = h + self._linear(z, i, "o", weights)
            x = self._norm(h)
            u = self.act(self._linear(x, i, "gate", weights)) * self._linear(x, i, "up", weights)
            yield u, h + self._linear(u, i, "down", weights), h
            h = h + self._linear(u, i, "down", weights)
            for key in [k for k in weights if k.startswith(f"{i}.")]:
                del weights[key]

    def _linear(self, x: torch.Tensor, i: int, canon: str, weights: Tensors) -> torch.Tensor:
        y = x @ weights[f"{i}.{canon}.weight"].to(x.dtype).T
        bias = weights.get(f"{i}.{canon}.bias")
        return y if bias is None else y + bias.to(x.dtype)

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_normalised(h, self.eps)

    def _attention(self, x: torch.Tensor, i: int, weights: Tensors) -> torch.Tensor:
        """Causal GQA attention per batch: the inputs of ``o_proj``."""
        L = self.layout
        q, k, v = (self._linear(x, i, c, weights) for c in ("q", "k", "v"))
        out, start = [], 0
        for n in self.batches:
            def heads(t, count):
                return t[start:start + n].view(1, n, count, L.head_dim).transpose(1, 2)
            qh, kh, vh = heads(q, L.n_heads), heads(k, L.n_kv_heads), heads(v, L.n_kv_heads)
            qh, kh = apply_rotary_pos_emb(qh, kh, self.cos[None, :n], self.sin[None, :n])
            groups = L.n_heads // L.n_kv_heads
            kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            out.append(o.transpose(1, 2).reshape(n, -1))
            start += n
        return torch.cat(out)


def _rope_tables(model_config: dict, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin [length, head_dim]`` of the compressed model's rotary embedding."""
    from .assemble import config_object

    rotary = LlamaRotaryEmbedding(config=config_object(model_config))
    cos, sin = rotary(torch.zeros(1, 1, 1), torch.arange(length)[None])
    return cos[0].float(), sin[0].float()


# ---------------------------------------------------------------------------------------------
# sequential SliceGPT on the calibration engine
# ---------------------------------------------------------------------------------------------
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

    def __init__(self, layer: torch.nn.Module, attention_path: str, basis_in: torch.Tensor | None,
                 basis_mid: torch.Tensor | None):
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

    @torch.no_grad()   # calibration only; without it the outputs would keep every layer's autograd graph
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


def sequential_stream_pca(source, config: dict, ids: torch.Tensor, seq_len: int, width: int, placement=None,
                          progress: bool = True) -> tuple[list[torch.Tensor], CalibrationStats]:
    """SliceGPT as its reference code calibrates, layer by layer on the calibration engine: segment k's
    PCA is taken of the stream of the model whose segments before k are already sliced to ``width``
    (each decoder layer runs as :class:`SlicedLayer`). Returns the rotations (one per residual segment)
    and the stream second moments they were taken of (``stats.stream``, before each segment's own
    projection). With ``width`` equal to the hidden size nothing is sliced: the statistics are those of
    one pass of the original model."""
    from ...architectures import Adapter
    from ...calibration import CalibrationEngine, StatsRequest
    from ...calibration import calibration_batches as batches

    adapter = Adapter.from_config(config, source.keys())
    attention = adapter.spec.attention.o.rsplit(".", 1)[0]
    vocab = int(config["vocab_size"])
    n_seg = 2 * adapter.n_layers + 1
    stats = CalibrationStats(0, torch.bincount(ids.reshape(-1), minlength=vocab).to(torch.float64)[:vocab],
                             stream=[None] * n_seg)
    Qs: list[torch.Tensor | None] = [None] * n_seg
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)

    used: list[SlicedLayer] = []     # replacements already run by the engine: unhook them (no cycles kept)

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

    result = engine.collect(batches(ids, seq_len), StatsRequest(grams=("layer_in",)),
                            final=StatsRequest(grams=("final_in",)), on_layer=on_layer)
    while used:
        used.pop().close()
    stats.tokens = result.tokens
    stats.stream[-1] = result.final.grams["final_in"] / result.final.tokens
    Qs[-1] = pca(stats.stream[-1])
    return Qs, stats
