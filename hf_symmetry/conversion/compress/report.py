"""What every ``compress`` route ends with: the report (``compression_report.json``) and the finished output
folder (side files, report, card)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...calibration import CalibrationText
from ...checkpoint_io import copy_side_files
from ...hub.cards import public_report
from .card import write_card
from .options import CompressOptions
from .plan import Accounting

REPORT_FILE = "compression_report.json"


@dataclass
class CompressReport:
    source: str
    output: str | None
    family: str
    options: dict
    accounting: Accounting
    relative_errors: dict
    objective: dict  # per solved problem: first and last objective value, steps
    calibration_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)
    method: str = ""

    def as_dict(self) -> dict:
        return {**asdict(self), "accounting": self.accounting.to_dict()}


def summarise_traces(traces: dict) -> dict:
    """Per solved problem, the first and last objective value and the number of steps."""
    return {k: {"first": v[0], "last": v[-1], "steps": len(v)} for k, v in traces.items() if v}


def write_report(folder: str | Path, report: CompressReport) -> None:
    (Path(folder) / REPORT_FILE).write_text(json.dumps(public_report(report.as_dict()), indent=2, default=str) + "\n")


def finish_folder(folder: Path, report: CompressReport, run, source: str | Path, out: str | Path, counted: int) -> None:
    """Complete ``run``'s output folder, whose weights and config are written: the source's side files
    (tokenizer, generation config), the report and the card, every file readable as ``save_pretrained``
    leaves it."""
    report.accounting.compressed_model_params_counted = counted
    copy_side_files(run.source.path, folder)
    report.source, report.output = str(source), str(out)
    write_report(folder, report)
    write_card(folder, report, run.options, run.calibration)
    for f in Path(folder).iterdir():
        if f.is_file():
            os.chmod(f, 0o644)


def record_verification(
    folder: str | Path, report: CompressReport, options: CompressOptions, calibration: CalibrationText, verification
) -> None:
    """Put the verification's perplexities (original and compressed) into ``folder``'s report and card."""
    v = verification
    if v.perplexity_original is None or v.perplexity_converted is None:
        return
    report.perplexity = {
        "text": v.text,
        "tokens": v.ppl_tokens,
        "window": v.ppl_window,
        "stride": v.ppl_stride,
        "original": v.perplexity_original,
        "compressed": v.perplexity_converted,
    }
    folder = Path(folder)
    write_report(folder, report)
    write_card(folder, report, options, calibration)
