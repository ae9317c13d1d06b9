"""``merge``: combine models of one architecture, optionally matched to an anchor first.

Pipeline (docs/math.md §2):

1. checks, before any work: one family and shapes, one vocabulary, a base where the method
   needs one, a supported matching plan, calibration text for data-dependent methods;
2. the anchor: the base model when one is given, else the input nearest the mean of all inputs
   (or the one the recipe names); every other input is matched to it
   (:mod:`hf_symmetry.conversion.match`);
3. the merge rule, tensor by tensor (:mod:`hf_symmetry.conversion.merge.methods`).

Weight-only methods (average, task arithmetic, TIES) and RegMean stream layer by layer
(:mod:`hf_symmetry.conversion.merge.stream`): each layer of every input is read, matched and merged
one group of tensors at a time before the next layer is read, and the vocabulary-sized globals a
block of rows at a time where the rule allows. RegMean's Gram matrices are collected inside that
pass (:class:`~hf_symmetry.conversion.merge.stream.LayerGrams`: one calibration run per input,
advanced one decoder layer at a time, so host memory holds one layer's Grams whatever the depth),
on the inputs as given, and carried exactly through the match (``RᵀGR``, ``PᵀGP``;
:meth:`~hf_symmetry.conversion.match.solution.MatchSolution.transform_grams`); the globals (LM head:
the Gram of the final norm's output) are merged after the last layer. Fisher needs a full backward
pass, so it holds each *matched* model (a diagonal Fisher does not transform under rotations) placed
by accelerate
(:func:`hf_symmetry.conversion.merge.statistics.fisher_model`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...assets import resolve_model, resolve_text
from ...calibration import token_batches
from ...checkpoint import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
    write_config,
)
from ...devices import linalg_device
from ...hub.cards import update_card, write_card
from ...hub.lineage import hub_id_of, public_model_labels
from ...text import public_text_label
from ..match.checks import check_same_architecture, check_same_vocabulary, vocabulary_fingerprint
from ..match.options import MatchPlan
from ..match.pair import PairMatcher, run_pair
from ..match.residual import with_lm_head
from .methods import RegMeanSolver, fisher_average, task_arithmetic, ties, weighted_average
from .statistics import check_fisher_memory, fisher_diagonal, fisher_model, statistics_dtype
from .stream import GRAM_OF, LayerGrams, stream_merge
from .recipe import DATA_METHODS, EvaluationSpec, MergeRecipe, ModelEntry, recipe_from_dict
from ..rotate import RotateOptions, plan_checks
from ..stream import DictSink, DictSource, TensorSource, combine_checkpoints, partition_keys

Tensors = dict[str, torch.Tensor]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


# --------------------------------------------------------------------------- the rule


@dataclass
class MergeRule:
    """One merge method applied to canonical tensors. Participants are the merged models, then
    the base (``has_base``). ``fishers`` (per model, tensor sources keyed like the state dict) and
    ``grams`` (per model, canonical keys) must already be in the anchor's frame."""

    method: str
    params: dict
    entries: list[ModelEntry]
    has_base: bool
    adapter: Adapter
    fishers: list[TensorSource] | None = None
    grams: list[Tensors] | None = None
    device: torch.device = torch.device("cpu")  # where RegMean's solves run (results come back to the CPU)
    _parts: list | None = field(default=None, repr=False)  # the Fisher sources' keys per layer
    _solvers: dict = field(default_factory=dict, repr=False)  # RegMean: Gram key -> factored system

    @property
    def row_separable(self) -> bool:
        """Whether each row of a tensor is merged on its own (the globals can go a block of rows at a time)."""
        return self.method in ("average", "task_arithmetic", "regmean")

    def set_grams(self, grams: list[Tensors] | None) -> None:
        self.grams, self._solvers = grams, {}

    @property
    def weights(self) -> list[float]:
        return [e.weight for e in self.entries]

    def combine(self, tensors: list[torch.Tensor], fishers: list[torch.Tensor] | None = None) -> torch.Tensor:
        models, base = (tensors[:-1], tensors[-1]) if self.has_base else (tensors, None)
        p, w = self.params, self.weights
        if self.method == "average":
            return weighted_average(models, w, p["normalize"])
        if self.method == "regmean":  # everything that is not a linear weight: biases, norms, embeddings
            return weighted_average(models, w)
        if self.method == "task_arithmetic":
            return task_arithmetic(base, models, w, p["lambda"], p["normalize"])
        if self.method == "ties":
            return ties(base, models, w, [e.density for e in self.entries], p["lambda"], p["normalize"])
        if self.method == "fisher":
            return fisher_average(models, fishers, w, p["fisher_floor"])
        raise ValueError(f"unknown merge method {self.method!r}")

    def _merge_dict(self, parts: list[Tensors], fishers: list[Tensors] | None, gram_key) -> Tensors:
        out = {}
        for key in parts[0]:
            tensors = [p[key] for p in parts]
            gkey = gram_key(key)
            if self.method == "regmean" and gkey is not None:  # factored once, e.g. for every block of the LM head
                try:
                    if gkey not in self._solvers:
                        self._solvers[gkey] = RegMeanSolver(
                            [g[gkey] for g in self.grams], self.weights, self.params["alpha"], self.device
                        )
                    out[key] = self._solvers[gkey].solve(tensors[: len(self.entries)]).cpu()
                except ValueError as exc:
                    raise ValueError(f"{gkey}: {exc}") from None
            else:
                out[key] = self.combine(tensors, [f[key] for f in fishers] if fishers else None)
        return out

    def _fisher_parts(self) -> list:
        if self._parts is None:
            self._parts = [partition_keys(self.adapter, f.keys()) for f in self.fishers]
        return self._parts

    def layer(self, i: int, layers: list[Tensors]) -> Tensors:
        fishers = None
        if self.method == "fisher":
            fishers = [
                self.adapter.read_layer(i, f.get(part[1][i])) for f, part in zip(self.fishers, self._fisher_parts())
            ]
        return self._merge_dict(layers, fishers, lambda key: f"layers.{i}.{GRAM_OF[key]}" if key in GRAM_OF else None)

    def globals(self, gs: list[Tensors]) -> Tensors:
        fishers = None
        if self.method == "fisher":
            fishers = [self.adapter.read_globals(f.get(part[0])) for f, part in zip(self.fishers, self._fisher_parts())]
            if "lm_head.weight" in gs[0]:
                fishers = [with_lm_head(f, self.adapter) for f in fishers]
        return self._merge_dict(gs, fishers, lambda key: "head_in" if key == "lm_head.weight" else None)

    def rest(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Tensors outside the adapter's layout (buffers, task heads): merged element-wise;
        integer buffers must agree."""
        if not tensors[0].is_floating_point():
            if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
                raise ValueError(f"integer tensor {key} differs between the inputs; cannot merge it")
            return tensors[0]
        fishers = None
        if self.method == "fisher":
            found = [f.get([key])[key] if key in set(f.keys()) else None for f in self.fishers]
            fishers = (
                found if all(f is not None for f in found) else [torch.ones_like(t) for t in tensors[: len(found)]]
            )
        return self.combine(tensors, fishers).to(tensors[0].dtype)


# --------------------------------------------------------------------------- the core


@dataclass
class MergeOutcome:
    config: dict
    anchor: int
    tied_output: bool
    distances: dict = field(default_factory=dict)  # participant name -> match distance summary
    anchor_distances: dict = field(default_factory=dict)  # participant name -> squared distance to the mean
    seconds: dict = field(default_factory=dict)


def _tied_output(adapter: Adapter, configs: list[dict], plan: MatchPlan | None) -> bool:
    if adapter.spec.lm_head is None or (plan is not None and plan.residual):
        return False
    return all(Adapter.from_config(c).tied_embeddings for c in configs)


def distances_to_mean(sources: list[TensorSource], adapter: Adapter, progress: bool = True) -> list[float]:
    """``‖θ_j − mean‖²`` of every input (one streaming pass)."""
    parts = [partition_keys(adapter, s.keys()) for s in sources]
    out = [0.0] * len(sources)

    def accumulate(dicts: list[Tensors]) -> None:
        for key in dicts[0]:
            mean = sum(d[key].to(torch.float64) for d in dicts) / len(dicts)
            for j, d in enumerate(dicts):
                out[j] += (d[key].to(torch.float64) - mean).pow(2).sum().item()

    accumulate([with_lm_head(adapter.read_globals(s.get(p[0])), adapter) for s, p in zip(sources, parts)])
    for i in tqdm(range(adapter.n_layers), desc="anchor", disable=not progress, unit="layer"):
        accumulate([adapter.read_layer(i, s.get(p[1][i])) for s, p in zip(sources, parts)])
    return out


def choose_anchor(
    sources: list[TensorSource],
    names: list[str],
    adapter: Adapter,
    anchor: str,
    has_base: bool,
    n_models: int,
    progress: bool,
) -> tuple[int, dict]:
    """The recipe's anchor, else the base, else the model nearest the mean (the first of two:
    both are equally far from their mean)."""
    if anchor != "auto":
        return names.index(anchor), {}
    if has_base:
        return len(sources) - 1, {}
    if n_models == 2:
        return 0, {}
    d = distances_to_mean(sources[:n_models], adapter, progress)
    return min(range(n_models), key=d.__getitem__), dict(zip(names, d))


def merge_sources(
    sources: list[TensorSource],
    adapter: Adapter,
    rule: MergeRule,
    sink,
    anchor: int,
    plan: MatchPlan | None,
    tied_output: bool,
    progress: bool = True,
    layer_grams: "LayerGrams | None" = None,
) -> list[PairMatcher] | None:
    """Stream every participant layer by layer, matched to ``sources[anchor]`` when ``plan`` is
    given, merged by ``rule`` into ``sink``. ``layer_grams`` (RegMean): the Gram matrices of each
    layer are collected as the layer comes (and the globals merged last). Returns the matchers
    (solutions and distances)."""
    matchers = None
    if plan is not None:
        matchers = [PairMatcher(adapter, plan, identity=(j == anchor)) for j in range(len(sources))]
        for j, m in enumerate(matchers):
            m.solve_residual(sources[anchor], sources[j], progress)

    if rule.method != "fisher":
        stream_merge(
            sources,
            adapter,
            rule,
            sink,
            anchor,
            matchers,
            tied_output,
            progress,
            f"{'match + ' if plan else ''}{rule.method}",
            layer_grams,
        )
        return matchers

    def globals_fn(gs: list[Tensors]) -> Tensors:
        if matchers:
            gs = [m.match_globals(gs[anchor], g) for m, g in zip(matchers, gs)]
        gs = [
            {k: v for k, v in g.items() if k != "lm_head.weight"} if tied_output else with_lm_head(g, adapter)
            for g in gs
        ]
        return rule.globals(gs)

    def layer_fn(i: int, layers: list[Tensors]) -> Tensors:
        if matchers:
            layers = [m.match_layer(i, layers[anchor], layer) for m, layer in zip(matchers, layers)]
        return rule.layer(i, layers)

    # Fisher: each layer's Fishers are read beside its weights (the matched inputs, written by then)
    combine_checkpoints(
        sources,
        adapter,
        sink,
        layer_fn,
        globals_fn,
        rule.rest,
        like=anchor,
        progress=progress,
        desc=f"{'match + ' if plan else ''}{rule.method}",
    )
    return matchers


class _Spill:
    """Where Fisher merging keeps the matched inputs and the Fishers between its passes: safetensors
    folders under ``folder`` (host memory then holds one model at a time: the Fisher pass's), or
    memory when ``folder`` is None (the in-memory API)."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def write(self, name: str, fill) -> TensorSource:
        """``fill(sink)`` writes the tensors; returns them as a tensor source."""
        if self.folder is None:
            sink = DictSink()
            fill(sink)
            return DictSource(dict(sink))
        path = Path(self.folder) / name
        path.mkdir(parents=True)
        writer = ShardedWriter(path, parse_size("2GB"))
        fill(writer)
        writer.close()
        (path / "config.json").write_text("{}\n")  # a folder CheckpointReader reads
        return CheckpointReader(path)


class _SourceMapping:
    """A tensor source read one tensor at a time as a mapping (what :func:`fisher_model` loads)."""

    def __init__(self, source: TensorSource):
        self.source, self._keys = source, set(source.keys())

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.source.get([key])[key]


def _matched_inputs(
    sources: list[TensorSource], adapter: Adapter, plan: MatchPlan | None, anchor: int, progress: bool, spill: _Spill
) -> tuple[list[TensorSource], list]:
    """Every participant moved into the anchor's frame (streamed into ``spill``), with its match
    solution; without a plan, the inputs themselves."""
    if plan is None:
        return list(sources), [None] * len(sources)
    matched, solutions = [], []
    for j, s in enumerate(sources):
        found = []
        matched.append(
            spill.write(
                f"matched-{j}",
                lambda sink: found.append(
                    run_pair(sources[anchor], s, adapter, plan, sink, identity=(j == anchor), progress=progress)
                ),
            )
        )
        solutions.append(found[0])
    return matched, solutions


def _fishers(
    matched: list[TensorSource],
    matched_config: dict,
    batches: list[torch.Tensor],
    n_models: int,
    progress: bool,
    placement,
    spill: _Spill,
) -> list[TensorSource]:
    """Diagonal Fisher of each merged model, on the matched models (the diagonal Fisher does not
    transform under the match): each model in turn placed by accelerate (:func:`fisher_model`) and
    its Fisher written to ``spill``."""
    fishers = []
    for j in range(n_models):
        model = fisher_model(matched_config, _SourceMapping(matched[j]), statistics_dtype(matched[j]), placement)
        fisher = fisher_diagonal(model, batches, progress, desc=f"fisher {j + 1}/{n_models}")
        del model
        fishers.append(spill.write(f"fisher-{j}", lambda sink, fisher=fisher: sink.add(fisher)))
        del fisher
    return fishers


def run_merge(
    sources: list[TensorSource],
    configs: list[dict],
    names: list[str],
    recipe: MergeRecipe,
    sink,
    calibration_ids: torch.Tensor | None = None,
    folders: list | None = None,
    progress: bool = True,
    placement=None,
    workdir: Path | None = None,
) -> MergeOutcome:
    """The merge of ``sources`` (the recipe's models, then its base) into ``sink``; checks first.
    ``workdir``: a folder for Fisher merging's matched inputs and Fishers and for the Grams RegMean keeps
    waiting while the next input's layer runs (default: memory)."""
    folders = folders or [None] * len(sources)
    has_base = recipe.base_model is not None
    n_models = len(recipe.models)
    check_same_architecture([(n, c, s.shapes()) for n, c, s in zip(names, configs, sources)])
    check_same_vocabulary(list(zip(names, folders)), "merging combines embedding rows token by token")
    adapter = Adapter.from_config(configs[0], sources[0].keys())
    plan = recipe.match.plan(adapter) if recipe.match else None
    if plan is not None and plan.residual:
        plan_checks(adapter, RotateOptions(residual="random", heads="none", ffn=False), sources[0].keys())
    if recipe.method in DATA_METHODS and calibration_ids is None:
        raise ValueError(f"{recipe.method} needs calibration token ids")
    if recipe.method == "fisher" and adapter.spec.lm_head is None:
        raise ValueError(
            f"Fisher merging needs a language-model head to define a likelihood; {adapter.family} "
            "base models have none (use average or regmean)"
        )
    if recipe.method in DATA_METHODS:
        batches = token_batches(
            calibration_ids, recipe.calibration.seq_len, recipe.calibration.batch_size, keep_partial=False
        )
    if recipe.method == "fisher":  # a backward pass needs the whole model: refuse what cannot fit, before any work
        check_fisher_memory(sources[0].shapes(), statistics_dtype(sources[0]), placement)

    timings = {}
    start = time.perf_counter()
    anchor, to_mean = choose_anchor(sources, names, adapter, recipe.anchor, has_base, n_models, progress)
    timings["anchor"] = time.perf_counter() - start
    tied = _tied_output(adapter, configs, plan)
    config = dict(configs[anchor])
    if adapter.spec.lm_head is not None:
        config["tie_word_embeddings"] = tied
    rule = MergeRule(
        recipe.method, recipe.parameters, recipe.models, has_base, adapter, device=linalg_device(placement)
    )

    start = time.perf_counter()
    if recipe.method == "fisher":
        spill = _Spill(None if workdir is None else Path(workdir))
        matched, matchers = _matched_inputs(sources, adapter, plan, anchor, progress, spill)
        timings["match"] = time.perf_counter() - start
        start = time.perf_counter()
        rule.fishers = _fishers(matched, config, batches, n_models, progress, placement, spill)
        timings["statistics"] = time.perf_counter() - start
        start = time.perf_counter()
        merge_sources(matched, adapter, rule, sink, anchor, None, tied, progress)
        timings["merge"] = time.perf_counter() - start
    else:
        layer_grams = None
        if recipe.method == "regmean":  # embeds the calibration tokens; each layer is measured in the merge pass
            layer_grams = LayerGrams(
                sources[:n_models],
                configs[:n_models],
                batches,
                placement,
                progress,
                spill=None if workdir is None else Path(workdir) / "grams",
            )
            timings["calibration_embed"] = time.perf_counter() - start
            start = time.perf_counter()
        matchers = merge_sources(sources, adapter, rule, sink, anchor, plan, tied, progress, layer_grams)
        timings["match_and_merge" if plan else "merge"] = time.perf_counter() - start
    distances = {names[j]: m.distances.summary() for j, m in enumerate(matchers or []) if m and j != anchor}
    return MergeOutcome(
        config=config, anchor=anchor, tied_output=tied, distances=distances, anchor_distances=to_mean, seconds=timings
    )


# --------------------------------------------------------------------------- entry points


@dataclass
class MergeResult:
    state_dict: Tensors
    outcome: MergeOutcome


def merge_state_dicts(
    state_dicts: list[Tensors],
    config,
    recipe: dict | MergeRecipe,
    base: Tensors | None = None,
    calibration_ids: torch.Tensor | None = None,
    progress: bool = False,
) -> MergeResult:
    """In-memory merge. ``recipe`` is a recipe mapping (or :class:`MergeRecipe`); its ``models``
    entries give weights/densities in the order of ``state_dicts`` (their ``model`` names are
    labels only) and ``base_model`` labels ``base``. Data-dependent methods take
    ``calibration_ids`` (1-D token ids)."""
    recipe = recipe if isinstance(recipe, MergeRecipe) else recipe_from_dict(recipe)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if len(recipe.models) != len(state_dicts) or (base is None) != (recipe.base_model is None):
        raise ValueError("the recipe's models and base_model must correspond to the state dicts given")
    dicts = list(state_dicts) + ([base] if base is not None else [])
    sink = DictSink()
    outcome = run_merge(
        [DictSource(d) for d in dicts],
        [config] * len(dicts),
        recipe.inputs,
        recipe,
        sink,
        calibration_ids,
        progress=progress,
    )
    return MergeResult(dict(sink), outcome)


class _CastingSink:
    """Writes floating tensors in the recipe's dtype."""

    def __init__(self, sink, dtype: torch.dtype | None):
        self.sink, self.dtype = sink, dtype

    def add(self, tensors: Tensors) -> None:
        if self.dtype is not None:
            tensors = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        self.sink.add(tensors)


@dataclass
class MergeReport:
    output: str
    method: str
    inputs: list[str]
    anchor: str
    matched: bool
    distances: dict
    seconds: float
    timings: dict
    evaluation: dict = field(default_factory=dict)


def _tokenizer_folder(folders: list[Path]) -> Path | None:
    return next((f for f in folders if vocabulary_fingerprint(f) is not None), None)


def merge_checkpoints(
    recipe: MergeRecipe,
    out: str | Path,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
    placement=None,
) -> MergeReport:
    """Merge the recipe's HF folders into ``out``: a stock folder with the anchor's config, the
    inputs' tokenizer and a model card (with the perplexities of the merge and of every input
    on the recipe's evaluation text, for causal LMs). ``placement`` (:func:`hf_symmetry.devices.resolve`):
    where RegMean's layer-wise calibration runs."""
    from ...text import read_text, tokenize_text
    from ...evaluation.compare import load_tokenizer

    start = time.perf_counter()
    check_output_dir(out, overwrite)
    folders = [resolve_model(m) for m in recipe.inputs]
    readers = [CheckpointReader(f) for f in folders]
    tok_folder = _tokenizer_folder(folders)
    calibration_ids = None
    if recipe.method in DATA_METHODS:
        text = resolve_text(recipe.calibration.text)
        if tok_folder is None:
            raise ValueError(f"{recipe.method} tokenises its calibration text, but no input folder has a tokenizer")
        calibration_ids = tokenize_text(load_tokenizer(tok_folder), read_text(text), recipe.calibration.tokens)
    if recipe.evaluation:
        resolve_text(recipe.evaluation.text)  # a missing evaluation text fails before any work
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": f"merge/{recipe.method}"})
        sink = _CastingSink(writer, _DTYPES[recipe.dtype] if recipe.dtype else None)
        spill = tmp / ".merge-work"  # Fisher's matched inputs and Fishers, RegMean's waiting Grams (removed)
        outcome = run_merge(
            readers,
            [r.config for r in readers],
            recipe.inputs,
            recipe,
            sink,
            calibration_ids,
            folders,
            progress,
            placement,
            workdir=spill if recipe.method in ("fisher", "regmean") else None,
        )
        shutil.rmtree(spill, ignore_errors=True)
        writer.close()
        config = dict(outcome.config)
        if recipe.dtype:
            config["dtype"] = recipe.dtype
        write_config(tmp, config)
        copy_side_files(tok_folder or folders[outcome.anchor], tmp)
        report = MergeReport(
            output=str(out),
            method=recipe.method,
            inputs=recipe.inputs,
            anchor=recipe.inputs[outcome.anchor],
            matched=recipe.match is not None,
            distances=outcome.distances,
            seconds=time.perf_counter() - start,
            timings=outcome.seconds,
        )
        write_card(tmp, "merge", merge_card_data(recipe, report, outcome))
    return report


def _is_causal_lm(config: dict) -> bool:
    arch = " ".join(config.get("architectures") or [])
    return "CausalLM" in arch or "LMHead" in arch


def evaluate_merge(
    out: str | Path,
    recipe: MergeRecipe,
    text: str | Path | None = None,
    tokens: int | None = None,
    device: str | None = "auto",
    progress: bool = True,
) -> dict:
    """Perplexity of the merge written to ``out`` and of every input on one text (the shared
    definition, :func:`hf_symmetry.evaluation.verification.perplexities`), recorded in the card:
    the merge's as model-index metadata, every input's in the card's table. Returns the figures
    (empty when the inputs are not causal LMs or have no tokenizer)."""
    from ...evaluation.verification import perplexities
    from ...hub.entries import perplexity_card_entry

    spec = recipe.evaluation or EvaluationSpec()
    text, tokens = text or spec.text, tokens or spec.tokens
    folders = [resolve_model(m) for m in recipe.inputs]
    tok_folder = _tokenizer_folder(folders)
    if tok_folder is None or not _is_causal_lm(json.loads((Path(out) / "config.json").read_text())):
        return {}
    labels = public_model_labels(recipe.inputs)
    models = {MERGED: Path(out), **dict(zip(labels, folders))}
    results, path = perplexities(models, text, tokens, tokenizer_from=tok_folder, device=device, progress=progress)
    merged = results.pop(MERGED)
    figures = {
        "text": public_text_label(text),
        "tokens": merged.tokens,
        "window": merged.window,
        "stride": merged.stride,
        "merged": merged.perplexity,
        "inputs": {name: r.perplexity for name, r in results.items()},
    }
    update_card(out, eval_results=[perplexity_card_entry(merged, path, tokens)], evaluation=figures)
    return figures


MERGED = "this merge"


def merge_card_data(recipe: MergeRecipe, report: MergeReport, outcome: MergeOutcome) -> dict:
    """What the model card says about a merge (inputs by distinct public names, no local path)."""
    label = dict(zip(recipe.inputs, public_model_labels(recipe.inputs)))
    models = [
        {"model": label[m.model], "weight": m.weight, **({"density": m.density} if recipe.method == "ties" else {})}
        for m in recipe.models
    ]
    params = {**recipe.parameters, "match": asdict(recipe.match) if recipe.match else False}
    if recipe.method in DATA_METHODS:
        params["calibration"] = {**asdict(recipe.calibration), "text": public_text_label(recipe.calibration.text)}
    return {
        "title": f"{recipe.method} merge of {', '.join(label[m.model] for m in recipe.models)}",
        "method": f"merge/{recipe.method}",
        "parameters": params,
        "inputs": recipe.inputs,
        "base_model": [hub_id_of(m) for m in recipe.inputs],  # lineage: every input's Hub ancestor, once
        "extra": {
            "models": models,
            "base": label.get(recipe.base_model),
            "anchor": label[report.anchor],
            "matched": recipe.match is not None,
            "distances": {label[k]: v for k, v in report.distances.items()},
            "timings_s": report.timings,
            "tied_embeddings": outcome.tied_output,
        },
    }
