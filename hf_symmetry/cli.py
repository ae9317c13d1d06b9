"""The ``hf-symmetry`` command. Each subcommand lives in ``hf_symmetry/commands/<name>.py``
and provides ``register(subparsers)`` (adding its parser, with ``func=run``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands.common import progress_bars

# Order here is the order of ``hf-symmetry --help``.
COMMAND_MODULES = [
    "rotate",
    "verify",
    "eval",
    "to-tpa",
    "match",
    "merge",
    "spectra",
    "farr",
    "compress",
    "export-gguf",
    "heal",
    "push",
    "families",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-symmetry",
        description="Exact transformer weight symmetries: rotate, verify, evaluate, match, merge, compress.",
    )
    parser.add_argument("--version", action="version", version=f"hf_symmetry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"hf_symmetry.commands.{name.replace('-', '_')}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with progress_bars(not getattr(args, "quiet", False)):
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hf-symmetry: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, FileExistsError, ValueError, NotImplementedError) as exc:
        # One line, no traceback: these are the user's input, not our bugs.
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"hf-symmetry {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
