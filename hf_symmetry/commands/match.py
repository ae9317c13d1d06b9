"""``hf-symmetry match ANCHOR SOURCE OUT``: SOURCE re-parametrised to sit as close as possible to
ANCHOR (same function as SOURCE), ready for averaging-style merges."""

from __future__ import annotations

from ..assets import resolve_model
from ..hub.values import fmt_number
from ..conversion.match.on_disk import match_checkpoint
from ..conversion.match.checks import vocabulary_fingerprint
from ..conversion.match.options import MatchOptions
from ..flags import add_flags, from_args
from .common import (
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
)
from .runner import Conversion, run_conversion


def register(sub) -> None:
    p = sub.add_parser(
        "match", help="align SOURCE to ANCHOR inside its symmetry orbit (same function as SOURCE)", description=__doc__
    )
    p.add_argument("anchor", help="reference model folder (or embedded alias); left unchanged")
    p.add_argument("source", help="model folder to align; the output computes its function")
    p.add_argument("out", help="output folder")
    add_flags(p, MatchOptions)
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
            from_args(MatchOptions, args),
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
