"""``hf-symmetry match ANCHOR SOURCE OUT``: SOURCE re-parametrised to sit as close as possible to
ANCHOR (same function as SOURCE), ready for averaging-style merges."""

from __future__ import annotations

import argparse

from ..assets import resolve_model
from ..hub.values import fmt_number
from ..conversion.match.on_disk import match_checkpoint
from ..conversion.match.checks import vocabulary_fingerprint
from ..conversion.match.options import MatchOptions
from .common import (
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
)
from .runner import Conversion, run_conversion


def add_match_args(p, residual_help: str = "") -> None:
    """Matching options shared by ``match`` and ``merge --match``."""
    p.add_argument(
        "--heads",
        choices=["auto", "both", "qk", "vo", "none"],
        default="auto",
        help="per-KV-group head rotations to match (default auto: QK and VO, VO only under QK-norm)",
    )
    p.add_argument(
        "--ffn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="match FFN neurons by linear assignment (default: on)",
    )
    p.add_argument("--scaling", action="store_true", help="also match per-group QK and VO scalings (quartic)")
    p.add_argument(
        "--residual",
        action="store_true",
        help="also match the residual stream by Procrustes after norm fusion (RMSNorm families; "
        "norm weights become 1 and tied embeddings are untied)" + residual_help,
    )
    p.add_argument(
        "--residual-iters",
        type=int,
        default=0,
        help="refinement passes for the residual rotation over every weight (default 0: embeddings and LM head only)",
    )


def match_options(args) -> MatchOptions:
    return MatchOptions(
        heads=args.heads, ffn=args.ffn, scaling=args.scaling, residual=args.residual, residual_iters=args.residual_iters
    )


def register(sub) -> None:
    p = sub.add_parser(
        "match", help="align SOURCE to ANCHOR inside its symmetry orbit (same function as SOURCE)", description=__doc__
    )
    p.add_argument("anchor", help="reference model folder (or embedded alias); left unchanged")
    p.add_argument("source", help="model folder to align; the output computes its function")
    p.add_argument("out", help="output folder")
    add_match_args(p)
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    add_verify_args(p, "SOURCE")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    return run_conversion(Match(args))


class Match(Conversion):
    """``match``: SOURCE aligned to ANCHOR, verified against SOURCE (when SOURCE has a tokenizer)."""

    names = ("SOURCE", "matched")
    against = " against SOURCE"

    def check(self) -> None:
        check_verify_args(self.args, self.args.anchor)
        self.anchor, self.original = resolve_model(self.args.anchor), resolve_model(self.args.source)

    def inputs(self) -> list:
        return [self.anchor, self.original]

    def convert(self):
        args, anchor, source = self.args, self.anchor, self.original
        report = match_checkpoint(
            anchor,
            source,
            args.out,
            match_options(args),
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            progress=not args.quiet,
        )
        lines = [
            f"matched {report.family} model {source} to {anchor} -> {args.out} (conversion {report.seconds:.1f} s)",
            f"  matched: {', '.join(report.symmetries) or 'nothing'}",
        ]
        if report.untied_embeddings:
            lines.append("  embeddings untied (the final norm's γ is folded into lm_head)")
        lines.append(f"  squared distance to the anchor{' (norm-folded)' if args.residual else ''}:")
        for name, d in report.distances.items():
            lines.append(
                f"    {name:<10} {fmt_number(d['before'])} -> {fmt_number(d['after'])}  "
                f"({100 * d['reduction']:.1f} % less)"
            )
        return report, lines

    def verify(self, report, lines: list[str]) -> bool:
        if self.args.no_verify:
            return False
        if vocabulary_fingerprint(self.original) is None:
            lines.append("  verification skipped: SOURCE has no tokenizer")
            return False
        return super().verify(report, lines)
