"""The pre-push check: a folder is published only if it loads where hf_symmetry does not.

The folder is loaded with ``from_pretrained(..., trust_remote_code=True)`` in a fresh Python
process in which ``import hf_symmetry`` fails (custom families must run from the code shipped
in the folder), a forward pass is run on real tokens, and the results are compared with

* the same folder loaded by hf_symmetry itself (the code that produced and verified it):
  max |Δlogit| ≤ ``tolerance``;
* the figures recorded in the card: every perplexity eval result whose text is available
  here is recomputed (same tokens, window and stride) in the isolated process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from ..assets import TEXT_NAMES, resolve_text
from ..checkpoint_io import TOKENIZER_FILES
from ..evaluation import perplexity as perplexity_module
from ..evaluation.compare import load_model, load_tokenizer, model_output
from ..text import read_text, tokenize_text
from .cards import CARD_RECORD, README
from .eval_results import file_sha256, remembered_texts

# Runs in the isolated interpreter: only torch, transformers, safetensors. The one piece of
# hf_symmetry it uses, the sliding-window perplexity, is loaded from its file as a standalone
# module (it imports only torch and tqdm), so the figure is computed by the same code.
_ISOLATED = r"""
import importlib.util, json, sys, traceback
sys.modules["hf_symmetry"] = None  # the published folder must not need hf_symmetry
job_file = json.loads(sys.argv[1])
try:
    import hf_symmetry  # noqa: F401
    importable = True
except ImportError:
    importable = False
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

def perplexity_module():
    ps = importlib.util.spec_from_file_location("_hf_symmetry_perplexity", job_file["perplexity_module"])
    mod = importlib.util.module_from_spec(ps)
    sys.modules[ps.name] = mod  # dataclasses look their module up there
    ps.loader.exec_module(mod)
    return mod

def run(job):
    result = {"hf_symmetry_importable": importable}
    src = job["model"]
    config = AutoConfig.from_pretrained(src, trust_remote_code=True)
    arch = " ".join(config.architectures or [])
    # same class choice as hf_symmetry.evaluation.compare.load_model
    cls = (AutoModelForCausalLM if ("CausalLM" in arch or "LMHead" in arch)
           else AutoModelForMaskedLM if "MaskedLM" in arch else AutoModel)
    model = cls.from_pretrained(src, dtype=torch.float32, trust_remote_code=True).eval()
    result["class"] = type(model).__module__ + "." + type(model).__name__
    if job["tokenizer"]:
        result["tokenizer"] = type(AutoTokenizer.from_pretrained(src, trust_remote_code=True)).__name__
    tensors = load_file(job["ids"])
    with torch.no_grad():
        out = model(input_ids=tensors["ids"].reshape(1, -1))
    logits = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    save_file({"output": logits[0].float().contiguous()}, job["output"])
    if job["perplexity"]:
        ppl = perplexity_module()
        result["perplexities"] = [
            ppl.perplexity(model, tensors[f"ppl{i}"], window=p["window"], stride=p["stride"], progress=False).perplexity
            for i, p in enumerate(job["perplexity"])]
    return result

results = []
for job in job_file["jobs"]:
    try:
        results.append(run(job))
    except BaseException as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        results.append({"hf_symmetry_importable": importable, "error": f"{type(exc).__name__}: {msg}",
                        "traceback": traceback.format_exc()[-4000:]})
json.dump(results, open(job_file["result"], "w"))
"""


@dataclass
class LoadCheck:
    """What the isolated load showed."""

    model_class: str
    remote_code: bool
    tokens: int
    max_abs_diff: float  # isolated load vs hf_symmetry's own load, same tokens
    tokenizer: str | None = None
    perplexities: list[dict] = field(default_factory=list)  # recorded vs recomputed
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def _check_ids(config: dict, tokenizer, text: str | None, tokens: int) -> torch.Tensor:
    """Real text tokens when the folder has a tokenizer, else fixed pseudo-random ids."""
    if tokenizer is not None:
        limit = config.get("max_position_embeddings") or tokens
        return tokenize_text(
            tokenizer, read_text(resolve_text(text or "britannica-eval")), max_tokens=min(tokens, limit)
        )
    vocab = int(config.get("vocab_size") or 2)
    return torch.randint(0, vocab, (min(tokens, 64),), generator=torch.Generator().manual_seed(0))


def _card_entries(folder: Path) -> list[dict]:
    """Eval entries of the folder's card: from the local conversion record when there is one
    (it keeps local text paths), else from README.md's metadata."""
    record = folder / CARD_RECORD
    if record.is_file():
        return list(json.loads(record.read_text())["data"].get("eval_results") or [])
    if not (folder / README).is_file():
        return []

    card = ModelCard.load(folder / README, ignore_metadata_errors=True)
    return [dict(r.__dict__) for r in card.data.eval_results or []]


def _find_text(entry: dict, extra: list[str]) -> Path | None:
    """The text a perplexity entry was measured on, if it is here (matched by name and sha256)."""
    args = entry.get("dataset_args") or {}
    label = str(args.get("text") or "")

    known = remembered_texts(args["text_sha256"]) if "text_sha256" in args else []
    candidates = [entry.get("_text_path"), *extra, *known] + ([resolve_text(label)] if label in TEXT_NAMES else [])
    for c in candidates:
        if not c or not Path(c).is_file():
            continue
        if label not in TEXT_NAMES and Path(c).name != label:
            continue
        if "text_sha256" in args and file_sha256(c) != args["text_sha256"]:
            continue
        return Path(c)
    return None


def _recorded_perplexities(folder: Path, extra_texts: list[str], max_tokens: int) -> list[dict]:
    """Perplexity entries of the card whose text is available here, measured on at most
    ``max_tokens`` tokens (recomputing longer ones would make the check as slow as the eval)."""
    found = []
    for e in _card_entries(folder):
        args = e.get("dataset_args") or {}
        if e.get("metric_type") != "perplexity" or "text" not in args:
            continue
        if int(args.get("tokens") or args.get("max_tokens") or max_tokens + 1) > max_tokens:
            continue
        path = _find_text(e, extra_texts)
        if path is None:
            continue  # measured on a text this machine does not have: nothing to recompute against
        found.append(
            {
                "text": str(args["text"]),
                "path": str(path),
                "max_tokens": args.get("max_tokens"),
                "window": int(args.get("window") or 512),
                "stride": int(args.get("stride") or 256),
                "recorded": float(e["metric_value"]),
            }
        )
    return found


def isolated_env(home: Path) -> dict:
    """Environment for a Python that sees the folder only: fresh HF caches, offline, no
    PYTHONPATH (which could make hf_symmetry importable)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HOME=str(home / "hf_home"),
        HF_MODULES_CACHE=str(home / "modules"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_isolated(
    model: str,
    ids: torch.Tensor,
    work: Path,
    env: dict,
    tokenizer: bool = False,
    perplexity: list[dict] | None = None,
    timeout: float = 900,
) -> tuple[dict, torch.Tensor]:
    """Load ``model`` (a folder or, with ``HF_ENDPOINT`` in ``env``, a Hub id) in a Python where
    hf_symmetry cannot be imported; returns (facts, output of the forward pass on ``ids``)."""
    ((facts, out),) = run_isolated_many(
        [{"model": model, "ids": ids, "tokenizer": tokenizer, "perplexity": perplexity}], work, env, timeout
    )
    return facts, out


def run_isolated_many(jobs: list[dict], work: Path, env: dict, timeout: float = 900) -> list[tuple[dict, torch.Tensor]]:
    """:func:`run_isolated` for several models in one interpreter (one import of torch and
    transformers). Each job: ``model``, ``ids``, optional ``tokenizer`` and ``perplexity``
    (dicts with ``ids``, ``window``, ``stride``)."""
    job_args = []
    for n, job in enumerate(jobs):
        tensors = {"ids": job["ids"].contiguous()}
        for i, p in enumerate(job.get("perplexity") or []):
            tensors[f"ppl{i}"] = p["ids"].contiguous()
        save_file(tensors, str(work / f"ids{n}.safetensors"))
        job_args.append(
            {
                "model": str(job["model"]),
                "ids": str(work / f"ids{n}.safetensors"),
                "output": str(work / f"output{n}.safetensors"),
                "tokenizer": bool(job.get("tokenizer")),
                "perplexity": [{"window": p["window"], "stride": p["stride"]} for p in job.get("perplexity") or []],
            }
        )
    job_file = {"jobs": job_args, "result": str(work / "result.json"), "perplexity_module": perplexity_module.__file__}
    names = ", ".join(str(j["model"]) for j in jobs)
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _ISOLATED, json.dumps(job_file)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"loading {names} without hf_symmetry took longer than {timeout:.0f} s") from None
    result_file = work / "result.json"
    if not result_file.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"loading {names} without hf_symmetry crashed (exit {proc.returncode}): {tail[0]}")
    out = []
    for job, facts, s in zip(jobs, json.loads(result_file.read_text()), job_args):
        if facts.get("hf_symmetry_importable"):
            raise RuntimeError("the isolated loader could import hf_symmetry; the check would prove nothing")
        if "error" in facts:
            raise ValueError(f"{job['model']} does not load without hf_symmetry: {facts['error']}")
        out.append((facts, load_file(s["output"])["output"]))
    return out


def prepush_check(
    folder: str | os.PathLike,
    text: str | None = None,
    tokens: int = 128,
    tolerance: float = 1e-4,
    ppl_rtol: float = 1e-4,
    ppl_max_tokens: int = 4096,
    timeout: float = 900,
) -> LoadCheck:
    """Raise ``ValueError`` unless ``folder`` loads and runs without hf_symmetry and agrees with
    hf_symmetry's own load and with the perplexities recorded in its card."""
    start = time.perf_counter()
    folder = Path(folder).resolve()
    config = json.loads((folder / "config.json").read_text())
    remote = bool(config.get("auto_map"))
    tok = load_tokenizer(folder) if has_tokenizer(folder) else None
    ids = _check_ids(config, tok, text, tokens)
    recorded = _recorded_perplexities(folder, [text] if text else [], ppl_max_tokens) if tok is not None else []
    for p in recorded:
        p["ids"] = tokenize_text(tok, read_text(p["path"]), max_tokens=p["max_tokens"])
    with tempfile.TemporaryDirectory(prefix="hf_symmetry-check-") as tmp:
        facts, isolated_out = run_isolated(
            str(folder),
            ids,
            Path(tmp),
            isolated_env(Path(tmp)),
            tokenizer=tok is not None,
            perplexity=recorded,
            timeout=timeout,
        )
    # hf_symmetry's own classes for its families (so shipped code is compared with library code);
    # other remote-code folders can only run their own code.
    own_family = str(config.get("model_type", "")).startswith("hf_symmetry_")
    library = load_model(folder, trust_remote_code=remote and not own_family)
    diff = (model_output(library, ids)[0] - isolated_out).abs().max().item()
    del library
    if not diff <= tolerance:
        raise ValueError(
            f"{folder}: outputs loaded without hf_symmetry differ from hf_symmetry's by {diff:.3e} "
            f"(> {tolerance:g}); the shipped code does not match"
        )
    ppl_rows = []
    for p, got in zip(recorded, facts.get("perplexities", [])):
        rel = abs(got - p["recorded"]) / p["recorded"]
        ppl_rows.append({"text": p["text"], "recorded": p["recorded"], "recomputed": got, "rel_diff": rel})
        if not rel <= ppl_rtol:
            raise ValueError(
                f"{folder}: perplexity on {p['text']} is {got:.6g} when loaded without hf_symmetry, "
                f"but the card records {p['recorded']:.6g}"
            )
    return LoadCheck(
        model_class=facts["class"],
        remote_code=remote,
        tokens=ids.numel(),
        max_abs_diff=diff,
        tokenizer=facts.get("tokenizer"),
        perplexities=ppl_rows,
        seconds=time.perf_counter() - start,
    )
