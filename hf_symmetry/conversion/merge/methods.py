"""The merge methods as classes (:class:`MergeMethod`): each owns what differs between methods — its
parameters and their defaults, whether it needs a base model, calibration data and which statistics
(Fishers, Grams), whether a tensor's rows merge on their own, how it combines tensors, whether it spills
to a work folder, what its model card adds. A recipe's method name (the YAML's ``merge_method``, the
CLI's ``--method``) is parsed once, by :func:`method_named` through :data:`MERGE_METHODS`; everything
after asks the object."""

from __future__ import annotations

import torch

from .tensor_rules import fisher_average, task_arithmetic, ties, weighted_average
from .statistics import check_fisher_memory, statistics_dtype

Tensor = torch.Tensor


class MergeMethod:
    """One merge method. ``defaults``: its parameters and their defaults (mergekit's where mergekit has
    the method). Stateless: the recipe's parameters and model entries come with each call."""

    name: str = ""
    defaults: dict = {}
    needs_base = False  # merges task vectors (model − base)
    uses_fishers = False  # Fisher merging: a diagonal Fisher per merged model, on the matched models
    uses_grams = False  # RegMean: Gram matrices of each linear layer's input
    row_separable = True  # each row of a tensor merged on its own (the globals can go a block of rows at a time)
    has_densities = False  # per-model ``density`` (TIES' trim)

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
    defaults = {"normalize": True}

    def weights_error(self, params: dict, weights: list[float]) -> str | None:
        if params.get("normalize", True) and sum(weights) == 0:
            return "model weights sum to zero, so they cannot be normalised"
        return None

    def combine(self, models, base, entries, params, fishers):
        return weighted_average(models, [e.weight for e in entries], params["normalize"])


class TaskArithmetic(MergeMethod):
    """``base + λ Σ w_i (θ_i − base)`` (not normalised unless ``normalize: true``)."""

    name = "task_arithmetic"
    defaults = {"lambda": 1.0, "normalize": False}
    needs_base = True

    def combine(self, models, base, entries, params, fishers):
        return task_arithmetic(base, models, [e.weight for e in entries], params["lambda"], params["normalize"])


class Ties(MergeMethod):
    """TIES: task vectors trimmed to each model's density, signs elected, agreeing entries averaged. The
    trim ranks a whole tensor's entries, so its rows do not merge on their own."""

    name = "ties"
    defaults = {"lambda": 1.0, "normalize": True}
    needs_base = True
    row_separable = False
    has_densities = True

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
    defaults = {"fisher_floor": 1e-12}
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
    defaults = {"alpha": 0.9}
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


def method_named(name: str) -> MergeMethod | None:
    """The method a recipe names (aliases resolved), or None for a name that is no method."""
    cls = MERGE_METHODS.get(METHOD_ALIASES.get(name, name))
    return cls() if cls is not None else None
