"""The reduction pass (:func:`run_farr`): after the analysis and the rank plan, each layer's fused maps
are truncated and split back (:func:`reduce_layer`), the FFN passes through with the pre-norm's γ
folded in, and the tensors go to a sink one layer at a time; with the run's :class:`FarrReport`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...calibration.memory import release_free_memory
from ...solvers import fused
from ...symmetry.actions import fold_norm
from ..layer_parts import ffn_modules, module_of, read_part, stand_ins
from ..stream import Tensors, TensorSource, partition_keys
from .analysis import LayerAnalysis, weights_to, analyze, prepare_layer
from .calibrated import LayerWeights
from .options import FarrOptions
from .ranks import plan_ranks
from .target import FarrTarget, farr_target, qk_layers


@dataclass
class FarrReport:
    source: str
    output: str | None
    model_type: str
    options: dict
    ranks: dict[str, list[int | None]]  # None: that layer's path kept whole (RoPE layers' query/key)
    head_dim: int
    kept_energy: dict[str, list[list[float] | None]] = field(default_factory=dict)  # path -> layer -> per group
    touchable_params_before: int = 0
    touchable_params_after: int = 0
    params_before: int = 0
    params_after: int = 0
    notes: list[str] = field(default_factory=list)
    calibration: dict | None = None  # text and tokens of the activation-aware metric
    seconds: float = 0.0
    verification: dict = field(default_factory=dict)

    @property
    def touchable_kept_fraction(self) -> float:
        return self.touchable_params_after / self.touchable_params_before

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["touchable_kept_fraction"] = self.touchable_kept_fraction
        return d


def reduce_layer(
    layer: Tensors,
    adapter: Adapter,
    target: FarrTarget,
    options: FarrOptions,
    ranks: dict[str, int | None],
    weights: fused.InputWeights | None = None,
    layout=None,
) -> tuple[Tensors, dict[str, list[float] | None]]:
    """One layer of the FaRR model, canonical form (``layout``: this layer's, default the model's).
    The bias rewrites apply whether or not their path is reduced, because the FaRR architecture has
    no value (and, for encoders, key) bias. Data-free, the maps are truncated with the pre-norm γ
    folded in (measured on the normalised stream); calibrated, on the module's input (γ included),
    and γ is folded afterwards. A path whose rank is None is kept whole."""
    L = layout or adapter.layout
    if weights is None:
        layer = prepare_layer(layer, adapter)
    layer = fused.fold_value_bias(layer, L)
    if target.encoder:
        layer = fused.drop_key_bias(layer, L)
    kept = {}
    if options.vo:
        layer, red = fused.reduce_vo(layer, L, ranks["vo"], options.basis, weights)
        kept["vo"] = red.kept_energy
    if options.qk:
        kept["qk"] = None
        if ranks["qk"] is not None:
            layer, red = fused.reduce_qk(layer, L, ranks["qk"], options.basis, weights)
            kept["qk"] = red.kept_energy
            if target.k_bias:  # the decoder's k_proj has a bias on every layer; b_K is exactly 0 here
                layer["k.bias"] = torch.zeros(layer["k.weight"].shape[0], dtype=layer["k.weight"].dtype)
    return prepare_layer(layer, adapter) if weights is not None else layer, kept


def run_farr(
    source: TensorSource,
    config: dict,
    options: FarrOptions,
    sink,
    progress: bool,
    weights: LayerWeights | None = None,
    analysis: list[LayerAnalysis] | None = None,
    device: torch.device | str = "cpu",
):
    """The two passes. Calibrated: ``weights`` (:meth:`LayerWeights.from_moments`: the metrics are computed
    here and kept in memory), or ``weights`` with the ``analysis`` of :func:`calibrated_analysis`. The
    truncations run on ``device``."""
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    target = farr_target(adapter, config, keys, options)
    if analysis is None:
        analysis = analyze(source, adapter, options.paths, progress=progress, weights=weights, device=device)
    plan = plan_ranks(analysis, options, target)
    kept: dict[str, list[list[float]]] = {p: [] for p in options.paths}
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    release_free_memory()  # the analysis' temporaries, before the vocabulary-sized reads
    # the globals pass through unchanged, one tensor at a time (vocabulary-sized: no copy of them is made)
    for key in global_keys:
        sink.add(source.get([key]))
    shapes, dtypes = source.shapes(), _dtypes(source)
    ffn = ffn_modules(adapter)
    for i in tqdm(range(adapter.n_layers), desc="farr", disable=not progress, unit="layer"):
        release_free_memory()  # the previous layer's temporaries
        like = {k: dtypes[k] for k in per_layer[i]}
        stand = stand_ins(per_layer[i], shapes, dtypes)
        # the attention and the norms, in float64: what FaRR rewrites
        keys_a = [k for k in per_layer[i] if module_of(adapter, i, k) not in ffn]
        raw = source.get(keys_a)
        modeled = adapter.modeled_layer_keys(i)
        passthrough = {k: v for k, v in raw.items() if k not in modeled}  # rotary buffers
        layer = read_part(adapter, i, stand, raw, torch.float64)
        ffn_norm = {k: layer[f"ffn_norm.{k}"] for k in ("weight", "bias") if f"ffn_norm.{k}" in layer}
        w = weights_to(weights[i], device) if weights else None
        new, k = reduce_layer(
            {n: t.to(device) for n, t in layer.items()},
            adapter,
            target,
            options,
            {p: plan.ranks[p][i] for p in options.paths},
            w,
            adapter.layer_layout(i),
        )
        for p, v in k.items():
            kept[p].append(v)
        sink.add({**passthrough, **adapter.write_layer(i, {n: t.cpu() for n, t in new.items()}, like)})
        del layer, new, w, raw, passthrough
        # the FFN, one module at a time in its own dtype: unchanged, but for the pre-norm's γ folded
        # into gate/up (as reduce_layer folds it on a whole layer), a block of rows at a time
        fold = ffn_norm if adapter.spec.norm_position == "pre" and "weight" in ffn_norm else None
        for module in sorted({module_of(adapter, i, k) for k in per_layer[i]} & ffn):
            names = [k for k in per_layer[i] if module_of(adapter, i, k) == module]
            part = read_part(adapter, i, stand, source.get(names), None)
            if fold is not None:
                part = _fold_ffn_norm(part, fold["weight"], fold.get("bias"))
            sink.add(adapter.write_layer(i, part, like))
            del part
    if rest:
        sink.add(source.get(rest))
    farr_config = target.make_config(plan.ranks.get("vo"), plan.ranks.get("qk"))
    return farr_config, _report(adapter, options, plan, kept, farr_config.model_type), analysis


def _report(adapter: Adapter, options: FarrOptions, plan, kept: dict, model_type: str) -> FarrReport:
    """The run's report, before the entry points add the source, output and parameter counts."""
    report = FarrReport(
        source="",
        output=None,
        model_type=model_type,
        options=dataclasses.asdict(options),
        head_dim=adapter.layout.head_dim,
        ranks={p: [adapter.layout.head_dim if r is None else r for r in rs] for p, rs in plan.ranks.items()},
        kept_energy=kept,
        touchable_params_before=plan.touchable_before,
        touchable_params_after=plan.touchable_after,
    )
    report.notes += _qk_notes(adapter, options)
    return report


def _dtypes(source: TensorSource) -> dict[str, torch.dtype]:
    """Every tensor's stored dtype (from the headers of a checkpoint; an in-memory source's tensors)."""
    if hasattr(source, "dtypes"):
        return source.dtypes()
    return {k: t.dtype for k, t in source.get(source.keys()).items()}


def _fold_ffn_norm(part: Tensors, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 1024) -> Tensors:
    """:func:`~hf_symmetry.symmetry.actions.fold_norm` of a pre-norm (float64 ``weight``, ``bias``) into
    the gate/up tensors of ``part`` (canonical, any dtype), in float64 a block of ``rows`` rows at a
    time; results in each tensor's own dtype. Element for element the whole-tensor fold (each row
    is folded on its own), without a float64 copy of the matrix."""
    out = dict(part)
    for n in ("gate", "up"):
        W = part.get(f"{n}.weight")
        if W is None:
            continue
        new_w = torch.empty_like(W)
        b = part.get(f"{n}.bias")
        new_b = None if bias is None else torch.empty(W.shape[0], dtype=torch.float64)  # cast once, when written
        for r in range(0, W.shape[0], rows):
            block = {f"{n}.weight": W[r : r + rows].to(torch.float64)}
            if b is not None:
                block[f"{n}.bias"] = b[r : r + rows].to(torch.float64)
            block = fold_norm(block, (n,), weight, bias)
            new_w[r : r + rows] = block[f"{n}.weight"]
            if new_b is not None:
                new_b[r : r + rows] = block[f"{n}.bias"]
        out[f"{n}.weight"] = new_w
        if new_b is not None:
            out[f"{n}.bias"] = new_b
    return out


def _qk_notes(adapter: Adapter, options: FarrOptions) -> list[str]:
    layers = qk_layers(adapter)
    if not layers:
        return [f"query/key kept at full size: {fused.qk_fusion_blocker(adapter.layout)}"]
    partly = len(layers) < adapter.n_layers
    if not options.qk:
        return [
            "query/key kept at full size (pass qk=True / --qk to reduce them too"
            + (f", on the NoPE layers {layers})" if partly else ")")
        ]
    if partly:
        return [
            f"query/key reduced on the NoPE layers {layers} only; the other layers rotate every query/key dim "
            "with RoPE, so their score map cannot be fused and they keep the full head dim"
        ]
    return []


INDEX_BUFFERS = ("position_ids", "token_type_ids")  # index buffers some BERT checkpoints carry, not parameters


def state_dict_parameters(tensors: Tensors, tied: bool = False) -> int:
    """Parameters in ``tensors``; a tied ``lm_head`` (present in in-memory state dicts) is the
    embedding, counted once."""
    return sum(
        t.numel() for k, t in tensors.items() if not k.endswith(INDEX_BUFFERS) and not (tied and k == "lm_head.weight")
    )
