"""``hf-symmetry rotate [MODEL] OUT``: write a functionally equivalent, re-parametrised checkpoint."""

from __future__ import annotations

from dataclasses import asdict

import time

from ..assets import resolve_model
from ..conversion.rotate import RotateOptions, rotate_checkpoint
from .common import (add_output_args, add_push_args, add_verify_args, check_verify_args, emit, push_if_requested,
                     total_time_line, verify_and_record)


def register(sub) -> None:
    p = sub.add_parser("rotate", help="apply random exact symmetries (residual/head rotations, FFN permutation)",
                       description=__doc__)
    p.add_argument("model", nargs="?", default="default",
                   help="HF model folder or embedded alias (default: SmolLM2-135M-Instruct)")
    p.add_argument("out", help="output folder")
    p.add_argument("--residual", choices=["none", "hadamard", "random"], default="hadamard",
                   help="residual-stream rotation after norm fusion (RMSNorm families only; default: hadamard)")
    p.add_argument("--heads", choices=["none", "qk", "vo", "random"], default="random",
                   help="per-KV-group head rotations: QK (inside the RoPE commutant), VO, or both (default)")
    p.add_argument("--ffn", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="randomly permute FFN neurons (default: on)")
    p.add_argument("--scaling", action="store_true", help="also apply random per-group QK and VO scalings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    add_verify_args(p, "the original")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    start = time.perf_counter()
    check_verify_args(args, args.model)
    src = resolve_model(args.model)
    options = RotateOptions(residual=args.residual, heads=args.heads, ffn=args.ffn, scaling=args.scaling,
                            seed=args.seed)
    report = rotate_checkpoint(src, args.out, options, overwrite=args.overwrite,
                               max_shard_size=args.max_shard_size, progress=not args.quiet)
    lines = [f"rotated {report.family} model {src} -> {args.out} (conversion {report.seconds:.1f} s)",
             f"  applied: {', '.join(report.applied) or 'nothing'} (seed {args.seed})"]
    if report.untied_embeddings:
        lines.append("  embeddings untied (the final norm's γ is folded into lm_head)")
    report.verification = verify_and_record(args, src, args.out, lines, ("original", "rotated"))
    summary = asdict(report)
    summary["push"] = push_if_requested(args, args.out, lines)
    lines.append(total_time_line(start))
    emit(summary, lines, args.json_out)
    return 0
