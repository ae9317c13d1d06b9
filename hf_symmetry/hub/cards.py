"""Model cards for converted models.

Every conversion calls :func:`write_card` once its folder is complete. The card is rendered
from a Jinja template ``<kind>.md`` in :func:`template_dir` (falling back to ``generic.md``)
and carries, as metadata that the Hub and ``huggingface_hub.ModelCard.load`` understand:

* ``base_model`` (the nearest ancestor with a Hub id), ``library_name: transformers``, tags;
* ``model-index`` built from :class:`huggingface_hub.EvalResult` (perplexity on a named text,
  lm-eval task scores);
* ``hf_symmetry``: what was done (method, parameters, seed, version), lineage (every input
  model), exactness (max |Δlogit|) and size (parameters, bytes, KV-cache bytes per token).

Next to ``README.md`` the card's inputs are kept as ``hf_symmetry_card.json`` (the conversion
record), so that ``push`` can add eval results or the repo id later by re-rendering the same
card (:func:`update_card`).

The card's pieces live beside it: how values are written (:mod:`.values`), its evaluation results
(:mod:`.eval_results`), the size figures measured on the folder (:mod:`.measure`), how inputs are named
publicly (:mod:`.lineage`) and the papers cited (:mod:`.references`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jinja2
from huggingface_hub import ModelCard, ModelCardData

from .. import __version__
from ..text import public_text_label
from .eval_results import eval_result, merge_results

# moved beside this module; still importable from here for the callers outside hub/ that use this path
from .eval_results import perplexity_result as perplexity_result
from .eval_results import remembered_texts as remembered_texts
from .lineage import base_models, public_model_labels, scrub_paths
from .lineage import public_model_label as public_model_label
from .lineage import public_report as public_report
from .measure import count_stored_parameters as count_stored_parameters
from .measure import kv_cache_bytes_per_token as kv_cache_bytes_per_token
from .measure import measure_folder, speed_sentence
from .references import REFERENCES
from .values import fmt_number, plain

CARD_RECORD = "hf_symmetry_card.json"
README = "README.md"
GENERIC_KIND = "generic"
_KIND = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def template_dir() -> Path:
    """Where the card templates live: inside the package (``hf_symmetry/model_cards``), so
    editable installs and wheels find the same files; the repo-root ``model_cards`` is a link
    to this folder."""
    return Path(__file__).resolve().parent.parent / "model_cards"


def template_for(kind: str) -> Path:
    if not _KIND.match(kind or ""):
        raise ValueError(f"card kind must be a short lowercase name like 'rotate'; got {kind!r}")
    path = template_dir() / f"{kind}.md"
    return path if path.is_file() else template_dir() / f"{GENERIC_KIND}.md"


def card_eval_results(path: str | os.PathLike) -> list:
    """The eval results of a card (``README.md`` or its folder), parsed by huggingface_hub."""
    path = Path(path)
    card = ModelCard.load(path / README if path.is_dir() else path)
    return list(card.data.eval_results or [])


def _public_exactness(exactness: dict) -> dict:
    out = plain(exactness or {})
    if out.get("text"):
        out["text"] = public_text_label(out["text"])
    return out


# --------------------------------------------------------------------------- rendering


def _config_of(folder: Path) -> dict:
    p = folder / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _card_metadata(kind: str, data: dict, size: dict, results: list, folder_name: str):
    record = {
        "kind": kind,
        "method": data.get("method") or kind,
        "version": __version__,
        "parameters": plain(data.get("parameters") or {}),
        "seed": plain(data.get("seed")),
        "inputs": list(data.get("inputs") or []),  # already public labels (publishable)
        "exactness": _public_exactness(data.get("exactness")),
        "size": plain(size),
    }
    if data.get("speed"):  # only when a verification ran: timings differ from run to run
        record["speed"] = plain(data["speed"])
    if data.get("extra"):
        record["extra"] = plain(data["extra"])
    base = base_models(data)
    tags = list(dict.fromkeys(["hf_symmetry", f"hf_symmetry-{kind}", *(data.get("tags") or [])]))
    extra_meta = {k: plain(v) for k, v in (data.get("metadata") or {}).items()}
    return ModelCardData(
        base_model=(base[0] if len(base) == 1 else base) or None,
        library_name="transformers",
        license=data.get("license"),
        language=data.get("language"),
        pipeline_tag=data.get("pipeline_tag"),
        tags=tags,
        model_name=data.get("model_name") or data.get("repo_id") or data.get("title") or folder_name,
        eval_results=results or None,
        hf_symmetry=record,
        **extra_meta,
    )


def _environment():
    # A loader (not ModelCard.from_template's bare Template) so kind templates can extend generic.md.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _check_plots(folder: Path, plots) -> list[dict]:
    out = []
    for p in plots or []:
        entry = {"path": p, "caption": Path(p).stem.replace("_", " ")} if isinstance(p, str) else dict(p)
        if not (folder / entry["path"]).is_file():
            raise FileNotFoundError(f"card plot {entry['path']} is not in {folder}")
        out.append(entry)
    return out


def display_name(folder: Path) -> str:
    """The folder's name, also while it is still ``atomic_output_dir``'s temporary
    ``.<name>.partial-XXXX`` sibling (conversions write their card there)."""
    m = re.fullmatch(r"\.(.+)\.partial-[^.]+", folder.name)
    return m.group(1) if m else folder.name


def render_card(out_dir: str | os.PathLike, kind: str, data: dict):
    """The ``ModelCard`` (not yet saved) for the conversion written to ``out_dir``; ``data`` as
    :func:`publishable` returns it."""
    folder = Path(out_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot write a card: {folder} is not a folder")
    template = template_for(kind)
    size = {**measure_folder(folder), **plain(data.get("size") or {})}
    results = [eval_result(e) for e in data.get("eval_results") or []]
    card_data = _card_metadata(kind, data, size, results, display_name(folder.resolve()))
    config = _config_of(folder)
    context = {
        **data,
        "kind": kind,
        "card_data": card_data.to_yaml(),
        "meta": card_data.hf_symmetry,
        "title": data.get("title") or card_data.model_name,
        "base_models": base_models(data),
        "size": size,
        "eval_rows": [
            dict(plain(r.__dict__), notes=(e.get("notes") if isinstance(e, dict) else None))
            for r, e in zip(results, data.get("eval_results") or [])
        ],
        "plots": _check_plots(folder, data.get("plots")),
        "remote_code": bool(config.get("auto_map")),
        "architecture": " ".join(config.get("architectures") or []) or config.get("model_type", "unknown"),
        # a local path would leak into the published card: the repo id once known, else a placeholder
        "model_ref": data.get("repo_id") or f"path/to/{display_name(folder.resolve())}",
        "fmt": fmt_number,
        "speed_line": speed_sentence,
        "references": data.get("references") or REFERENCES.get(kind, []),
    }
    text = _environment().get_template(template.name).render(**context)
    return ModelCard(text)  # parses the YAML header: a malformed card fails here, not on the Hub


def write_card(out_dir: str | os.PathLike, kind: str, data: dict) -> Path:
    """Render ``model_cards/<kind>.md`` (or ``generic.md``) into ``out_dir/README.md``.

    ``data`` (all optional): ``title``, ``summary`` (markdown paragraph), ``method``,
    ``parameters`` (dict), ``seed``, ``inputs`` (every input model: paths or Hub ids),
    ``base_model`` (Hub id(s); inferred from ``inputs`` when absent), ``exactness`` (e.g.
    ``Verification.as_dict()``: ``max_abs_dlogit``, ``tokens``, ``text``, perplexities),
    ``size`` (overrides/additions to the measured parameters, bytes, kv_cache_bytes_per_token),
    ``speed`` (``hub.measure.speed_card_entry``: speed and bytes against the source, recorded by the verification),
    ``eval_results`` (``EvalResult`` or dicts of its fields, optional ``notes``), ``plots``
    (files in ``out_dir``: names or ``{"path", "caption"}``), ``notes`` (markdown),
    ``tags``, ``license``, ``language``, ``pipeline_tag``, ``model_name``, ``repo_id``,
    ``extra`` (dict kept under ``hf_symmetry.extra``), ``metadata`` (extra top-level keys).
    Returns the README path. Also writes ``hf_symmetry_card.json`` with ``kind`` and ``data``.
    """
    data = publishable(data)
    card = render_card(out_dir, kind, data)
    folder = Path(out_dir)
    (folder / CARD_RECORD).write_text(json.dumps({"kind": kind, "data": data}, indent=2) + "\n")
    card.save(folder / README)
    return folder / README


def publishable(data: dict) -> dict:
    """Card data with nothing local left: ``base_model`` resolved while the input folders are
    still at hand, inputs by their public labels, every other path by its public name."""
    data = plain(data)
    if not data.get("inputs_public"):  # a record re-rendered by update_card is public already
        data["base_model"] = base_models(data)
        data["inputs"] = public_model_labels(data.get("inputs") or [])
        data["inputs_public"] = True
    for entry in data.get("eval_results") or []:
        if isinstance(entry, dict):
            entry.pop("_text_path", None)
    return scrub_paths(data)


def update_card(out_dir: str | os.PathLike, eval_results: list | None = None, **changes) -> Path:
    """Add eval results (replacing ones with the same task, dataset and metric) and other
    ``data`` changes (e.g. ``repo_id``) to a folder's card. Re-renders from the conversion
    record when there is one; otherwise edits only the metadata of the existing README (or
    writes a generic card when there is none)."""
    folder = Path(out_dir)
    record = folder / CARD_RECORD
    if record.is_file():
        saved = json.loads(record.read_text())
        kind, data = saved["kind"], dict(saved["data"])
    elif (folder / README).is_file():
        return _update_foreign_card(folder, eval_results or [], changes)
    else:
        kind, data = GENERIC_KIND, {"title": folder.name}
    data.update(changes)
    data["eval_results"] = merge_results(data.get("eval_results") or [], eval_results or [])
    return write_card(folder, kind, data)


def _update_foreign_card(folder: Path, eval_results: list, changes: dict) -> Path:
    card = ModelCard.load(folder / README)
    if eval_results:
        merged = merge_results(list(card.data.eval_results or []), eval_results)
        card.data.eval_results = [eval_result(e) for e in merged]
        card.data.model_name = card.data.model_name or changes.get("repo_id") or folder.name
    card.save(folder / README)
    return folder / README
