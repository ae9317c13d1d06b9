"""What every ``compress`` route ends with: the report (``compression_report.json``, the full record), the model
card (README) and the finished output folder."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...calibration import CalibrationText
from ...checkpoint_io import copy_side_files
from ...hub.cards import perplexity_result, public_model_label, public_report, public_text_label, write_card
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


def finish_folder(folder: Path, report: CompressReport, run, source: str | Path, out: str | Path, counted: int) -> None:
    """Complete ``run``'s output folder, whose weights and config are written: the source's side files
    (tokenizer, generation config), the report and the card, every file readable as ``save_pretrained``
    leaves it."""
    report.accounting.compressed_model_params_counted = counted
    copy_side_files(run.source.path, folder)
    report.source, report.output = str(source), str(out)
    write_record(folder, report, run.options, run.calibration)
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
    write_record(folder, report, options, calibration)


def write_record(
    folder: str | Path, report: CompressReport, options: CompressOptions, calibration: CalibrationText
) -> None:
    """``folder``'s report and its README model card, which lists only the settings that apply to the method."""
    (Path(folder) / REPORT_FILE).write_text(json.dumps(public_report(report.as_dict()), indent=2, default=str) + "\n")
    acc, method, pp = report.accounting, options.label, report.perplexity
    results = []
    if pp:
        window = {k: pp[k] for k in ("window", "stride", "tokens")}
        results.append(perplexity_result(pp["compressed"], pp["text"], max_tokens=pp["tokens"], **window))
    stock = f"A stock `{acc.stock_class}` with hidden size {acc.residual} (of {acc.hidden}): loads without"
    loading = f"{stock} `trust_remote_code`." if acc.output_family == "stock" else "Load with `trust_remote_code=True`."
    summary = (
        f"Structured compression of `{public_model_label(report.source)}` with {method}: "
        f"{acc.ratio_over_compressed:.1%} of the compressed matrices' parameters removed "
        f"({acc.ratio_over_model:.1%} of the whole model, {acc.compressed_model_params:,} parameters left). {loading}"
    )
    write_card(
        folder,
        "compress",
        {
            "title": f"{Path(report.source).name} compressed with {method}",
            "summary": summary,
            "method": method,
            "parameters": options.applicable(calibration),
            "inputs": [report.source],
            "size": {"parameters": acc.compressed_model_params},
            "eval_results": results,
            "extra": {
                "ratio_over_compressed": acc.ratio_over_compressed,
                "ratio_over_model": acc.ratio_over_model,
                "parameters_before": acc.dense_model_params,
                "parameters_after": acc.compressed_model_params,
                "per_matrix": per_matrix_rows(acc.per_matrix),
                "perplexity": pp and {**pp, "text": public_text_label(pp["text"])},
            },
        },
    )


def per_matrix_rows(per_matrix: dict) -> list[dict]:
    """The per-matrix entries grouped by module (``layers.3.q_proj`` → ``q_proj``) and structure."""
    rows: dict = {}
    for name, m in per_matrix.items():
        module, spec = name.split(".")[-1], ", ".join(f"{k}={v}" for k, v in m["structure"].items())
        row = {"matrix": module, "count": 0, "structure": spec} | {k: m[k] for k in ("dense_params", "params", "ratio")}
        rows.setdefault((module, spec, m["params"], m["dense_params"]), row)["count"] += 1
    return list(rows.values())
