"""The evaluation bridge: figures that go into model cards.

* perplexity of a causal LM on a local text (sliding window, :mod:`.perplexity`);
* lm-evaluation-harness (``pip install 'hf_symmetry[eval]'``) on task definitions that
  lm-eval finds offline: built-in task names whose data are already in the local datasets
  cache, or YAML files in ``task_dir`` whose ``dataset_path`` is a local loader (``json``,
  ``csv``, ...) with ``data_files``. :func:`write_smoke_task` writes one such task from a local
  text, in ARC-Easy's format: a smoke test of the pipeline, never a benchmark score.

The card entries made from these results live in :mod:`hf_symmetry.hub.entries` (the hub sits
above evaluation in the layer order, docs/internals.md).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from ..assets import cache_dir, resolve_text
from ..devices import DeviceRequest
from ..text import read_text, tokenize_text
from .compare import is_causal_lm, load_model, load_tokenizer
from .perplexity import PPL, PerplexityResult, perplexity
from .verification import load_for_eval

SMOKE_TASK = "hf_symmetry_smoke_cloze"


# --------------------------------------------------------------------------- perplexity


def text_perplexity(
    model_or_path,
    text: str | os.PathLike,
    max_tokens: int | None = PPL.tokens,
    window: int = PPL.window,
    stride: int = PPL.stride,
    trust_remote_code: bool = False,
    progress: bool = True,
    device: str | DeviceRequest | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of a causal LM on a text. ``model_or_path``: a folder or alias, or a
    loaded ``(model, tokenizer)`` pair (as :func:`run_lm_eval` takes). ``device`` (a folder or alias
    only): where it is loaded, as verification loads it
    (:func:`~hf_symmetry.evaluation.verification.load_for_eval`: ``auto`` may spread it with accelerate's
    device map, anything else is one device); ``None``: float32 on the CPU."""
    text_path = resolve_text(text)
    folder = isinstance(model_or_path, (str, os.PathLike))
    if not folder:
        model, tokenizer = model_or_path
    elif device is None:
        model = load_model(model_or_path, trust_remote_code=trust_remote_code)
    else:
        model = load_for_eval(model_or_path, device=device, trust_remote_code=trust_remote_code)
    if not is_causal_lm(model):
        name = model_or_path if folder else "the model"
        raise ValueError(f"{name} is not a causal LM ({type(model).__name__}); perplexity needs one")
    if folder:
        tokenizer = load_tokenizer(model_or_path)
    ids = tokenize_text(tokenizer, read_text(text_path), max_tokens)
    return perplexity(model, ids, window=window, stride=stride, progress=progress)


# --------------------------------------------------------------------------- lm-eval


def require_lm_eval():
    try:
        import lm_eval  # optional dependency  # noqa: F401
    except ImportError:
        raise ValueError("lm-eval tasks need lm-eval: pip install 'hf_symmetry[eval]'") from None
    return lm_eval


def parse_tasks(tasks: str | list[str]) -> list[str]:
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise ValueError("no lm-eval task named")
    return names


def run_lm_eval(
    model_or_path,
    tasks: str | list[str],
    task_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    trust_remote_code: bool = False,
    device: str = "cpu",
) -> dict:
    """lm-eval's ``simple_evaluate`` on a model loaded by hf_symmetry (so its own families work
    without remote code); returns lm-eval's results dict."""
    require_lm_eval()
    from lm_eval import simple_evaluate  # optional dependency
    from lm_eval.models.huggingface import HFLM  # optional dependency
    from lm_eval.tasks import TaskManager  # optional dependency

    names = parse_tasks(tasks)
    if task_dir is not None and not Path(task_dir).is_dir():
        raise FileNotFoundError(f"task folder {task_dir} does not exist")
    include = [str(task_dir)] if task_dir else []
    if SMOKE_TASK in names and not (task_dir and (Path(task_dir) / f"{SMOKE_TASK}.yaml").is_file()):
        include.append(str(builtin_smoke_task_dir()))
    # indexing lm-eval's ~15k built-in tasks takes seconds: only when a name is not a local task
    manager = TaskManager(include_path=include, include_defaults=False) if include else None
    if manager is None or any(n not in manager.all_tasks for n in names):
        manager = TaskManager(include_path=include or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"unknown lm-eval task(s) {', '.join(unknown)}"
            + ("" if task_dir else " (pass --task-dir with local task YAMLs)")
        )
    if isinstance(model_or_path, (str, os.PathLike)):
        model = load_model(model_or_path, trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(model_or_path)
    else:
        model, tokenizer = model_or_path
    lm = HFLM(pretrained=model.to(device), tokenizer=tokenizer, batch_size=batch_size, device=device)
    out = simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=False,
        bootstrap_iters=0,
    )
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    return out


# --------------------------------------------------------------------------- the smoke task


def _sentences(text: str, min_words: int = 12, max_words: int = 40) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat):
        words = s.split()
        if min_words <= len(words) <= max_words and not re.search(r"\d{3,}|[_|\[\]]", s):
            out.append(s.strip())
    return out


def builtin_smoke_task_dir() -> Path:
    """The built-in smoke task (40 items from britannica-eval), written once into the cache."""
    folder = cache_dir() / "lm_eval_tasks" / "smoke-v1"
    if not (folder / f"{SMOKE_TASK}.yaml").is_file():
        write_smoke_task(folder)
    return folder


def write_smoke_task(
    task_dir: str | os.PathLike,
    text: str | os.PathLike = "britannica-eval",
    n: int = 40,
    seed: int = 0,
    name: str = SMOKE_TASK,
) -> Path:
    """An lm-eval task in ARC-Easy's format built from a local text: each item is the first
    half of a sentence, the choices are its true second half and the second halves of three
    other sentences. It exercises the harness offline; its scores are not benchmark scores."""
    text_path = resolve_text(text)
    sentences = _sentences(read_text(text_path))
    if len(sentences) < n + 3:
        raise ValueError(f"{text_path} has only {len(sentences)} usable sentences; need {n + 3}")
    rng = random.Random(seed)
    picked = rng.sample(sentences, n + 3)
    halves = []
    for s in picked:
        words = s.split()
        cut = len(words) // 2
        halves.append((" ".join(words[:cut]), " ".join(words[cut:])))
    task_dir = Path(task_dir)
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / f"{name}.jsonl"
    tmp = data.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for i in range(n):
            others = rng.sample([j for j in range(len(halves)) if j != i], 3)
            options = [halves[i][1]] + [halves[j][1] for j in others]
            order = list(range(4))
            rng.shuffle(order)
            labels = ["A", "B", "C", "D"]
            f.write(
                json.dumps(
                    {
                        "id": f"{name}-{i}",
                        "question": halves[i][0],
                        "choices": {"text": [options[k] for k in order], "label": labels},
                        "answerKey": labels[order.index(0)],
                    }
                )
                + "\n"
            )
    os.replace(tmp, data)  # the YAML, written last, marks a complete task
    label = f"hf_symmetry smoke cloze ({Path(text_path).stem}, local; not a benchmark)"
    yaml_text = f"""# Written by hf_symmetry.evaluation.bridge.write_smoke_task: ARC-Easy's format on sentences
# of a local text ({text_path.name}). A smoke test of the offline lm-eval pipeline, NOT ARC-Easy.
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data.resolve()))}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  card_name: {json.dumps(label)}
  card_note: "smoke task on local text, not a benchmark"
"""
    tmp_yaml = task_dir / f".{name}.yaml.tmp"
    tmp_yaml.write_text(yaml_text, encoding="utf-8")
    os.replace(tmp_yaml, task_dir / f"{name}.yaml")
    return task_dir
