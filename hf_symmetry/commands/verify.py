"""``hf-symmetry verify ORIGINAL CONVERTED``: max |Δlogit| and Δ perplexity between two models."""

from __future__ import annotations

from ..evaluation.compare import verify
from .common import add_text_args, emit, fmt


def register(sub) -> None:
    p = sub.add_parser("verify", help="compare two models' outputs (max |Δlogit|, perplexities)",
                       description=__doc__)
    p.add_argument("original", help="reference model folder or embedded alias ('default')")
    p.add_argument("converted", help="model folder to check")
    add_text_args(p)
    p.add_argument("--tolerance", type=float, default=None,
                   help="exit with status 1 when max |Δlogit| exceeds this")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", dest="json_out", metavar="FILE")
    p.set_defaults(func=run)


def run(args) -> int:
    v = verify(args.original, args.converted, text=args.text, tokens=args.tokens, ppl_tokens=args.ppl_tokens,
               trust_remote_code=args.trust_remote_code)
    kind = "logit" if v.output_kind == "logits" else "hidden state"
    lines = [f"max |Δ{kind}| over {v.tokens} tokens of {v.text}: {v.max_abs_dlogit:.3e}"]
    if v.perplexity_original is not None:
        lines.append(f"perplexity original {v.perplexity_original:.4f}  converted {v.perplexity_converted:.4f}  "
                     f"Δ {fmt(v.delta_perplexity, '.3e')}")
    emit(v.as_dict(), lines, args.json_out)
    if args.tolerance is not None and v.max_abs_dlogit > args.tolerance:
        print(f"FAILED: {v.max_abs_dlogit:.3e} > tolerance {args.tolerance:g}")
        return 1
    return 0
