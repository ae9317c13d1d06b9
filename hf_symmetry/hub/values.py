"""How values are written into cards and records: as YAML/JSON-safe builtins (:func:`plain`) and as
text (:func:`fmt_number`, which commands print figures with too)."""

from __future__ import annotations

import math
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any


def plain(obj: Any) -> Any:
    """``obj`` as YAML/JSON-safe builtins (numpy/torch scalars, Paths, dataclasses, tuples)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if hasattr(obj, "item"):  # numpy / torch scalar
        return plain(obj.item())
    return str(obj)


def fmt_number(x) -> str:
    """How cards write a number; commands print figures with it too, so both read the same."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.6g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)
