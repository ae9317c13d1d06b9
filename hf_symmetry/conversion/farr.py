"""FaRR (fuse and rank reduce, docs/math.md §5): analyse the fused attention maps of a checkpoint and
write a model with smaller per-layer head dims.

Two streaming passes over the checkpoint: the first reads each layer, folds its pre-norm γ
(pre-LN families) and keeps only the singular values of each KV group's fused maps, from which
the per-layer ranks are chosen; the second truncates, splits back with ``√Σ`` on each side and
writes the layer. Ranks: ``τ`` gives each KV group the smallest rank keeping a fraction τ of its
fused energy and each layer the largest of its groups (batched attention needs one head dim per
layer); a parameter fraction spends a global budget greedily on the rank increments that keep
the most relative energy per parameter.

The output is a FaRR model (:mod:`hf_symmetry.modeling.modeling_farr`): the stock Llama-family
decoder or BERT/RoBERTa encoder with per-layer head dims, saved with its remote code.

Beyond the seed: the data-free Frobenius metric ignores which input directions real activations
use, and on SmolLM2 its smallest fused directions turn out to matter (see BENCHMARKS.md). With
calibration (:func:`attention_input_moments`), each map is measured by its output energy on the
model's own attention inputs (:class:`fused.InputWeights`) and truncated in that metric: same
architecture and parameter count, far smaller loss. Calibrated, the first pass is the layer-wise
calibration engine's (:func:`calibrated_analysis`): each layer's input moments become its metric
(eigendecomposition on ``--device``) and its spectra as the engine reaches it; the metrics wait
for the second pass in files next to the output (:class:`LayerWeights`), so host memory is one
layer's worth whatever the depth.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter
from ..architectures.capabilities import require
from ..calibration.memory import release_free_memory
from ..checkpoint import (CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, copy_side_files,
                          parse_size)
from ..evaluation.compare import write_json
from ..hub.cards import count_parameters, public_model_label, public_report, write_card
from ..modeling import configuration_farr, modeling_farr
from ..modeling.configuration_farr import qk_parameters, vo_parameters
from ..symmetry import fused
from ..symmetry.actions import fold_layer_norms, fold_norm
from .layer_parts import attention_modules, ffn_modules, module_of, read_part, stand_ins
from .stream import DictSink, DictSource, TensorSource, partition_keys

Tensors = dict[str, torch.Tensor]
REPORT_FILE = "farr_report.json"


# ---------------------------------------------------------------------- options
@dataclass(frozen=True)
class FarrOptions:
    """Exactly one of ``tau`` (per-group energy threshold) and ``params_fraction`` (the fraction of the
    parameters of the projections FaRR rewrites that the result keeps: ``v_proj`` + ``o_proj`` with
    ``vo``, ``q_proj`` + ``k_proj`` with ``qk``; weights and biases, all layers). ``basis`` other than
    ``"fused"`` selects the single-factor baselines of the benchmark (see :func:`fused.factor_basis_split`)."""
    tau: float | None = None
    params_fraction: float | None = None
    vo: bool = True
    qk: bool = False
    basis: fused.Basis = "fused"

    def validate(self) -> None:
        if (self.tau is None) == (self.params_fraction is None):
            raise ValueError("give exactly one of tau (energy threshold) and params_fraction (parameter budget)")
        if self.tau is not None:
            fused.check_tau(self.tau)
        if self.params_fraction is not None and not 0.0 < self.params_fraction <= 1.0:
            raise ValueError(f"params_fraction must be in (0, 1], got {self.params_fraction}")
        if not (self.vo or self.qk):
            raise ValueError("nothing to reduce: enable the value/output path, the query/key path or both")
        if self.basis not in ("fused", "input", "output"):
            raise ValueError(f"unknown basis {self.basis!r}; choose fused, input or output")

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, on in (("vo", self.vo), ("qk", self.qk)) if on)


# ---------------------------------------------------------------------- target family
@dataclass(frozen=True)
class FarrTarget:
    """What the FaRR model of a source checkpoint looks like (facts read from config and keys)."""
    kind: str                  # "decoder" or "encoder"
    source_config: dict        # normalised by the source's own config class
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    q_bias: bool
    k_bias: bool               # after FaRR: encoders drop it (exact without RoPE)
    o_bias: bool               # after FaRR: holds the folded value bias
    qk_norm: bool
    mlp_bias: bool

    def path_params(self, path: str, rank: int) -> int:
        """Parameters of one layer's rewritten projections for ``path`` at ``rank``."""
        if path == "vo":
            return vo_parameters(self.hidden, self.n_heads, self.n_kv, rank, self.o_bias)
        return qk_parameters(self.hidden, self.n_heads, self.n_kv, rank, self.q_bias, self.k_bias)

    def make_config(self, vo_dims: list[int] | None, qk_dims: list[int] | None):
        cfg = {k: v for k, v in self.source_config.items()
               if k not in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")}
        if self.kind == "decoder":
            fields = {f.name for f in dataclasses.fields(configuration_farr.FarrLlamaConfig)}
            cfg = {k: v for k, v in cfg.items() if k in fields or k.endswith("_token_id")}
            cfg.update(attention_bias=self.q_bias, o_bias=self.o_bias, qk_norm=self.qk_norm, mlp_bias=self.mlp_bias,
                       head_dim=self.head_dim, num_key_value_heads=self.n_kv, v_head_dims=vo_dims,
                       qk_head_dims=[self.head_dim if r is None else r for r in qk_dims] if qk_dims else None)
            config = configuration_farr.FarrLlamaConfig(**cfg)
        else:
            from transformers import CONFIG_MAPPING

            source_class = CONFIG_MAPPING[self.source_config["model_type"]]   # the FaRR encoder of that class
            cls = next(c for c in (configuration_farr.FarrRobertaConfig, configuration_farr.FarrBertConfig)
                       if issubclass(c, source_class))
            config = cls(**cfg, qk_head_dims=qk_dims, v_head_dims=vo_dims)
        config.architectures = [next(iter(_classes_for(config).values())).__name__]
        return config


def _normalised_config(config) -> dict:
    """The source config as its own transformers class writes it (legacy keys such as a top-level
    ``rope_theta`` become ``rope_parameters``)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(config, dict):
        return config.to_dict()
    return CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)).to_dict()


def farr_target(adapter: Adapter, config: dict, keys: list[str], options: FarrOptions) -> FarrTarget:
    """The FaRR family for this checkpoint; refuses, before any work, what FaRR cannot do exactly."""
    options.validate()
    model_type = config.get("model_type")
    require(adapter, "farr_vo")   # the FaRR families can express this checkpoint (else: the structural reason)
    src = _normalised_config(config)
    encoder = not adapter.spec.is_decoder
    if encoder:
        if adapter.prefix:
            raise ValueError(f"this {model_type} checkpoint wraps the encoder under {adapter.prefix!r} with a task head; "
                             "FaRR encoders are base models: convert the base model")
        if src.get("is_decoder") or src.get("add_cross_attention"):
            raise ValueError("FaRR encoders do not support is_decoder / add_cross_attention BERT models")
    L = adapter.layout
    if options.qk:
        layers = qk_layers(adapter)
        if not layers:
            raise ValueError(f"--qk is not possible for {model_type}: {fused.qk_fusion_blocker(L)}; reduce V/O only")
        if any(adapter.layer_layout(i).rotary_dim for i in layers):
            raise ValueError(f"--qk is not possible for {model_type}: partially rotary heads are not supported "
                             "(the FaRR decoder applies RoPE to whole heads); reduce V/O only")
    has = lambda module, kind="bias": f"{adapter.layer_prefix(0)}{module}.{kind}" in set(keys)  # noqa: E731
    a, f = adapter.spec.attention, adapter.spec.ffn
    return FarrTarget(
        kind="encoder" if encoder else "decoder", source_config=src, hidden=adapter.hidden,
        n_heads=L.n_heads, n_kv=L.n_kv_heads, head_dim=L.head_dim, q_bias=has(a.q),
        k_bias=has(a.k) and not encoder, o_bias=has(a.o) or has(a.v), qk_norm=L.qk_norm,
        mlp_bias=has(f.up))


def _qk_fusable(layout) -> bool:
    return fused.qk_fusion_blocker(layout) is None


def qk_layers(adapter: Adapter) -> list[int]:
    """Layers with a fusable score map: no QK-norm and some query/key dims RoPE leaves alone
    (encoders, NoPE layers such as SmolLM3's every 4th, the free dims of partially rotary heads)."""
    return [i for i in range(adapter.n_layers) if _qk_fusable(adapter.layer_layout(i))]


# ---------------------------------------------------------------------- analysis pass
def prepare_layer(layer: Tensors, adapter: Adapter) -> Tensors:
    """Fold the pre-norms' γ (and β) into their readers, so the fused maps act on the normalised
    stream. Post-LN encoders read the residual stream itself: nothing to fold."""
    return fold_layer_norms(layer) if adapter.spec.placement == "pre" else layer


@dataclass
class LayerAnalysis:
    layer: int
    spectra: dict[str, list[fused.GroupSpectrum]]   # only the paths FaRR can reduce in this layer
    touchable: dict[str, int]    # parameters of the original projections of each of those paths


_PATH_TENSORS = {"vo": ("v.weight", "v.bias", "o.weight", "o.bias"), "qk": ("q.weight", "q.bias", "k.weight", "k.bias")}


def analyze(source: TensorSource, adapter: Adapter, paths: tuple[str, ...], detail: bool = False,
            progress: bool = True, weights=None, device: torch.device | str = "cpu") -> list[LayerAnalysis]:
    """Spectra of every layer's fused maps, one layer in memory at a time (SVDs on ``device``). With
    ``weights`` (calibration; ``weights[i]`` is layer i's :class:`fused.InputWeights`), the maps are
    measured on the module's actual input, so γ is not folded."""
    _, per_layer, _ = partition_keys(adapter, source.keys())
    shapes, ffn = source.shapes(), ffn_modules(adapter)
    out = []
    for i in tqdm(range(adapter.n_layers), desc="fused spectra", disable=not progress, unit="layer"):
        # the attention and the norms (γ folds into q/k/v); the FFN is never read
        keys = [k for k in per_layer[i] if module_of(adapter, i, k) not in ffn]
        layer = read_part(adapter, i, stand_ins(per_layer[i], shapes), source.get(keys), torch.float64)
        out.append(analyze_layer(i, layer, adapter, paths, detail,
                                 _weights_to(weights[i], device) if weights else None, device))
        del layer
    return out


def analyze_layer(i: int, layer: Tensors, adapter: Adapter, paths: tuple[str, ...], detail: bool = False,
                  w: fused.InputWeights | None = None, device: torch.device | str = "cpu") -> LayerAnalysis:
    """Spectra of layer ``i``'s fused maps (canonical tensors), computed on ``device`` (with ``w`` there
    too), returned on the CPU."""
    layer = prepare_layer(layer, adapter) if w is None else layer
    touchable = {p: sum(layer[k].numel() for k in _PATH_TENSORS[p] if k in layer) for p in paths}
    layer = {k: v.to(device) for k, v in layer.items()}
    layout = adapter.layer_layout(i)
    here = [p for p in paths if p == "vo" or _qk_fusable(layout)]
    spectra = {p: [_spectrum_to_cpu(g) for g in fused.group_spectra(layer, layout, p, detail, w)] for p in here}
    return LayerAnalysis(i, spectra, {p: touchable[p] for p in here})


def _spectrum_to_cpu(g: fused.GroupSpectrum) -> fused.GroupSpectrum:
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return dataclasses.replace(g, S=cpu(g.S), factor_S=None if g.factor_S is None else tuple(map(cpu, g.factor_S)),
                               head_S=None if g.head_S is None else [cpu(t) for t in g.head_S])


# ---------------------------------------------------------------------- calibrated analysis
class LayerWeights:
    """Each layer's activation-aware metric (:class:`fused.InputWeights`), from the calibration pass
    to the reduction pass: in safetensors files in ``folder`` (one layer in memory at a time), or
    in memory when ``folder`` is None (the in-memory API). ``weights[i]`` reads layer i's."""
    _FIELDS = ("root", "inv_root", "root_aug", "inv_root_aug")

    def __init__(self, folder: str | Path | None = None):
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._memory: dict[int, fused.InputWeights] = {}
        self._layers: set[int] = set()

    def _file(self, i: int) -> Path:
        return self.folder / f"layer-{i:05d}.safetensors"

    def put(self, i: int, w: fused.InputWeights) -> None:
        from safetensors.torch import save_file

        tensors = {f: getattr(w, f).cpu().contiguous() for f in self._FIELDS if getattr(w, f) is not None}
        if self.folder is None:
            self._memory[i] = fused.InputWeights(**{f: tensors.get(f) for f in self._FIELDS})
        else:
            save_file(tensors, self._file(i))
        self._layers.add(i)

    def __getitem__(self, i: int) -> fused.InputWeights:
        if self.folder is None:
            return self._memory[i]
        from safetensors.torch import load_file

        tensors = load_file(self._file(i))
        return fused.InputWeights(**{f: tensors.get(f) for f in self._FIELDS})

    def __len__(self) -> int:
        return len(self._layers)

    def close(self) -> None:
        """Delete the files (the folder)."""
        self._memory.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _weights_to(w: fused.InputWeights, device) -> fused.InputWeights:
    return fused.InputWeights(*(None if t is None else t.to(device) for t in (w.root, w.inv_root, w.root_aug,
                                                                              w.inv_root_aug)))


def calibrated_analysis(model, ids: torch.Tensor, paths: tuple[str, ...], placement=None, progress: bool = False,
                        config: dict | None = None, detail: bool = False, store: LayerWeights | None = None,
                        window: int = 512) -> list[LayerAnalysis]:
    """The calibrated first pass, in one run of the layer-wise calibration engine: per layer, the
    attention input's moments ``E[x xᵀ]``, ``E[x]`` over ``ids`` (windows of ``window`` tokens)
    become its :class:`fused.InputWeights` (eigendecompositions in float64 on ``placement``'s
    device), then that layer's fused spectra; with ``store`` the weights are kept there for the
    reduction pass. Nothing but the spectra outlives a layer.

    ``model``: an HF model folder, a tensor source with its ``config``, or an in-memory model."""
    from ..calibration import StatsRequest, calibration_batches
    from ..devices import linalg_device

    engine = _engine(model, config, placement, progress)
    device = linalg_device(engine.placement)
    engine.stats_device = device
    adapter = engine.adapter
    _, per_layer, _ = partition_keys(adapter, engine.keys)
    window = min(window, engine.config.get("max_position_embeddings") or window)
    run = engine.start(calibration_batches(ids, window))
    shapes = engine.source.shapes()
    out = []
    for step in run.layers(StatsRequest(grams=("v_in",), sums=("v_in",))):
        step.release()   # its outputs are handed on: free the engine's layer before this layer's work
        i = step.index
        w = fused.InputWeights.from_moments(step.stats.second_moment("v_in"), step.stats.mean("v_in"),
                                            augmented="qk" in paths)
        del step
        # only the attention's tensors are read (the rest of the layer stands in on the meta device)
        keys = [k for k in per_layer[i] if module_of(adapter, i, k) in attention_modules(adapter)]
        layer = {k: t for k, t in read_part(adapter, i, stand_ins(per_layer[i], shapes), engine.source.get(keys),
                                             torch.float64).items() if k.split(".")[0] in ("q", "k", "v", "o")}
        out.append(analyze_layer(i, layer, adapter, paths, detail, w, device))
        if store is not None:
            store.put(i, w)
        del w, layer
    return out


def _engine(model, config, placement, progress):
    from ..calibration import CalibrationEngine

    if isinstance(model, (str, Path)) or config is not None:
        return CalibrationEngine(model, config, placement=placement, progress=progress)
    return CalibrationEngine(DictSource(model.state_dict()), model.config.to_dict(), placement=placement,
                             progress=progress)


# ---------------------------------------------------------------------- rank selection
@dataclass
class RankPlan:
    ranks: dict[str, list[int | None]]   # path -> rank per layer (None: the layer keeps that path whole)
    touchable_before: int                # parameters of the rewritten projections, original
    touchable_after: int                 # ... and in the FaRR model

    @property
    def kept_fraction(self) -> float:
        return self.touchable_after / self.touchable_before


def ranks_for_tau(analysis: list[LayerAnalysis], path: str, tau: float) -> list[int | None]:
    """Per layer: the largest per-group effective rank at τ (at least 1); None where the layer's
    ``path`` cannot be reduced."""
    return [max([1] + [fused.effective_rank(g.S, tau) for g in a.spectra[path]]) if path in a.spectra else None
            for a in analysis]


def plan_ranks(analysis: list[LayerAnalysis], options: FarrOptions, target: FarrTarget) -> RankPlan:
    paths = options.paths
    before = sum(a.touchable.get(p, 0) for a in analysis for p in paths)
    if options.tau is not None:
        ranks = {p: ranks_for_tau(analysis, p, options.tau) for p in paths}
    else:
        ranks = _ranks_for_budget(analysis, paths, target, int(options.params_fraction * before), before)
    after = sum(target.path_params(p, r) for p in paths for r in ranks[p] if r is not None)
    return RankPlan(ranks, before, after)


def _ranks_for_budget(analysis: list[LayerAnalysis], paths: tuple[str, ...], target: FarrTarget, budget: int,
                      before: int) -> dict[str, list[int]]:
    """Greedy on the marginal gain per parameter. A rank increment r -> r+1 of a layer's path gains
    the mean over its groups of ``σ_{r+1}² / Σσ²`` (relative energy, so every layer counts alike) and
    costs a fixed number of parameters; gains fall with r, so taking increments in order of gain per
    parameter keeps each layer's choice a prefix."""
    ranks = {p: [1 if p in a.spectra else None for a in analysis] for p in paths}
    spent = sum(target.path_params(p, 1) for p in paths for r in ranks[p] if r is not None)
    if spent > budget:
        raise ValueError(f"the parameter budget ({budget:,} of {before:,}) removes everything: the smallest FaRR model "
                         f"(rank 1 in every layer) keeps {spent:,} ({spent / before:.2%}); raise --params-fraction")
    units = []
    for a in analysis:
        for p in a.spectra:
            cost = target.path_params(p, 2) - target.path_params(p, 1)
            for r in range(1, target.head_dim):
                gain = sum(_rel_energy(g.S, r) for g in a.spectra[p]) / len(a.spectra[p])
                if gain > 0:
                    units.append((-gain / cost, a.layer, p, r, cost))
    closed: set[tuple[int, str]] = set()
    for _, layer, p, r, cost in sorted(units):
        if (layer, p) in closed or ranks[p][layer] != r:
            continue
        if spent + cost > budget:
            closed.add((layer, p))   # later increments of this layer would break the prefix
            continue
        ranks[p][layer] = r + 1
        spent += cost
    return ranks


def _rel_energy(S: torch.Tensor, index: int) -> float:
    total = float((S ** 2).sum())
    return float(S[index] ** 2) / total if total > 0 and index < S.numel() else 0.0


# ---------------------------------------------------------------------- reduction pass
@dataclass
class FarrReport:
    source: str
    output: str | None
    model_type: str
    options: dict
    ranks: dict[str, list[int | None]]     # None: that layer's path kept whole (RoPE layers' query/key)
    head_dim: int
    kept_energy: dict[str, list[list[float] | None]] = field(default_factory=dict)  # path -> layer -> per group
    touchable_params_before: int = 0
    touchable_params_after: int = 0
    params_before: int = 0
    params_after: int = 0
    notes: list[str] = field(default_factory=list)
    calibration: dict | None = None        # text and tokens of the activation-aware metric
    seconds: float = 0.0
    verification: dict = field(default_factory=dict)

    @property
    def touchable_kept_fraction(self) -> float:
        return self.touchable_params_after / self.touchable_params_before

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["touchable_kept_fraction"] = self.touchable_kept_fraction
        return d


def reduce_layer(layer: Tensors, adapter: Adapter, target: FarrTarget, options: FarrOptions,
                 ranks: dict[str, int | None], weights: fused.InputWeights | None = None,
                 layout=None) -> tuple[Tensors, dict[str, list[float] | None]]:
    """One layer of the FaRR model, canonical form (``layout``: this layer's, default the model's).
    The bias rewrites apply whether or not their path is reduced, because the FaRR architecture has
    no value (and, for encoders, key) bias. Data-free, the maps are truncated with the pre-norm γ
    folded in (measured on the normalised stream); calibrated, on the module's input (γ included),
    and γ is folded afterwards. A path whose rank is None is kept whole."""
    L = layout or adapter.layout
    if weights is None:
        layer = prepare_layer(layer, adapter)
    layer = fused.fold_value_bias(layer, L)
    if target.kind == "encoder":
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
            if target.k_bias:   # the decoder's k_proj has a bias on every layer; b_K is exactly 0 here
                layer["k.bias"] = torch.zeros(layer["k.weight"].shape[0], dtype=layer["k.weight"].dtype)
    return prepare_layer(layer, adapter) if weights is not None else layer, kept


def _farr(source: TensorSource, config: dict, options: FarrOptions, sink, progress: bool,
          moments: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None, weights: LayerWeights | None = None,
          analysis: list[LayerAnalysis] | None = None, device: torch.device | str = "cpu"):
    """The two passes. Calibrated: either ``moments`` (per layer ``(E[xxᵀ], E[x])``; the metrics are
    computed here and kept in memory) or ``weights`` with the ``analysis`` of
    :func:`calibrated_analysis`. The truncations run on ``device``."""
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    target = farr_target(adapter, config, keys, options)
    if moments:
        weights = LayerWeights()
        for i, m in moments.items():
            weights.put(i, fused.InputWeights.from_moments(*(t.to(device) for t in m), augmented=options.qk))
    if analysis is None:
        analysis = analyze(source, adapter, options.paths, progress=progress, weights=weights, device=device)
    plan = plan_ranks(analysis, options, target)
    kept: dict[str, list[list[float]]] = {p: [] for p in options.paths}
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    release_free_memory()   # the analysis' temporaries, before the vocabulary-sized reads
    # the globals pass through unchanged, one tensor at a time (vocabulary-sized: no copy of them is made)
    for key in global_keys:
        sink.add(source.get([key]))
    shapes, dtypes = source.shapes(), _dtypes(source)
    ffn = ffn_modules(adapter)
    for i in tqdm(range(adapter.n_layers), desc="farr", disable=not progress, unit="layer"):
        release_free_memory()   # the previous layer's temporaries
        like = {k: dtypes[k] for k in per_layer[i]}
        stand = stand_ins(per_layer[i], shapes, dtypes)
        # the attention and the norms, in float64: what FaRR rewrites
        keys_a = [k for k in per_layer[i] if module_of(adapter, i, k) not in ffn]
        raw = source.get(keys_a)
        modeled = adapter.modeled_layer_keys(i)
        passthrough = {k: v for k, v in raw.items() if k not in modeled}   # rotary buffers
        layer = read_part(adapter, i, stand, raw, torch.float64)
        ffn_norm = {k: layer[f"ffn_norm.{k}"] for k in ("weight", "bias") if f"ffn_norm.{k}" in layer}
        w = _weights_to(weights[i], device) if weights else None
        new, k = reduce_layer({n: t.to(device) for n, t in layer.items()}, adapter, target, options,
                              {p: plan.ranks[p][i] for p in options.paths}, w, adapter.layer_layout(i))
        for p, v in k.items():
            kept[p].append(v)
        sink.add({**passthrough, **adapter.write_layer(i, {n: t.cpu() for n, t in new.items()}, like)})
        del layer, new, w, raw, passthrough
        # the FFN, one module at a time in its own dtype: unchanged, but for the pre-norm's γ folded
        # into gate/up (as reduce_layer folds it on a whole layer), a block of rows at a time
        fold = ffn_norm if adapter.spec.placement == "pre" and "weight" in ffn_norm else None
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
    report = FarrReport(source="", output=None, model_type=farr_config.model_type,
                        options=dataclasses.asdict(options), head_dim=adapter.layout.head_dim,
                        ranks={p: [adapter.layout.head_dim if r is None else r for r in rs] for p, rs in plan.ranks.items()},
                        kept_energy=kept, touchable_params_before=plan.touchable_before,
                        touchable_params_after=plan.touchable_after)
    report.notes += _qk_notes(adapter, options)
    return farr_config, report, analysis


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
        new_b = None if bias is None else torch.empty(W.shape[0], dtype=torch.float64)   # cast once, when written
        for r in range(0, W.shape[0], rows):
            block = {f"{n}.weight": W[r:r + rows].to(torch.float64)}
            if b is not None:
                block[f"{n}.bias"] = b[r:r + rows].to(torch.float64)
            block = fold_norm(block, (n,), weight, bias)
            new_w[r:r + rows] = block[f"{n}.weight"]
            if new_b is not None:
                new_b[r:r + rows] = block[f"{n}.bias"]
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
        return ["query/key kept at full size (pass qk=True / --qk to reduce them too"
                + (f", on the NoPE layers {layers})" if partly else ")")]
    if partly:
        return [f"query/key reduced on the NoPE layers {layers} only; the other layers rotate every query/key dim "
                "with RoPE, so their score map cannot be fused and they keep the full head dim"]
    return []


_BUFFERS = ("position_ids", "token_type_ids")   # index buffers some BERT checkpoints carry, not parameters


def _param_count(tensors: Tensors, tied: bool = False) -> int:
    """Parameters in ``tensors``; a tied ``lm_head`` (present in in-memory state dicts) is the
    embedding, counted once."""
    return sum(t.numel() for k, t in tensors.items()
               if not k.endswith(_BUFFERS) and not (tied and k == "lm_head.weight"))


def farr_state_dict(state_dict: Tensors, config, options: FarrOptions, progress: bool = False,
                    moments: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
    """In-memory FaRR: returns (new state dict, FaRR config, report). ``moments`` (from
    :func:`attention_input_moments`) switches to the calibrated, activation-aware metric."""
    config = _normalised_config(config)
    sink = DictSink()
    farr_config, report, _ = _farr(DictSource(state_dict), config, options, sink, progress, moments)
    tied = bool(config.get("tie_word_embeddings"))
    report.params_before, report.params_after = _param_count(state_dict, tied), _param_count(sink, tied)
    return dict(sink), farr_config, report


def build_farr_model(state_dict: Tensors, farr_config, dtype: torch.dtype | None = None):
    """A FaRR model instance holding ``state_dict`` (in eval mode)."""
    target_cls = next(iter(_classes_for(farr_config).values()))
    dtype = dtype or next(iter(state_dict.values())).dtype
    model = target_cls(farr_config).to(dtype)   # before loading, so float64 weights stay float64
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict and not (k == "lm_head.weight" and farr_config.tie_word_embeddings)]
    unexpected = [k for k in state_dict if k not in own and not k.endswith(_BUFFERS)]
    if missing or unexpected:
        raise ValueError(f"FaRR state dict does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False)
    if getattr(farr_config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def farr_model(model, options: FarrOptions, progress: bool = False, calib_ids: torch.Tensor | None = None):
    """FaRR of an in-memory model: returns (FaRR model, report). ``calib_ids`` (1-D token ids)
    switches to the calibrated metric, measured on the model's own attention inputs."""
    moments = attention_input_moments(model, calib_ids) if calib_ids is not None else None
    sd, cfg, report = farr_state_dict(model.state_dict(), model.config, options, progress, moments)
    if calib_ids is not None:
        report.calibration = {"tokens": int(calib_ids.numel())}
    return build_farr_model(sd, cfg, next(model.parameters()).dtype), report


def attention_input_moments(model, ids: torch.Tensor, window: int = 512, placement=None, progress: bool = False,
                            config: dict | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(E[x xᵀ], E[x])`` of the attention input x (what q/k/v read: the pre-norm's
    output, γ included, or the residual stream of post-LN encoders) over ``ids`` in windows of
    ``window`` tokens, in float64.

    ``model``: an HF model folder (the calibration engine reads one layer at a time; the model is
    never loaded whole), a tensor source with its ``config``, or an in-memory model.
    ``placement``: device and calibration dtype (:func:`hf_symmetry.devices.resolve`)."""
    from ..calibration import StatsRequest, calibration_batches

    engine = _engine(model, config, placement, progress)
    window = min(window, engine.config.get("max_position_embeddings") or window)
    result = engine.collect(calibration_batches(ids, window), StatsRequest(grams=("v_in",), sums=("v_in",)))
    return {i: (s.second_moment("v_in"), s.mean("v_in")) for i, s in enumerate(result.layers)}


def _classes_for(farr_config) -> dict[str, type]:
    return {
        "hf_symmetry_farr_llama": {"AutoModelForCausalLM": modeling_farr.FarrLlamaForCausalLM,
                                   "AutoModel": modeling_farr.FarrLlamaModel},
        "hf_symmetry_farr_bert": {"AutoModel": modeling_farr.FarrBertModel},
        "hf_symmetry_farr_roberta": {"AutoModel": modeling_farr.FarrRobertaModel},
    }[farr_config.model_type]


def save_farr_config(farr_config, folder: Path) -> None:
    """config.json with ``auto_map`` plus the flat remote-code files, so the folder loads with
    ``trust_remote_code=True`` where hf_symmetry is not installed."""
    classes = _classes_for(farr_config)
    farr_config.auto_map = {"AutoConfig": f"configuration_farr.{type(farr_config).__name__}",
                            **{auto: f"modeling_farr.{cls.__name__}" for auto, cls in classes.items()}}
    farr_config.save_pretrained(folder)   # also copies configuration_farr.py (register_for_auto_class)
    shutil.copyfile(modeling_farr.__file__, folder / "modeling_farr.py")
    shutil.copyfile(configuration_farr.__file__, folder / "configuration_farr.py")


def farr_checkpoint(src: str | Path, out: str | Path, options: FarrOptions, overwrite: bool = False,
                    max_shard_size: str | int = "2GB", progress: bool = True, calib_text: str | Path | None = None,
                    calib_tokens: int = 2048, placement=None) -> FarrReport:
    """Stream ``src`` (an HF safetensors folder) into a FaRR model folder at ``out``. With
    ``calib_text`` the layer-wise calibration engine measures the attention inputs on the first
    ``calib_tokens`` tokens (activation-aware metric) on ``placement``
    (:func:`hf_symmetry.devices.resolve`), one layer in memory at a time; the conversion streams too,
    and its SVDs and eigendecompositions run on that device."""
    from ..devices import linalg_device

    start = time.perf_counter()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    farr_target(Adapter.from_config(reader.config, reader.keys()), reader.config, reader.keys(), options)
    ids, calibration = None, None
    if calib_text is not None:
        ids, calibration = calibration_tokens(src, calib_text, calib_tokens)
    with atomic_output_dir(out, overwrite) as tmp:
        weights = analysis = None
        if ids is not None:   # the metrics wait for the reduction pass in the (hidden) output folder
            weights = LayerWeights(tmp / ".farr-input-weights")
            analysis = calibrated_analysis(src, ids, options.paths, placement, progress, store=weights)
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "farr"})
        counter = _CountingSink(writer)
        farr_config, report, analysis = _farr(reader, reader.config, options, counter, progress, weights=weights,
                                              analysis=analysis, device=linalg_device(placement))
        if weights is not None:
            weights.close()
        report.calibration = calibration
        writer.close()
        farr_config.dtype = reader.config.get("dtype") or reader.config.get("torch_dtype")
        save_farr_config(farr_config, tmp)
        copy_side_files(reader.path, tmp)
        report.source, report.output = str(src), str(out)
        report.params_before = count_parameters(reader.path)   # the count every card and report uses
        report.params_after = count_parameters(tmp)
        report.seconds = time.perf_counter() - start
        write_json(tmp / REPORT_FILE, public_report(report.as_dict()))
        plots = [write_rank_heatmap(tmp, analysis, reader.config, reader.keys(), report, Path(src).name)]
        write_card(tmp, "farr", farr_card_data(src, out, report, plots))
    return report


HEATMAP_FILE = "effective_rank.png"
CARD_TAUS = (0.99, 0.999)


def write_rank_heatmap(folder: Path, analysis: list[LayerAnalysis], config: dict, keys: list[str], report: FarrReport,
                       name: str) -> dict:
    """The `spectra` effective-rank heatmap of the maps FaRR truncated (from the spectra it already
    computed, so no second pass), written to ``folder``; returns the card's plot entry."""
    from ..evaluation.spectra_plots import plot_rank_heatmaps

    adapter = Adapter.from_config(config, keys)
    tau = report.options.get("tau")
    taus = sorted({*CARD_TAUS, tau} if tau is not None else set(CARD_TAUS))
    heat = _analysis_report(analysis, adapter, taus, name)
    plot_rank_heatmaps(heat, folder / HEATMAP_FILE, title=f"Effective rank of the fused attention maps of {name} "
                                                          "(rows: heads / KV groups, columns: layers)")
    unit = "head" if adapter.layout.n_kv_heads == adapter.layout.n_heads else "KV group"
    metric = "activation-aware metric" if report.calibration else "data-free Frobenius metric"
    chosen = (f"this model was cut at τ = {tau:g}" if tau is not None
              else "this model's ranks were set by the parameter budget instead of a τ")
    caption = (f"Effective rank of the source model's fused maps per {unit} and layer at τ ∈ "
               f"{{{', '.join(f'{t:g}' for t in taus)}}} ({metric}): the fewest singular directions keeping a "
               f"fraction τ of the map's energy. Each layer's head dim is the largest rank in its column; {chosen}.")
    return {"path": HEATMAP_FILE, "caption": caption}


def farr_card_data(src, out, report: FarrReport, plots: list | None = None) -> dict:
    """What the model card says about a FaRR model (quality figures are added once verified)."""
    paths = " and ".join({"vo": "value/output", "qk": "query/key"}[p] for p in report.ranks)
    how = (f"energy threshold τ = {report.options['tau']}" if report.options["tau"] is not None
           else f"a budget of {report.options['params_fraction']:.0%} of the rewritten projections' parameters")
    metric = (f"the activation-aware metric ({report.calibration['tokens']} calibration tokens)" if report.calibration
              else "the data-free Frobenius metric")
    summary = (f"FaRR (fuse and rank reduce) of `{public_model_label(src)}`: each layer's fused {paths} maps were truncated "
               f"with {how} in {metric} and split back with a balanced √Σ split, giving per-layer head dims "
               f"(`v_head_dims`{', `qk_head_dims`' if 'qk' in report.ranks else ''} in config.json). "
               f"The rewritten projections keep {report.touchable_kept_fraction:.1%} of their parameters "
               f"({report.params_before:,} → {report.params_after:,} in the whole model). Custom model class: load "
               "with `trust_remote_code=True` (or `import hf_symmetry`).")
    return {"title": Path(out).name, "inputs": [str(src)], "summary": summary, "plots": plots or [],
            "parameters": {**{k: v for k, v in report.options.items() if v is not None}, **{
                f"{p}_head_dims": r for p, r in report.ranks.items()}},
            "notes": "\n".join(f"- {n}" for n in report.notes) or None,
            "extra": {"touchable_params_before": report.touchable_params_before,
                      "touchable_params_after": report.touchable_params_after,
                      "calibration": report.calibration, "original_head_dim": report.head_dim}}


def calibration_tokens(src, text, tokens: int) -> tuple[torch.Tensor, dict]:
    """The first ``tokens`` token ids of ``text`` in the tokenizer of the model folder ``src``, and a
    record of what was used."""
    from ..assets import resolve_text
    from ..calibration import calibration_ids
    from ..evaluation.compare import load_tokenizer

    if tokens <= 0:
        raise ValueError(f"calibration needs a positive number of tokens, got {tokens}")
    path = resolve_text(text)
    ids = calibration_ids(load_tokenizer(src), path, tokens)
    return ids, {"text": str(path), "tokens": int(ids.numel())}


class _CountingSink:
    def __init__(self, sink):
        self.sink, self.params = sink, 0

    def add(self, tensors: Tensors) -> None:
        self.params += _param_count(tensors)
        self.sink.add(tensors)


def _param_count_reader(reader: CheckpointReader) -> int:
    from safetensors import safe_open

    total = 0
    for fname in set(reader.key_to_file.values()):
        with safe_open(reader.path / fname, framework="pt") as f:
            for k in f.keys():
                if not k.endswith(_BUFFERS):
                    total += math.prod(f.get_slice(k).get_shape())
    return total


# ---------------------------------------------------------------------- spectra report
def _group_entry(g: fused.GroupSpectrum, taus: list[float], gqa: bool) -> dict:
    ranks = lambda S: {f"{t:g}": fused.effective_rank(S, t) for t in taus}  # noqa: E731
    entry = {"group": g.group, "heads": g.heads, "singular_values": [float(s) for s in g.S],
             "energy": float((g.S ** 2).sum()), "effective_rank": ranks(g.S), "stable_rank": fused.stable_rank(g.S),
             "alignment": g.alignment}
    if g.factor_S is not None:
        entry["factor_effective_rank"] = {"output": ranks(g.factor_S[0]), "input": ranks(g.factor_S[1])}
    if gqa and g.head_S is not None:
        entry["head_effective_rank"] = [ranks(S) for S in g.head_S]
    return entry


def spectra_report(source: TensorSource, config: dict, taus: list[float], name: str = "", progress: bool = True,
                   moments: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                   calib_ids: torch.Tensor | None = None, placement=None) -> dict:
    """Per layer and KV group (head, without GQA): singular values of the fused value map and, where
    exact, of the fused score map; effective rank at each τ, stable rank, alignment, and the
    factors' own effective ranks. With a summary of what ``farr --tau`` would keep. ``moments``
    (from :func:`attention_input_moments`) or ``calib_ids`` (measured layer by layer by
    :func:`calibrated_analysis` on ``placement``) measure the maps in the activation-aware metric."""
    taus = [fused.check_tau(t) for t in taus]
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    L = adapter.layout
    fusable = qk_layers(adapter)
    qk_reason = None if fusable else fused.qk_fusion_blocker(L)
    paths = ("vo", "qk") if fusable else ("vo",)
    if calib_ids is not None:
        analysis = calibrated_analysis(source, calib_ids, paths, placement, progress, config=config, detail=True)
    else:
        weights = {i: fused.InputWeights.from_moments(*m) for i, m in moments.items()} if moments else None
        analysis = analyze(source, adapter, paths, detail=True, progress=progress, weights=weights)
    calibrated = moments is not None or calib_ids is not None
    plotted = _analysis_report(analysis, adapter, taus, name)
    report = {
        "model_name": name, "model_type": config.get("model_type"), "family": adapter.family,
        "layout": plotted["layout"],
        "paths": list(paths), "taus": taus, "norms_folded": adapter.spec.placement == "pre" and not calibrated,
        "metric": "activation-aware" if calibrated else "data-free (Frobenius)",
        "qk": {"available": qk_reason is None, "reason": qk_reason, "layers": fusable,
               "dims": ("non-rotary dims only" if any(adapter.layer_layout(i).rotary_dim for i in fusable)
                        else "all head dims")},
        "layers": plotted["layers"],
        "summary": {p: {f"{t:g}": _tau_summary(analysis, p, t, adapter, config, keys) for t in taus} for p in paths},
    }
    return report


def _analysis_report(analysis: list[LayerAnalysis], adapter: Adapter, taus: list[float], name: str) -> dict:
    """The part of a spectra report the plots read: layout, paths, τs and per-layer group entries."""
    L = adapter.layout
    gqa = L.n_kv_heads != L.n_heads
    paths = [p for p in ("vo", "qk") if any(p in a.spectra for a in analysis)]
    return {"model_name": name, "paths": paths, "taus": list(taus),
            "layout": {"n_heads": L.n_heads, "n_kv_heads": L.n_kv_heads, "head_dim": L.head_dim,
                       "rotary_dim": L.rotary_dim, "rope_layout": L.rope_layout, "qk_norm": L.qk_norm},
            "layers": [{"layer": a.layer, **{p: [_group_entry(g, taus, gqa) for g in a.spectra[p]] for p in a.spectra}}
                       for a in analysis]}


def _tau_summary(analysis: list[LayerAnalysis], path: str, tau: float, adapter: Adapter, config: dict,
                 keys: list[str]) -> dict:
    layer_ranks = ranks_for_tau(analysis, path, tau)
    reduced = [r for r in layer_ranks if r is not None]
    per_group = [fused.effective_rank(g.S, tau) for a in analysis for g in a.spectra.get(path, [])]
    out = {"layer_ranks": layer_ranks, "mean_layer_rank": sum(reduced) / len(reduced),
           "mean_group_rank": sum(per_group) / len(per_group), "farr_kept_params_fraction": None}
    try:
        options = FarrOptions(tau=tau, vo=path == "vo", qk=path == "qk")
        plan = plan_ranks(analysis, options, farr_target(adapter, config, keys, options))
        out["farr_kept_params_fraction"] = plan.kept_fraction
    except ValueError:
        pass   # no FaRR model for this family/path: the spectra still stand
    return out
