"""Markdown tables and number formats for benchmarks/report.py."""

from __future__ import annotations

import math


def fmt(value: object, digits: int | None = None, sep: bool = False) -> str:
    """A cell: ``digits`` decimals for floats (4 significant digits when None), thousands separators on
    request, ``—`` for missing values."""
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if sep else str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if digits is not None:
            return f"{value:,.{digits}f}" if sep else f"{value:.{digits}f}"
        if value == 0:
            return "0"
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def sig(value: float | None, digits: int = 4) -> str:
    """Perplexity-like figures: ``digits`` significant digits, exponent form above 10^5."""
    if value is None:
        return "—"
    if abs(value) >= 1e5:
        return f"{value:.2e}"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(value))))) if value else 0
    return f"{value:,.{decimals}f}" if abs(value) >= 10000 else f"{value:.{decimals}f}"


def exp(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}e}"


def gb(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def md_table(columns: list[str], rows: list[list[object]]) -> str:
    def cell(value: object) -> str:
        return value if isinstance(value, str) else fmt(value)

    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])
