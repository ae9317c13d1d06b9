"""The model card of a compressed folder (the full record stays in ``compression_report.json``)."""

from __future__ import annotations

from pathlib import Path

from ...calibration import CalibrationText
from ...hub.cards import perplexity_result, public_model_label, public_text_label
from ...hub.cards import write_card as render
from .options import CompressOptions
from .plan import Accounting


def write_card(folder: Path, report, options: CompressOptions, calibration: CalibrationText) -> None:
    """The README model card, listing only the settings that apply to the method."""
    acc, method = report.accounting, options.label
    results = []
    if report.perplexity:
        pp = report.perplexity
        results.append(
            perplexity_result(
                pp["compressed"],
                pp["text"],
                max_tokens=pp["tokens"],
                window=pp["window"],
                stride=pp["stride"],
                tokens=pp["tokens"],
            )
        )
    render(
        folder,
        "compress",
        {
            "title": f"{Path(report.source).name} compressed with {method}",
            "summary": (
                f"Structured compression of `{public_model_label(report.source)}` with {method}: "
                f"{acc.ratio_over_compressed:.1%} of the compressed matrices' parameters removed "
                f"({acc.ratio_over_model:.1%} of the whole model, {acc.compressed_model_params:,} parameters "
                f"left). " + _loading(acc)
            ),
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
                "perplexity": report.perplexity
                and {**report.perplexity, "text": public_text_label(report.perplexity["text"])},
            },
        },
    )


def _loading(acc: Accounting) -> str:
    if acc.output_family == "stock":
        return (
            f"A stock `{acc.stock_class}` with hidden size {acc.residual} (of {acc.hidden}): loads "
            "without `trust_remote_code`."
        )
    return "Load with `trust_remote_code=True`."


def per_matrix_rows(per_matrix: dict) -> list[dict]:
    """The per-matrix entries grouped by module (``layers.3.q_proj`` → ``q_proj``) and structure."""
    rows: dict = {}
    for name, m in per_matrix.items():
        module = name.split(".")[-1]
        spec = ", ".join(f"{k}={v}" for k, v in m["structure"].items())
        row = rows.setdefault(
            (module, spec, m["params"], m["dense_params"]),
            {
                "matrix": module,
                "count": 0,
                "structure": spec,
                "dense_params": m["dense_params"],
                "params": m["params"],
                "ratio": m["ratio"],
            },
        )
        row["count"] += 1
    return list(rows.values())
