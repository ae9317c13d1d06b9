"""The ``hf-symmetry`` command. Each subcommand lives in ``hf_symmetry/commands/<name>.py``
and provides ``register(subparsers)`` (adding its parser, with ``func=run``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands.common import progress_bars
from .commands.inputs import check_inputs
from .evaluation.verification import VerificationFailed

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


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one change: a bad argument prints one line (``hf-symmetry CMD: error: ...``, as
    every other refusal), without the usage lines; ``--help`` is unchanged. Subparsers are of the same class."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
        check_inputs(args)  # every model folder, text and output file, before any work (commands/inputs.py)
        with progress_bars(not getattr(args, "quiet", False)):
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hf-symmetry: interrupted", file=sys.stderr)
        return 130
    except VerificationFailed as exc:  # OUT was written, its figures are NaN or infinite: not the user's input
        print(f"hf-symmetry {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, ValueError, NotImplementedError) as exc:
        # One line, no traceback: these are the user's input, not our bugs.
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"hf-symmetry {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
