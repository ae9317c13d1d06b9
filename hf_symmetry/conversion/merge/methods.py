"""The merge methods as classes (:class:`MergeMethod`), registered in :data:`MERGE_METHODS` (mergekit's
registry is the model): each declares, as data, its name, its paper and its parameters
(:class:`Parameter`: name, type, default, help; the recipe checks them and ``hf-symmetry merge`` makes its
flags from them), and owns what else differs between methods — whether it needs a base model, calibration
data and which statistics (Fishers, Grams), whether a tensor's rows merge on their own, how it combines
tensors, whether it spills to a work folder, what its model card adds. A recipe's method name (the YAML's
``merge_method``, the CLI's ``--method``) is parsed once, by :func:`method_named`; everything after asks the
object."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .tensor_rules import fisher_average, task_arithmetic, ties, weighted_average
from .statistics import check_fisher_memory, statistics_dtype

Tensor = torch.Tensor


@dataclass(frozen=True)
class Parameter:
    """One parameter of a merge method: its recipe key, type (``float`` or ``bool``), default and the help of
    its ``hf-symmetry merge`` flag (``--NAME``; none when ``flag`` is False). ``per_model``: set on each model
    entry (the recipe's ``parameters`` give the default for all), like TIES' ``density``."""

    name: str
    type: type
    default: object
    help: str
    flag: bool = True
    per_model: bool = False
    dest: str = ""  # the argparse attribute, where the name is a Python keyword (``lambda``)

    @property
    def attr(self) -> str:
        """The attribute of the parsed arguments that holds the flag's value."""
        return self.dest or self.name

    def defaulting_to(self, default) -> Parameter:
        """The same parameter with another method's default."""
        return replace(self, default=default)


# parameters two or more methods share (one help for their one flag)
LAMBDA = Parameter("lambda", float, 1.0, "task_arithmetic/ties: task-vector scale (default 1)", dest="lam")
NORMALIZE = Parameter("normalize", bool, True, "divide by the sum of weights")


class MergeMethod:
    """One merge method. ``paper``: where it comes from; ``parameters``: what a recipe may set, with the
    defaults (mergekit's where mergekit has the method). Stateless: the recipe's parameters and model entries
    come with each call."""

    name: str = ""
    title: str = ""  # as prose names it (the command's description)
    paper: str = ""
    parameters: tuple[Parameter, ...] = ()
    needs_base = False  # merges task vectors (model − base)
    uses_fishers = False  # Fisher merging: a diagonal Fisher per merged model, on the matched models
    uses_grams = False  # RegMean: Gram matrices of each linear layer's input
    row_separable = True  # each row of a tensor merged on its own (the globals can go a block of rows at a time)

    @property
    def defaults(self) -> dict:
        """The method's parameters (not the per-model ones) and their defaults."""
        return {p.name: p.default for p in self.parameters if not p.per_model}

    @property
    def model_parameters(self) -> tuple[str, ...]:
        """The names of its per-model parameters."""
        return tuple(p.name for p in self.parameters if p.per_model)

    @property
    def needs_calibration(self) -> bool:
        """Whether it runs the models on calibration text (for its statistics)."""
        return self.uses_fishers or self.uses_grams

    @property
    def spills(self) -> bool:
        """Whether a merge of folders keeps statistics (and, for Fisher, the matched inputs) in a work
        folder beside the output rather than in memory."""
        return self.needs_calibration

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def parameter_error(self, params: dict) -> str | None:
        """What is wrong with the method's parameters, if anything."""
        return None

    def weights_error(self, params: dict, weights: list[float]) -> str | None:
        """What is wrong with the models' weights for this method, if anything."""
        return None

    def combine(
        self, models: list[Tensor], base: Tensor | None, entries: list, params: dict, fishers: list[Tensor] | None
    ) -> Tensor:
        """The merged tensor (float64) of the merged models' ``models`` (and the base's ``base``),
        weighted by ``entries`` (:class:`~.recipe.ModelEntry`)."""
        raise NotImplementedError

    def check_model(self, adapter) -> None:
        """Refuse, before any work, an architecture the method cannot merge."""

    def check_fits(self, source, placement) -> None:
        """Refuse, before any work, a model whose statistics cannot be computed where placed."""

    def card_model(self, entry) -> dict:
        """What the model card lists for a merged model beyond its name and weight."""
        return {}


class Average(MergeMethod):
    """``linear``/average: ``Σ w_i θ_i / Σ w_i`` (not divided with ``normalize: false``)."""

    name = "average"
    title = "average"
    paper = "Wortsman et al., Model soups, ICML 2022 (arXiv:2203.05482)"
    parameters = (NORMALIZE,)

    def weights_error(self, params: dict, weights: list[float]) -> str | None:
        if params.get("normalize", True) and sum(weights) == 0:
            return "model weights sum to zero, so they cannot be normalised"
        return None

    def combine(self, models, base, entries, params, fishers):
        return weighted_average(models, [e.weight for e in entries], params["normalize"])


class TaskArithmetic(MergeMethod):
    """``base + λ Σ w_i (θ_i − base)`` (not normalised unless ``normalize: true``)."""

    name = "task_arithmetic"
    title = "task arithmetic"
    paper = "Ilharco et al., Editing Models with Task Arithmetic, ICLR 2023 (arXiv:2212.04089)"
    parameters = (LAMBDA, NORMALIZE.defaulting_to(False))
    needs_base = True

    def combine(self, models, base, entries, params, fishers):
        return task_arithmetic(base, models, [e.weight for e in entries], params["lambda"], params["normalize"])


class Ties(MergeMethod):
    """TIES: task vectors trimmed to each model's density, signs elected, agreeing entries averaged. The
    trim ranks a whole tensor's entries, so its rows do not merge on their own."""

    name = "ties"
    title = "TIES"
    paper = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models, NeurIPS 2023 (arXiv:2306.01708)"
    parameters = (
        Parameter("density", float, 1.0, "TIES: fraction of each task vector kept (default 1)", per_model=True),
        LAMBDA,
        NORMALIZE,
    )
    needs_base = True
    row_separable = False

    def combine(self, models, base, entries, params, fishers):
        return ties(
            base,
            models,
            [e.weight for e in entries],
            [e.density for e in entries],
            params["lambda"],
            params["normalize"],
        )

    def card_model(self, entry) -> dict:
        return {"density": entry.density}


class Fisher(MergeMethod):
    """Fisher merging: element-wise average weighted by each model's diagonal Fisher (computed on the
    matched models, a backward pass over the whole model, so it needs a language-model head and memory
    for the whole model). Rows are not merged a block at a time: it reads its Fishers beside each tensor."""

    name = "fisher"
    title = "Fisher"
    paper = "Matena and Raffel, Merging Models with Fisher-Weighted Averaging, NeurIPS 2022 (arXiv:2111.09832)"
    parameters = (
        Parameter(
            "fisher_floor",
            float,
            1e-12,
            "added to every Fisher entry (an entry no token touched gets the weighted average)",
            flag=False,
        ),
    )
    uses_fishers = True
    row_separable = False

    def parameter_error(self, params: dict) -> str | None:
        return "fisher_floor must be >= 0" if params["fisher_floor"] < 0 else None

    def combine(self, models, base, entries, params, fishers):
        return fisher_average(models, fishers, [e.weight for e in entries], params["fisher_floor"])

    def check_model(self, adapter) -> None:
        if adapter.spec.lm_head is None:
            raise ValueError(
                f"Fisher merging needs a language-model head to define a likelihood; {adapter.family} "
                "base models have none (use average or regmean)"
            )

    def check_fits(self, source, placement) -> None:
        check_fisher_memory(source.shapes(), statistics_dtype(source), placement)


class RegMean(MergeMethod):
    """RegMean: each linear weight solved from the models' Grams of its input (:class:`~.rule.MergeRule`
    and :mod:`.stream` call the solvers); every other tensor (biases, norms, embeddings) averaged."""

    name = "regmean"
    title = "RegMean"
    paper = "Jin et al., Dataless Knowledge Fusion by Merging Weights of Language Models, ICLR 2023 (arXiv:2212.09849)"
    parameters = (Parameter("alpha", float, 0.9, "RegMean: off-diagonal scale of the Gram matrices (default 0.9)"),)
    uses_grams = True

    def parameter_error(self, params: dict) -> str | None:
        return None if 0 <= params["alpha"] <= 1 else f"alpha must be in [0, 1]; got {params['alpha']}"

    def combine(self, models, base, entries, params, fishers):
        return weighted_average(models, [e.weight for e in entries])


MERGE_METHODS: dict[str, type[MergeMethod]] = {
    m.name: m for m in (Average, TaskArithmetic, Ties, Fisher, RegMean)
}  # the one table from names to classes
METHOD_ALIASES = {"linear": "average"}
METHODS = tuple(MERGE_METHODS)  # the user-facing names, in the order help and errors list them
_KIND_ORDER = {float: 1, bool: 2}


def method_parameters() -> list[Parameter]:
    """Every method's parameters, one per name (the first method's declaration), in the order
    ``hf-symmetry merge`` lists their flags: per-model ones, then numbers, then switches."""
    seen: dict[str, Parameter] = {}
    for cls in MERGE_METHODS.values():
        for p in cls.parameters:
            seen.setdefault(p.name, p)
    return sorted(seen.values(), key=lambda p: 0 if p.per_model else _KIND_ORDER.get(p.type, 1))


def methods_with(parameter: str) -> list[str]:
    """The names of the methods that take ``parameter``."""
    return [name for name, cls in MERGE_METHODS.items() if any(p.name == parameter for p in cls.parameters)]


def method_named(name: str) -> MergeMethod | None:
    """The method a recipe names (aliases resolved), or None for a name that is no method."""
    cls = MERGE_METHODS.get(METHOD_ALIASES.get(name, name))
    return cls() if cls is not None else None
