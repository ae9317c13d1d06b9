"""The ``hf-symmetry`` command. Each subcommand lives in ``hf_symmetry/commands/<name>.py``
and provides ``register(subparsers)`` (adding its parser, with ``func=run``)."""

from __future__ import annotations

import argparse
import errno
import importlib
import signal
import sys
import threading
from pathlib import Path

from . import __version__
from .assets import build_folders
from .checkpoint_io import remove_stale_leftovers
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


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (what ``timeout``, Docker, Slurm and a closed terminal send), raised where the command
    is, as Ctrl-C's KeyboardInterrupt is: the unfinished output is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


#: what to do when the disk refuses a write (errno: the reason said)
_DISK_ERRORS = {
    errno.EROFS: "the filesystem is read-only: choose an OUT on a writable disk",
    errno.ENOSPC: "the disk is full: free some space or choose an OUT on another disk",
    errno.EDQUOT: "the disk quota is exceeded: free some space or choose an OUT on another disk",
    errno.EACCES: "permission denied (OUT must be somewhere you can write)",
    errno.EPERM: "permission denied (OUT must be somewhere you can write)",
}


def _remove_leftovers(args) -> None:
    """What killed runs left (:func:`~hf_symmetry.checkpoint_io.remove_stale_leftovers`): next to OUT, when the
    command has one, and in the asset cache."""
    out = getattr(args, "out", None)
    if out is None and getattr(args, "command", None) == "merge" and getattr(args, "inputs", None):
        out = args.inputs[-1]  # (merge's OUT is its last positional argument)
    if isinstance(out, str) and out:
        remove_stale_leftovers(Path(out).absolute().parent)
    for folder in build_folders():
        remove_stale_leftovers(folder, builds=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _remove_leftovers(args)
        check_inputs(args)  # every model folder, text and output file, before any work (commands/inputs.py)
        with progress_bars(not getattr(args, "quiet", False)):
            return int(args.func(args) or 0)
    except Stopped as exc:
        print(f"hf-symmetry: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
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
    except OSError as exc:
        if exc.errno not in _DISK_ERRORS:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hf-symmetry {args.command}: error: {where}{_DISK_ERRORS[exc.errno]}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
