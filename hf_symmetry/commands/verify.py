"""``hf-symmetry verify ORIGINAL CONVERTED``: max |Δlogit| and Δ perplexity between two models."""

from __future__ import annotations

import math

from ..evaluation.verification import verify
from ..hub.values import fmt_number
from .common import add_verify_args, check_verify_args, emit


def register(sub) -> None:
    p = sub.add_parser("verify", help="compare two models' outputs (max |Δlogit|, perplexities)", description=__doc__)
    p.add_argument("original", help="reference model folder or embedded alias ('default')")
    p.add_argument("converted", help="model folder to check")
    add_verify_args(p, no_verify=False)
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="exit with status 1 when max |Δlogit| exceeds this (a NaN or infinite figure always does)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", dest="json_out", metavar="FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise ValueError(f"--tolerance must be a finite number >= 0; got {args.tolerance:g}")
    check_verify_args(args, args.original)
    v = verify(
        args.original,
        args.converted,
        text=args.text,
        tokens=args.tokens,
        ppl_tokens=args.ppl_tokens,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        progress=not args.quiet,
    )
    kind = "logit" if v.output_kind == "logits" else "hidden state"
    lines = [f"max |Δ{kind}| over {v.tokens} tokens of {v.text}: {fmt_number(v.max_abs_dlogit)}"]
    if v.hidden_cosine is not None:
        lines.append(f"mean cosine of last hidden states: {fmt_number(v.hidden_cosine)}")
    if v.perplexity_original is not None:
        lines.append(
            f"perplexity ({v.describe_perplexity()}): original {fmt_number(v.perplexity_original)}  "
            f"converted {fmt_number(v.perplexity_converted)}  Δ {fmt_number(v.delta_perplexity)}"
        )
    emit(v.as_dict(), lines, args.json_out)
    failure = v.failure()  # NaN never compares greater than a tolerance: a non-finite figure fails on its own
    if failure is not None:
        print(f"FAILED: {failure}")
        return 1
    if args.tolerance is not None and not v.max_abs_dlogit <= args.tolerance:
        print(f"FAILED: {v.max_abs_dlogit:.3e} > tolerance {args.tolerance:g}")
        return 1
    return 0
