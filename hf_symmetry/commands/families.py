"""``hf-symmetry families``: which symmetries and conversions each supported model type allows,
each "no" with its structural reason (derived from the family's facts, the same derivation every
conversion uses to refuse before any work). Optionally for one checkpoint's own config."""

from __future__ import annotations

import json
from pathlib import Path

from ..architectures import capabilities
from ..architectures.spec import SUPPORTED_MODEL_TYPES


def register(sub) -> None:
    p = sub.add_parser(
        "families", help="table of model families × symmetries/conversions (yes, or no and why)", description=__doc__
    )
    p.add_argument("--model-type", metavar="TYPE", help=f"only this model type ({', '.join(SUPPORTED_MODEL_TYPES)})")
    p.add_argument(
        "--config",
        metavar="PATH",
        help="a checkpoint folder or config.json: answer for its own config (sliding windows, "
        "NoPE layers, tying... vary between checkpoints of one family)",
    )
    p.add_argument("--markdown", action="store_true", help="print the Markdown table (as in the README)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.model_type and args.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unknown model type {args.model_type!r}; choose from {', '.join(SUPPORTED_MODEL_TYPES)}")
    if args.config:
        path = Path(args.config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {args.config}")
        config = json.loads(path.read_text(encoding="utf-8"))
        f = capabilities.facts(config)
        width = max(len(h) for _, h in capabilities.COLUMNS)
        print(f"{path.parent.name} ({f.model_type})")
        for key, header in capabilities.COLUMNS:
            why = capabilities.reason(f, key)
            print(f"  {header:<{width}}  {'yes' if why is None else 'no: ' + why}")
        return 0
    if args.markdown:
        print(capabilities.families_markdown(), end="")
    else:
        print(capabilities.families_text(args.model_type), end="")
    return 0
