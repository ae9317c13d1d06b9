"""``hf-symmetry merge RECIPE.yaml OUT`` or ``hf-symmetry merge --method METHOD [--match] A B [C ...] OUT``:
merge models of one architecture (average, task arithmetic, TIES, Fisher, RegMean), optionally
matching every input to an anchor first."""

from __future__ import annotations

from dataclasses import asdict

from ..conversion.merge import merge_checkpoints
from ..conversion.recipe import METHOD_ALIASES, METHODS, load_recipe, recipe_from_dict
from .common import add_output_args, add_push_args, emit, push_if_requested
from .match import add_match_args

# Flags that describe a merge; with a recipe file they would be ambiguous.
_RECIPE_FLAGS = ("base", "weights", "density", "lam", "alpha", "normalize", "anchor", "calib_text", "calib_tokens",
                 "eval_text", "eval_tokens", "no_eval", "dtype", "match")


def register(sub) -> None:
    p = sub.add_parser("merge", help="merge models (average/task_arithmetic/ties/fisher/regmean), optionally matched",
                       description=__doc__)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="RECIPE.yaml OUT, or (with --method) MODEL MODEL [...] OUT")
    p.add_argument("--method", choices=list(METHODS) + list(METHOD_ALIASES),
                   help="merge method when no recipe is given (linear = average)")
    p.add_argument("--match", action="store_true", help="match every input to the anchor before merging")
    add_match_args(p)
    p.add_argument("--base", help="base model (required by task_arithmetic and ties; the matching anchor)")
    p.add_argument("--anchor", default="auto", help="matching anchor (default: the base, else the input nearest "
                   "the mean)")
    p.add_argument("--weights", type=float, nargs="+", help="one weight per model (default: all 1)")
    p.add_argument("--density", type=float, help="TIES: fraction of each task vector kept (default 1)")
    p.add_argument("--lambda", dest="lam", type=float, help="task_arithmetic/ties: task-vector scale (default 1)")
    p.add_argument("--alpha", type=float, help="RegMean: off-diagonal scale of the Gram matrices (default 0.9)")
    p.add_argument("--normalize", action="store_true", default=None, help="divide by the sum of weights")
    p.add_argument("--calib-text", help="calibration text for fisher/regmean (default: britannica-calib)")
    p.add_argument("--calib-tokens", type=int, help="calibration tokens (default: 4096)")
    p.add_argument("--eval-text", help="text for the card's perplexities (default: britannica-eval)")
    p.add_argument("--eval-tokens", type=int, help="evaluation tokens (default: 2048)")
    p.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluation")
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
    stray = [flag for flag, on in (("--heads", args.heads != "auto"), ("--no-ffn", not args.ffn),
                                   ("--scaling", args.scaling), ("--residual", args.residual),
                                   ("--residual-iters", args.residual_iters != 0)) if on]
    if stray and not args.match:
        raise ValueError(f"{', '.join(stray)} only apply with --match")
    if args.weights is not None and len(args.weights) != len(models):
        raise ValueError(f"--weights gives {len(args.weights)} values for {len(models)} models")
    weights = args.weights or [1.0] * len(models)
    params = {k: v for k, v in (("density", args.density), ("lambda", args.lam), ("alpha", args.alpha),
                                ("normalize", args.normalize)) if v is not None}
    raw = {"merge_method": args.method, "models": [{"model": m, "parameters": {"weight": w}}
                                                   for m, w in zip(models, weights)],
           "parameters": params, "anchor": args.anchor}
    if args.base:
        raw["base_model"] = args.base
    if args.match:
        raw["match"] = {"heads": args.heads, "ffn": args.ffn, "scaling": args.scaling, "residual": args.residual,
                        "residual_iters": args.residual_iters}
    calib = {k: v for k, v in (("text", args.calib_text), ("tokens", args.calib_tokens)) if v is not None}
    if calib:
        raw["calibration"] = calib
    if args.no_eval:
        raw["evaluation"] = False
    else:
        ev = {k: v for k, v in (("text", args.eval_text), ("tokens", args.eval_tokens)) if v is not None}
        if ev:
            raw["evaluation"] = ev
    if args.dtype:
        raw["dtype"] = args.dtype
    return recipe_from_dict(raw), out


def run(args) -> int:
    recipe, out = recipe_from_args(args)
    report = merge_checkpoints(recipe, out, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                               progress=not args.quiet)
    lines = [f"{recipe.method} merge of {len(recipe.models)} models -> {out} in {report.seconds:.1f} s",
             f"  anchor: {report.anchor}" + ("" if recipe.match else " (no matching)")]
    for name, d in report.distances.items():
        t = d["total"]
        lines.append(f"  matched {name}: squared distance {t['before']:.4e} -> {t['after']:.4e} "
                     f"({100 * t['reduction']:.1f} % less)")
    ev = report.evaluation
    if ev:
        lines.append(f"  perplexity on {ev['tokens']} tokens of {ev['text']}: merge {ev['merged']:.4f}; "
                     + ", ".join(f"{n} {v:.4f}" for n, v in ev["inputs"].items()))
    summary = asdict(report)
    summary["push"] = push_if_requested(args, out, lines)
    emit(summary, lines, args.json_out)
    return 0
