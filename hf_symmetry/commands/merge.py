"""``hf-symmetry merge RECIPE.yaml OUT`` or ``hf-symmetry merge --method METHOD [--match] A B [C ...] OUT``:
merge models of one architecture (average, task arithmetic, TIES, Fisher, RegMean), optionally
matching every input to an anchor first."""

from __future__ import annotations

import argparse

from ..conversion.merge.evaluate import evaluate_merge
from ..conversion.merge.methods import METHOD_ALIASES, METHODS
from ..conversion.merge.on_disk import merge_checkpoints
from ..conversion.merge.recipe import load_recipe, recipe_from_dict
from ..hub.values import fmt_number
from .common import (
    add_device_args,
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
    placement_from_args,
)
from .match import add_match_args
from .runner import Conversion, run_conversion

# Flags that describe a merge; with a recipe file they would be ambiguous.
_RECIPE_FLAGS = (
    "base",
    "weights",
    "density",
    "lam",
    "alpha",
    "normalize",
    "anchor",
    "calib_text",
    "calib_tokens",
    "dtype",
    "match",
)


def register(sub) -> None:
    p = sub.add_parser(
        "merge",
        help="merge models (average/task_arithmetic/ties/fisher/regmean), optionally matched",
        description=__doc__,
    )
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="RECIPE.yaml OUT, or (with --method) MODEL MODEL [...] OUT"
    )
    p.add_argument(
        "--method",
        choices=list(METHODS) + list(METHOD_ALIASES),
        help="merge method when no recipe is given (linear = average)",
    )
    p.add_argument("--match", action="store_true", help="match every input to the anchor before merging")
    add_match_args(p)
    p.add_argument("--base", help="base model (required by task_arithmetic and ties; the matching anchor)")
    p.add_argument(
        "--anchor", default="auto", help="matching anchor (default: the base, else the input nearest the mean)"
    )
    p.add_argument("--weights", type=float, nargs="+", help="one weight per model (default: all 1)")
    p.add_argument("--density", type=float, help="TIES: fraction of each task vector kept (default 1)")
    p.add_argument("--lambda", dest="lam", type=float, help="task_arithmetic/ties: task-vector scale (default 1)")
    p.add_argument("--alpha", type=float, help="RegMean: off-diagonal scale of the Gram matrices (default 0.9)")
    p.add_argument("--normalize", action="store_true", default=None, help="divide by the sum of weights")
    p.add_argument("--calib-text", help="calibration text for fisher/regmean (default: britannica-calib)")
    p.add_argument("--calib-tokens", type=int, help="calibration tokens (default: 4096)")
    add_device_args(p)
    add_verify_args(p, "the inputs (perplexity of the merge and of every input)")
    # the verification flags override the recipe's `evaluation:`; the older names still work
    p.set_defaults(text=None, ppl_tokens=None)
    p.add_argument("--eval-text", dest="text", help=argparse.SUPPRESS)
    p.add_argument("--eval-tokens", dest="ppl_tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-eval", dest="no_verify", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], help="output dtype")
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
        given = [f"--{n.replace('_', '-')}" for n in _RECIPE_FLAGS if _given(args, n)]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with a recipe file; put them in the recipe")
        return load_recipe(args.inputs[0]), args.inputs[1]
    *models, out = args.inputs
    stray = [
        flag
        for flag, on in (
            ("--heads", args.heads != "auto"),
            ("--no-ffn", not args.ffn),
            ("--scaling", args.scaling),
            ("--residual", args.residual),
            ("--residual-iters", args.residual_iters != 0),
        )
        if on
    ]
    if stray and not args.match:
        raise ValueError(f"{', '.join(stray)} only apply with --match")
    if args.weights is not None and len(args.weights) != len(models):
        raise ValueError(f"--weights gives {len(args.weights)} values for {len(models)} models")
    weights = args.weights or [1.0] * len(models)
    params = {
        k: v
        for k, v in (
            ("density", args.density),
            ("lambda", args.lam),
            ("alpha", args.alpha),
            ("normalize", args.normalize),
        )
        if v is not None
    }
    raw = {
        "merge_method": args.method,
        "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)],
        "parameters": params,
        "anchor": args.anchor,
    }
    if args.base:
        raw["base_model"] = args.base
    if args.match:
        raw["match"] = {
            "heads": args.heads,
            "ffn": args.ffn,
            "scaling": args.scaling,
            "residual": args.residual,
            "residual_iters": args.residual_iters,
        }
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
        return True
