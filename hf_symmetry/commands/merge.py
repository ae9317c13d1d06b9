"""``hf-symmetry merge``: merge models of one architecture, from a recipe or the flags, optionally matching every
input to an anchor first. The methods, their flags and the help naming them come from the registry
(:data:`~hf_symmetry.conversion.merge.methods.MERGE_METHODS`)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from ..conversion.match.options import MatchOptions
from ..conversion.merge.evaluate import evaluate_merge
from ..conversion.merge.methods import MERGE_METHODS, METHOD_ALIASES, method_parameters
from ..conversion.merge.on_disk import merge_checkpoints
from ..conversion.merge.recipe import DTYPES, load_recipe, recipe_from_dict
from ..evaluation.verification import VerificationFailed, non_finite
from ..flags import add_flags, changed_flags, from_args
from ..hub.values import fmt_number
from .common import (
    add_device_args,
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
    emit,
    placement_from_args,
)
from .runner import Conversion, run_conversion


def _flag(param) -> str:
    return "--" + param.name.replace("_", "-")


def _parameters() -> list:
    """The methods' parameters that have a flag, in the order the help lists them."""
    return [p for p in method_parameters() if p.flag]


def _recipe_flags() -> list[tuple[str, str]]:
    """Flags that describe a merge, as (attribute, flag); with a recipe file they would be ambiguous."""
    return [
        ("base", "--base"),
        ("weights", "--weights"),
        *((p.attr, _flag(p)) for p in _parameters()),
        ("anchor", "--anchor"),
        ("calib_text", "--calib-text"),
        ("calib_tokens", "--calib-tokens"),
        ("dtype", "--dtype"),
        ("match", "--match"),
    ]


def _names(test) -> list[str]:
    return [name for name, cls in MERGE_METHODS.items() if test(cls())]


def add_parameter_args(p) -> None:
    """One flag per method parameter (:func:`~hf_symmetry.conversion.merge.methods.method_parameters`); None
    when not given, so that the recipe's defaults apply."""
    for param in _parameters():
        if param.type is bool:
            p.add_argument(_flag(param), dest=param.attr, action="store_true", default=None, help=param.help)
        else:
            p.add_argument(_flag(param), dest=param.attr, type=param.type, help=param.help)


def register(sub) -> None:
    description = (
        "``hf-symmetry merge RECIPE.yaml OUT`` or ``hf-symmetry merge --method METHOD [--match] A B [C ...] OUT``: "
        f"merge models of one architecture ({', '.join(m.title for m in MERGE_METHODS.values())}), optionally "
        "matching every input to an anchor first."
    )
    p = sub.add_parser(
        "merge", help=f"merge models ({'/'.join(MERGE_METHODS)}), optionally matched", description=description
    )
    aliases = ", ".join(f"{alias} = {name}" for alias, name in METHOD_ALIASES.items())
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="RECIPE.yaml OUT, or (with --method) MODEL MODEL [...] OUT"
    )
    p.add_argument(
        "--method",
        choices=list(MERGE_METHODS) + list(METHOD_ALIASES),
        help=f"merge method when no recipe is given ({aliases})",
    )
    p.add_argument("--match", action="store_true", help="match every input to the anchor before merging")
    add_flags(p, MatchOptions)
    needs_base = " and ".join(_names(lambda m: m.needs_base))
    p.add_argument("--base", help=f"base model (required by {needs_base}; the matching anchor)")
    p.add_argument(
        "--anchor", default="auto", help="matching anchor (default: the base, else the input nearest the mean)"
    )
    p.add_argument("--weights", type=float, nargs="+", help="one weight per model (default: all 1)")
    add_parameter_args(p)
    calibrated = "/".join(_names(lambda m: m.needs_calibration))
    p.add_argument("--calib-text", help=f"calibration text for {calibrated} (default: britannica-calib)")
    p.add_argument("--calib-tokens", type=int, help="calibration tokens (default: 4096)")
    add_device_args(p)
    add_verify_args(p, "the inputs (perplexity of the merge and of every input)")
    # the verification flags override the recipe's `evaluation:`; the older names still work
    p.set_defaults(text=None, ppl_tokens=None)
    p.add_argument("--eval-text", dest="text", help=argparse.SUPPRESS)
    p.add_argument("--eval-tokens", dest="ppl_tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-eval", dest="no_verify", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=DTYPES, help="output dtype")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def _given(args, name) -> bool:
    return getattr(args, name) not in (None, False, "auto")


def recipe_from_args(args):
    """The recipe the flags describe (validated like a YAML recipe)."""
    if args.method is None:
        if len(args.inputs) != 2:
            raise ValueError("give RECIPE.yaml OUT, or --method METHOD MODEL MODEL [...] OUT")
        given = [flag for attr, flag in _recipe_flags() if _given(args, attr)]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with a recipe file; put them in the recipe")
        return load_recipe(args.inputs[0]), args.inputs[1]
    *models, out = args.inputs
    stray = changed_flags(MatchOptions, args)
    if stray and not args.match:
        raise ValueError(f"{', '.join(stray)} only apply with --match")
    if args.weights is not None and len(args.weights) != len(models):
        raise ValueError(f"--weights gives {len(args.weights)} values for {len(models)} models")
    weights = args.weights or [1.0] * len(models)
    params = {p.name: getattr(args, p.attr) for p in _parameters() if getattr(args, p.attr) is not None}
    raw = {
        "merge_method": args.method,
        "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)],
        "parameters": params,
        "anchor": args.anchor,
    }
    if args.base:
        raw["base_model"] = args.base
    if args.match:
        raw["match"] = asdict(from_args(MatchOptions, args))
    calib = {k: v for k, v in (("text", args.calib_text), ("tokens", args.calib_tokens)) if v is not None}
    if calib:
        raw["calibration"] = calib
    if args.no_verify:
        raw["evaluation"] = False
    if args.dtype:
        raw["dtype"] = args.dtype
    return recipe_from_dict(raw), out


def evaluation_of(args, recipe) -> tuple[str, int] | None:
    """(text, tokens) the merge is evaluated on: the flags, else the recipe's ``evaluation:``;
    None with ``--no-verify`` or ``evaluation: false``."""
    if args.no_verify or recipe.evaluation is None:
        return None
    text = args.text or recipe.evaluation.text
    tokens = recipe.evaluation.tokens if args.ppl_tokens is None else args.ppl_tokens
    return (text, tokens) if tokens else None


def run(args) -> int:
    return run_conversion(Merge(args))


class Merge(Conversion):
    """``merge``: the recipe (a file or the flags), merged; its evaluation is the perplexity of the merge and of
    every input (:func:`~hf_symmetry.conversion.merge.evaluate.evaluate_merge`), not a comparison with one original."""

    def check(self) -> None:
        args = self.args
        self.placement = placement_from_args(args)  # an unusable device fails before any work
        self.recipe, self.out = recipe_from_args(args)
        self.evaluation = evaluation_of(args, self.recipe)
        if self.evaluation:
            args.text, args.ppl_tokens = self.evaluation
            check_verify_args(args)

    def inputs(self) -> list:
        return list(self.recipe.inputs)

    def convert(self):
        args, recipe, out = self.args, self.recipe, self.out
        report = merge_checkpoints(
            recipe,
            out,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            progress=not args.quiet,
            placement=self.placement,
        )
        lines = [
            f"{recipe.method.name} merge of {len(recipe.models)} models -> {out} (merge {report.seconds:.1f} s)",
            f"  anchor: {report.anchor}" + ("" if recipe.match else " (no matching)"),
        ]
        for name, d in report.distances.items():
            t = d["total"]
            lines.append(
                f"  matched {name}: squared distance {fmt_number(t['before'])} -> {fmt_number(t['after'])} "
                f"({100 * t['reduction']:.1f} % less)"
            )
        return report, lines

    def verify(self, report, lines: list[str]) -> bool:
        if not self.evaluation:
            return False
        args = self.args
        report.evaluation = ev = evaluate_merge(
            self.out, self.recipe, *self.evaluation, device=args.device, progress=not args.quiet
        )
        if ev:
            lines.append(
                f"  perplexity (first {ev['tokens']} tokens of {ev['text']}, sliding window {ev['window']}, "
                f"stride {ev['stride']}): merge {fmt_number(ev['merged'])}; "
                + ", ".join(f"{n} {fmt_number(v)}" for n, v in ev["inputs"].items())
            )
            if non_finite({"merged": ev["merged"]}):  # (as every conversion's verification: OUT stays, exit 1)
                emit({}, lines)
                raise VerificationFailed(
                    f"{self.out} was written but failed verification: its perplexity is {ev['merged']}"
                )
        return True
