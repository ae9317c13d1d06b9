"""The refusals made before any work, for ``match`` and ``merge`` alike: one architecture and shapes, one
vocabulary, supported symmetries (:func:`plan_pair`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ...architectures import Adapter, spec_for_model_type
from ...architectures.capabilities import structural_config
from ..rotate import RotateOptions, plan_checks
from ..stream import TensorSource
from .options import MatchOptions, MatchPlan


def check_same_architecture(models: list[tuple[str, dict, dict[str, tuple]]]) -> None:
    """``models``: (name, config, tensor shapes). Refuse different families, configs or shapes.
    A tied LM head may be absent on one side."""
    (name0, cfg0, shapes0), rest = models[0], models[1:]
    spec0 = spec_for_model_type(cfg0.get("model_type"))
    for name, cfg, shapes in rest:
        spec = spec_for_model_type(cfg.get("model_type"))
        if spec.family != spec0.family:
            raise ValueError(
                f"{name} is a {spec.family} model but {name0} is a {spec0.family} model: "
                "matching and merging need one architecture"
            )
        s0, s = structural_config(cfg0), structural_config(cfg)
        diff = sorted(k for k in s0.keys() | s.keys() if s0.get(k) != s.get(k))
        if diff:
            k = diff[0]
            raise ValueError(f"{name} and {name0} have different shapes/configs: {k} = {s.get(k)!r} vs {s0.get(k)!r}")
        optional = {spec.lm_head + ".weight"} if spec.lm_head else set()
        keys0, keys = set(shapes0) - optional, set(shapes) - optional
        if keys0 != keys:
            odd = sorted(keys0 ^ keys)[:3]
            raise ValueError(f"{name} and {name0} hold different tensors (e.g. {odd})")
        bad = [k for k in shapes0.keys() & shapes.keys() if shapes0[k] != shapes[k]]
        if bad:
            raise ValueError(
                f"{name} and {name0} have different shapes: {bad[0]} is {shapes[bad[0]]} vs {shapes0[bad[0]]}"
            )


def vocabulary_fingerprint(folder: str | Path | None) -> str | None:
    """A hash of the tokenizer's vocabulary (token -> id), or None when the folder has no tokenizer."""
    if folder is None:
        return None
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = {
            "model": data.get("model", {}).get("vocab"),
            "added": sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or []),
        }
        blob = json.dumps(vocab, sort_keys=True).encode()
    else:
        files = [folder / n for n in ("vocab.json", "vocab.txt", "tokenizer.model") if (folder / n).is_file()]
        if not files:
            return None
        blob = b"".join(f.read_bytes() for f in files)
    return hashlib.sha256(blob).hexdigest()


def check_same_vocabulary(folders: list[tuple[str, str | Path | None]], why: str) -> None:
    """Refuse models whose tokenizers map tokens to different ids (where both ship one)."""
    prints = [(name, vocabulary_fingerprint(folder)) for name, folder in folders]
    known = [(n, p) for n, p in prints if p is not None]
    for name, fp in known[1:]:
        if fp != known[0][1]:
            raise ValueError(f"{name} and {known[0][0]} have different vocabularies; {why}")


def plan_pair(
    anchor: TensorSource,
    source: TensorSource,
    anchor_config: dict,
    source_config: dict,
    options: MatchOptions,
    names=("ANCHOR", "SOURCE"),
    folders=(None, None),
) -> tuple[Adapter, MatchPlan]:
    """Every refusal, before any work: same architecture and shapes, supported symmetries,
    and for residual matching a shared vocabulary and no tensors outside the known layout."""
    check_same_architecture([(names[0], anchor_config, anchor.shapes()), (names[1], source_config, source.shapes())])
    adapter = Adapter.from_config(source_config, source.keys())
    plan = options.plan(adapter)
    if plan.residual:
        check_same_vocabulary(list(zip(names, folders)), "residual matching compares embedding rows token by token")
        plan_checks(adapter, RotateOptions(residual="random", heads="none", ffn=False), source.keys())
    return adapter, plan
