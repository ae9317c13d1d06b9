"""Check fused-map extraction against the model's own forward, with hooks (docs/math.md §5).

A head-slicing mistake (wrong head rows, wrong KV group, K and V of different heads, as in the
FaRR notebook's DeepSeek code) produces fused maps that look perfectly plausible. So for each
layer we run the real module, capture its input ``X``, its attention probabilities ``α`` and the
input ``Z`` of its output projection, and require for every query head h

* value path: ``α_h X (W_O^h W_V^g)ᵀ + W_O^h b_V^g`` (our fused map, from the canonical layer) to
  equal ``o_proj(Z with only head h's slice kept) − o_proj(0)`` (the module's own output
  projection on the module's own head output), and their sum over heads plus ``b_O`` to equal the
  module's output;
* score path, in layers where QK fusion is exact and no dim is rotary (encoders, NoPE layers): ``softmax([X;1] M_h Xᵀ /
  √d_h + mask)``
  with ``M_h = Q̃_hᵀ W_K^g`` to equal ``α_h``.

The maps are taken unfolded here (the module sees the norm's output, γ included); the conversions
fold γ first with :func:`hf_symmetry.symmetry.actions.fold_layer_norms`, which has its own tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...calibration import CalibrationEngine, StatsRequest
from ...devices import to_model
from ...solvers import fused
from ...symmetry.layout import HeadLayout
from ..layer_parts import attention_modules, module_of, read_part, stand_ins
from ..stream import partition_keys


@dataclass
class LayoutCheck:
    tokens: int
    tolerance: float
    vo_max_rel_error: float = 0.0  # per head contribution, relative to its max magnitude
    total_max_rel_error: float = 0.0  # Σ_h contributions + b_O vs the module's output
    qk_max_abs_error: float | None = None  # attention probabilities; None where QK is not fused
    per_layer: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        errors = [self.vo_max_rel_error, self.total_max_rel_error, self.qk_max_abs_error or 0.0]
        return all(e <= self.tolerance for e in errors)

    def as_dict(self) -> dict:
        return {**self.__dict__, "passed": self.passed}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


class _Capture:
    """Forward hooks that record one layer's attention input, probabilities and O input/output.
    ``model`` is the whole model, or (``prefix=""``) the decoder layer itself."""

    def __init__(self, model, adapter: Adapter, layer: int, prefix: str | None = None):
        a, p = adapter.spec.attention, adapter.layer_prefix(layer) if prefix is None else prefix
        modules = dict(model.named_modules())
        reader = a.q or a.qkv
        self.o_module = modules[p + a.o]
        self.data: dict[str, torch.Tensor] = {}
        self.handles = [
            modules[p + reader].register_forward_pre_hook(lambda m, args: self._keep("x", args[0])),
            self.o_module.register_forward_pre_hook(lambda m, args: self._keep("z", args[0])),
            self.o_module.register_forward_hook(lambda m, args, out: self._keep("out", out)),
            modules[p + reader.rsplit(".", 1)[0]].register_forward_hook(
                lambda m, args, out: self._keep("alpha", out[1])
            ),
        ]

    def _keep(self, name: str, t: torch.Tensor) -> None:
        if t is None:
            raise RuntimeError("the attention module returned no probabilities (eager attention is required)")
        self.data[name] = t.detach()[0]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def check_fused_layout(
    model,
    ids: torch.Tensor,
    layers: list[int] | None = None,
    tolerance: float = 1e-3,
    layout: HeadLayout | None = None,
    progress: bool = False,
) -> LayoutCheck:
    """Compare fused maps with the module's forward on ``ids`` (1-D token ids). ``layout`` overrides
    the adapter's (tests use it for negative controls)."""
    state = model.state_dict()
    adapter = Adapter.from_config(model.config, list(state))
    _, per_layer, _ = partition_keys(adapter, list(state))
    layers = list(range(adapter.n_layers)) if layers is None else layers
    captures = {i: _Capture(model, adapter, i) for i in layers}
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns probabilities
    try:
        model(input_ids=to_model(ids.reshape(1, -1), model))
    finally:
        model.set_attn_implementation(previous)
        for c in captures.values():
            c.remove()
    report = LayoutCheck(tokens=ids.numel(), tolerance=tolerance)
    causal = adapter.spec.is_decoder  # decoders (with an LM head) are causal, encoders are not

    for i in tqdm(layers, desc="layout check", unit="layer", disable=not progress, leave=False):
        layer = adapter.read_layer(i, {k: state[k] for k in per_layer[i]})
        _add_layer(report, i, layer, layout or adapter.layer_layout(i), captures[i], causal)
    return report


@torch.no_grad()
def check_fused_layout_layerwise(
    source,
    ids: torch.Tensor,
    layers: list[int] | None = None,
    tolerance: float = 1e-3,
    layout: HeadLayout | None = None,
    progress: bool = False,
    placement=None,
) -> LayoutCheck:
    """:func:`check_fused_layout` on a checkpoint (a model folder) without loading the model: the
    calibration engine builds one decoder layer at a time as the family's own module (eager
    attention, float32 on the CPU unless ``placement`` says otherwise), runs it on its inputs with the
    hooks on, and only that layer's attention tensors are read for the fused maps."""
    # placement None: the engine's default (devices.default_placement)
    engine = CalibrationEngine(source, placement=placement, progress=progress, attn_implementation="eager")
    adapter = engine.adapter
    wanted = set(range(adapter.n_layers) if layers is None else layers)
    _, per_layer, _ = partition_keys(adapter, engine.keys)
    shapes, attention = engine.source.shapes(), attention_modules(adapter)
    report = LayoutCheck(tokens=ids.numel(), tolerance=tolerance)
    run = engine.start([ids.reshape(1, -1)])
    for step in run.layers(StatsRequest(), stop=max(wanted) + 1):
        i = step.index
        if i not in wanted:
            continue
        capture = _Capture(step.module, adapter, i, prefix="")
        try:
            step.collect(StatsRequest())  # the layer once more on its inputs, the hooks recording
        finally:
            capture.remove()
        step.release()
        # the attention and the vectors (biases, norms) only: the FFN is never read
        keys = [k for k in per_layer[i] if module_of(adapter, i, k) in attention or len(shapes[k]) < 2]
        layer = read_part(adapter, i, stand_ins(per_layer[i], shapes), engine.source.get(keys), torch.float64)
        _add_layer(report, i, layer, layout or adapter.layer_layout(i), capture, adapter.spec.is_decoder)
        del capture, layer, step
    return report


def _add_layer(report: LayoutCheck, i: int, layer: dict, L: HeadLayout, capture: _Capture, causal: bool) -> None:
    """Check layer ``i``'s fused maps (canonical ``layer``) against what ``capture`` recorded. The
    check runs on the host: the model (and so what it recorded) may sit on any device, the canonical
    layer on another; only the output projection runs where it lives (:func:`_o_proj`)."""
    layer = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in layer.items()}
    capture.data = {k: v.cpu() for k, v in capture.data.items()}
    entry = {"layer": i, **_check_vo(layer, L, capture)}
    if fused.qk_fusion_blocker(L) is None and not L.rotary_dim:
        entry["qk_max_abs_error"] = _check_qk(layer, L, capture.data, causal)
        report.qk_max_abs_error = max(report.qk_max_abs_error or 0.0, entry["qk_max_abs_error"])
    report.vo_max_rel_error = max(report.vo_max_rel_error, entry["vo_max_rel_error"])
    report.total_max_rel_error = max(report.total_max_rel_error, entry["total_max_rel_error"])
    report.per_layer.append(entry)


def _check_vo(layer: dict, L: HeadLayout, cap: _Capture) -> dict:
    d = cap.data
    X, alpha, Z = d["x"].double(), d["alpha"].double(), d["z"]
    b_v = layer.get("v.bias")
    zero_out = _o_proj(cap, torch.zeros_like(Z[:1]))  # o_proj's bias (or 0)
    worst, total = 0.0, zero_out[0].clone().expand(X.shape[0], -1).clone()
    for g, pair in enumerate(fused.group_pairs(layer, L, "vo")):
        for j, h in enumerate(L.heads_of_group(g)):
            A_h = pair.block(j)
            mine = alpha[h] @ (X @ (A_h @ pair.B).T)
            if b_v is not None:
                mine = mine + A_h @ b_v[L.rows(g)]
            only_h = torch.zeros_like(Z)
            only_h[:, L.rows(h)] = Z[:, L.rows(h)]
            theirs = _o_proj(cap, only_h) - zero_out
            worst = max(worst, _rel(mine, theirs))
            total += mine
    return {"vo_max_rel_error": worst, "total_max_rel_error": _rel(total, d["out"].double())}


def _o_proj(cap: _Capture, z: torch.Tensor) -> torch.Tensor:
    """The module's own output projection of ``z`` (a host tensor), run on its device, back on the host
    in float64."""
    return cap.o_module(to_model(z, cap.o_module)).double().cpu()


def _check_qk(layer: dict, L: HeadLayout, d: dict, causal: bool) -> float:
    X, alpha = d["x"].double(), d["alpha"].double()
    T = X.shape[0]
    X1 = torch.cat([X, torch.ones(T, 1, dtype=X.dtype)], dim=1) if "q.bias" in layer else X
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1) if causal else None
    worst = 0.0
    for g, pair in enumerate(fused.group_pairs(layer, L, "qk")):
        for j, h in enumerate(L.heads_of_group(g)):
            scores = X1 @ (pair.block(j) @ pair.B) @ X.T / L.head_dim**0.5
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            worst = max(worst, (scores.softmax(-1) - alpha[h]).abs().max().item())
    return worst
