"""Merge recipes: a YAML file in the style of mergekit, checked completely before any work.

```yaml
merge_method: ties            # average (alias: linear) | task_arithmetic | ties | fisher | regmean
base_model: ./smollm2         # required by task_arithmetic and ties; the matching anchor when given
models:
  - model: ./finetune-a
    parameters: {weight: 1.0, density: 0.5}
  - model: ./finetune-b
    parameters: {weight: 1.0, density: 0.5}
parameters: {lambda: 1.0}     # method parameters; weight/density here are defaults for every model
match: {heads: auto, ffn: true, scaling: false, residual: false, residual_iters: 0, anchor: auto}
calibration: {text: britannica-calib, tokens: 4096, seq_len: 256, batch_size: 4}   # fisher, regmean
evaluation: {text: britannica-eval, tokens: 2048}   # perplexities for the model card (or: false)
dtype: float32                # output dtype (default: the anchor's)
```
``match: true`` takes every matching default; no ``match`` key (or ``false``) merges as given.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from ...calibration import CalibrationText
from ..match.options import MatchOptions
from .methods import METHODS, MergeMethod, method_named, method_parameters, methods_with

# set on each model entry (the recipe's `parameters` give the default for all): the weight, and the methods' own
MODEL_PARAMETERS = {"weight": 1.0, **{p.name: p.default for p in method_parameters() if p.per_model}}
DTYPES = ("float32", "float16", "bfloat16", "float64")
#: a recipe's calibration text where it names none (or only some of its keys): fisher's and regmean's
CALIBRATION = CalibrationText("britannica-calib", tokens=4096, seq_len=256, batch_size=4)
_TOP_KEYS = (
    "merge_method",
    "method",
    "base_model",
    "models",
    "parameters",
    "match",
    "calibration",
    "evaluation",
    "dtype",
    "anchor",
)
_MATCH_KEYS = ("enabled", "heads", "ffn", "scaling", "residual", "residual_iters", "anchor")


@dataclass
class ModelEntry:
    model: str
    weight: float = 1.0
    density: float = 1.0


@dataclass
class EvaluationText:
    text: str = "britannica-eval"
    tokens: int = 2048


@dataclass
class MergeRecipe:
    method: MergeMethod  # parsed from the recipe's name once (:func:`~.methods.method_named`)
    models: list[ModelEntry]
    base_model: str | None = None
    parameters: dict = field(default_factory=dict)
    match: MatchOptions | None = None
    anchor: str = "auto"
    calibration: CalibrationText = CALIBRATION
    evaluation: EvaluationText | None = field(default_factory=EvaluationText)
    dtype: str | None = None

    @property
    def inputs(self) -> list[str]:
        """Every input model: the merged ones, then the base."""
        return [m.model for m in self.models] + ([self.base_model] if self.base_model else [])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["method"] = self.method.name
        d["match"] = asdict(self.match) if self.match else None
        return d


def _fail(msg: str) -> None:
    raise ValueError(f"merge recipe: {msg}")


def _check_keys(given: dict, allowed, where: str) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        _fail(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in {where} "
            f"(allowed: {', '.join(allowed)})"
        )


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(f"{name} must be a number, got {value!r}")
    return float(value)


def _method(raw: dict) -> MergeMethod:
    name = raw.get("merge_method", raw.get("method"))
    if name is None:
        _fail(f"no merge_method given (choose one of {', '.join(METHODS)})")
    method = method_named(str(name))
    if method is None:
        _fail(
            f"unknown merge method {raw.get('merge_method', raw.get('method'))!r}; choose one of "
            f"{', '.join(METHODS)} (linear = average)"
        )
    return method


def _parameters(raw: dict, method: MergeMethod) -> tuple[dict, dict]:
    """(method parameters with defaults, per-model defaults)."""
    given = dict(raw.get("parameters") or {})
    if not isinstance(given, dict):
        _fail("parameters must be a mapping")
    allowed = {**method.defaults, **MODEL_PARAMETERS}
    _check_keys(given, allowed, f"parameters of {method.name}")
    params = dict(method.defaults)
    model_defaults = dict(MODEL_PARAMETERS)
    types = {p.name: p.type for p in method.parameters}
    for k, v in given.items():
        if types.get(k) is bool:
            if not isinstance(v, bool):
                _fail(f"{k} must be true or false")
            params[k] = v
        elif k in MODEL_PARAMETERS:
            _check_model_parameter(k, method, "")
            model_defaults[k] = _number(v, k)
        else:
            params[k] = _number(v, k)
    error = method.parameter_error(params)
    if error:
        _fail(error)
    return params, model_defaults


def _check_model_parameter(name: str, method: MergeMethod, where: str) -> None:
    if name != "weight" and name not in method.model_parameters:
        _fail(f"{name} applies to {' and '.join(methods_with(name))} only{where}")


def _models(raw: dict, method: MergeMethod, defaults: dict) -> list[ModelEntry]:
    items = raw.get("models")
    if not isinstance(items, list) or not items:
        _fail("models must be a non-empty list of {model: PATH, parameters: {...}}")
    out = []
    for item in items:
        item = {"model": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or "model" not in item:
            _fail(f"each entry of models needs a 'model' key; got {item!r}")
        _check_keys(item, ("model", "parameters"), f"model entry {item['model']!r}")
        p = dict(item.get("parameters") or {})
        _check_keys(p, tuple(MODEL_PARAMETERS), f"parameters of {item['model']!r}")
        for k in p:
            _check_model_parameter(k, method, f" (model {item['model']!r})")
        entry = ModelEntry(
            model=str(item["model"]),
            weight=_number(p.get("weight", defaults["weight"]), "weight"),
            density=_number(p.get("density", defaults["density"]), "density"),
        )
        if not 0 < entry.density <= 1:
            _fail(f"density of {entry.model!r} must be in (0, 1]; got {entry.density}")
        out.append(entry)
    return out


def _match(raw) -> tuple[MatchOptions | None, str]:
    value = raw.get("match")
    anchor = str(raw.get("anchor", "auto"))
    if value is None or value is False:
        return None, anchor
    if value is True:
        return MatchOptions(), anchor
    if not isinstance(value, dict):
        _fail("match must be true, false or a mapping of matching options")
    _check_keys(value, _MATCH_KEYS, "match")
    if value.get("enabled", True) is False:
        return None, anchor
    opts = {k: v for k, v in value.items() if k not in ("enabled", "anchor")}
    for k in ("ffn", "scaling", "residual"):
        if k in opts and not isinstance(opts[k], bool):
            _fail(f"match.{k} must be true or false")
    if "residual_iters" in opts and (not isinstance(opts["residual_iters"], int) or opts["residual_iters"] < 0):
        _fail("match.residual_iters must be a non-negative integer")
    if opts.get("residual_iters") and not opts.get("residual"):
        _fail("match.residual_iters needs match.residual: true")
    if "heads" in opts and opts["heads"] not in ("auto", "both", "qk", "vo", "none"):
        _fail(f"match.heads must be one of auto, both, qk, vo, none; got {opts['heads']!r}")
    return MatchOptions(**opts), str(value.get("anchor", anchor))


def _section(raw: dict, key: str, default):
    """The recipe's ``key`` section: ``default`` with the keys it gives replaced (None for ``false``)."""
    value = raw.get(key, None)
    if value is None:
        return default
    if value is False:
        return None
    if not isinstance(value, dict):
        _fail(f"{key} must be a mapping")
    _check_keys(value, tuple(f.name for f in fields(default)), key)
    spec = replace(default, **value)
    for name in ("tokens", "seq_len", "batch_size"):
        v = getattr(spec, name, 1)
        if not isinstance(v, int) or v < 1:
            _fail(f"{key}.{name} must be a positive integer")
    return spec


def recipe_from_dict(raw: dict) -> MergeRecipe:
    """Validate a recipe mapping (parsed YAML); every error is a one-line ValueError."""
    if not isinstance(raw, dict):
        _fail("the recipe must be a YAML mapping")
    _check_keys(raw, _TOP_KEYS, "the recipe")
    method = _method(raw)
    params, defaults = _parameters(raw, method)
    models = _models(raw, method, defaults)
    base = raw.get("base_model")
    base = str(base) if base else None
    if method.needs_base and not base:
        _fail(f"{method.name} merges task vectors (model − base): it needs base_model")
    if len(models) < 2 and not (method.needs_base and base):
        _fail(f"{method.name} needs at least two models")
    error = method.weights_error(params, [m.weight for m in models])
    if error:
        _fail(error)
    match, anchor = _match(raw)
    if anchor != "auto" and anchor not in [m.model for m in models] + [base]:
        _fail(f"anchor {anchor!r} is not one of the input models")
    calibration = _section(raw, "calibration", CALIBRATION)
    if calibration is None and method.needs_calibration:
        _fail(f"{method.name} needs calibration text")
    evaluation = _section(raw, "evaluation", EvaluationText())
    dtype = raw.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        _fail(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return MergeRecipe(
        method=method,
        models=models,
        base_model=base,
        parameters=params,
        match=match,
        anchor=anchor,
        calibration=calibration or CALIBRATION,
        evaluation=evaluation,
        dtype=dtype,
    )


def load_recipe(path: str | os.PathLike) -> MergeRecipe:
    """Read and validate a YAML recipe. Relative model paths are taken relative to the recipe's
    folder when they exist there (as one would write them next to the recipe)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"merge recipe {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    recipe = recipe_from_dict(raw)

    def near(p: str | None) -> str | None:
        if p is None or Path(p).is_absolute() or Path(p).exists():
            return p
        local = path.parent / p
        return str(local) if local.exists() else p

    for m in recipe.models:
        m.model = near(m.model)
    recipe.base_model = near(recipe.base_model)
    recipe.anchor = near(recipe.anchor) if recipe.anchor != "auto" else "auto"
    return recipe
