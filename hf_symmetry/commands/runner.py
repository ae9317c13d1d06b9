"""The one driver of the conversion commands (rotate, match, merge, to-tpa, farr, compress, export-gguf, heal).

A command is one small :class:`Conversion` object made from its parsed arguments; :func:`run_conversion` drives
every one the same way: start the clock, :meth:`~Conversion.check` (refusals before any work), the checks of OUT
against the inputs (:func:`check_output`), then, holding OUT's lock (a second writer is refused),
:meth:`~Conversion.convert` (the report and its printed lines), :meth:`~Conversion.verify` (the one verification:
the figures added to the lines, :meth:`~Conversion.record` of what the conversion keeps of them, then the folder's
card), :meth:`~Conversion.summary` (the ``--json`` summary), the push when
``--push-to-hub`` was given, the total-time line, and :func:`~.common.emit`. A command supplies only its own parts."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

from ..assets import resolve_model
from ..checkpoint_io import check_output_dir, input_bytes, output_lock, parse_size
from .common import Verified, emit, push_if_requested, record_in_card, total_time_line, verify_output


class Conversion:
    """One run of a conversion command. ``args``: its parsed arguments. A subclass writes :meth:`convert` and,
    where it refuses flags or resolves inputs before any work, :meth:`check`; it sets ``original`` (what the
    verification compares OUT with) and, where OUT is not ``args.out``, ``out``. The defaults verify OUT
    against ``original``, keep the figures as ``report.verification`` (:meth:`record`) and summarise the report as
    its dataclass fields."""

    #: the two models' names in the verification lines
    names: tuple[str, str] = ("original", "converted")
    #: said after "max |Δlogit|" (e.g. " against SOURCE")
    against: str = ""
    #: whether the command takes ``--push-to-hub`` (its summary then has a "push" entry)
    publishes: bool = True
    #: whether OUT is one file (export-gguf) rather than a folder
    writes_file: bool = False
    #: whether this process writes OUT: False in the other processes of a data-parallel run (heal under accelerate
    #: launch or torchrun), which take part in :meth:`convert` alone (no lock, verification or output)
    main_process: bool = True

    def __init__(self, args) -> None:
        self.args = args
        self.out = getattr(args, "out", None)  # (merge's OUT is its last input: set by its check)
        self.original = None

    def check(self) -> None:
        """Refuse bad flags and resolve the inputs, before any work (default: nothing to check)."""

    def inputs(self) -> list:
        """Every model the command reads (names or folders, as given): OUT may not be, contain or lie in one
        (default: ``args.model``, when the command has one; None: the default model)."""
        return [self.args.model] if hasattr(self.args, "model") else []

    def convert(self) -> tuple[object, list[str]]:
        """Write OUT; return the conversion's report and the lines that describe it."""
        raise NotImplementedError

    def verify(self, report, lines: list[str]) -> bool:
        """The one verification of every command: compare OUT with ``original`` (:func:`~.common.verify_output`: the
        figures, and the speed of the two models it loaded, added to ``lines``), :meth:`record` what the conversion
        keeps of it, then put the figures in the folder's card (:func:`~.common.record_in_card`; a NaN figure fails
        the command there). Returns whether a verification ran (the last line says so)."""
        verified = verify_output(self.args, self.original, self.out, lines, self.names, against=self.against)
        self.record(report, verified)
        if verified is None:
            return False
        record_in_card(self.out, verified, lines)
        return True

    def record(self, report, verified: Verified | None) -> None:
        """What the conversion keeps of its verification (None with ``--no-verify``), before the figures go into the
        card (a conversion that rewrites its own card or report from them does it here). Default: the figures
        become ``report.verification``."""
        report.verification = None if verified is None else verified.figures

    def summary(self, report) -> dict:
        """The ``--json`` summary (before the runner's "push" entry)."""
        return asdict(report)


def check_output(command: Conversion) -> None:
    """Refuse, before any work, an OUT that would lose the user's data and a bad ``--max-shard-size``
    (:func:`hf_symmetry.checkpoint_io.check_output_dir`: an input, a folder holding or inside an input, the
    current folder, files hf-symmetry did not write, a disk that cannot be written or lacks the input's size)."""
    args = command.args
    if getattr(args, "max_shard_size", None) is not None:
        parse_size(args.max_shard_size)
    inputs = [resolve_model(name) for name in command.inputs()]
    need = max((input_bytes(p) for p in inputs), default=0)
    check_output_dir(
        command.out, getattr(args, "overwrite", False), inputs, need_bytes=need, is_file=command.writes_file
    )


def run_conversion(command: Conversion) -> int:
    """Run one conversion command, every step in the same order for every command (module docstring)."""
    start = time.perf_counter()
    command.check()
    check_output(command)
    if not command.main_process:
        command.convert()
        return 0
    with output_lock(command.out):
        report, lines = command.convert()
        try:
            verified = command.verify(report, lines)
        except KeyboardInterrupt:  # (SIGTERM and SIGHUP too: hf_symmetry.cli.main makes them one)
            print(
                f"hf-symmetry: {command.out} was written and is complete; the verification was interrupted, so "
                "its card lacks the verification figures",
                file=sys.stderr,
            )
            raise
    summary = command.summary(report)
    if command.publishes:
        summary["push"] = push_if_requested(command.args, command.out, lines)
    lines.append(total_time_line(start, verified=verified))
    emit(summary, lines, command.args.json_out)
    return 0
