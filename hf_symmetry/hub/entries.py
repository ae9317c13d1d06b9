"""Card entries (dicts of ``huggingface_hub.EvalResult`` fields) from what evaluation measured:
perplexities, verifications and lm-eval results, ready for :func:`hf_symmetry.hub.write_card` /
:func:`hf_symmetry.hub.update_card`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..assets import resolve_text
from ..evaluation.bridge import run_lm_eval, text_perplexity
from ..evaluation.perplexity import PPL, PerplexityResult
from .eval_results import perplexity_result

LM_EVAL_URL = "https://github.com/EleutherAI/lm-evaluation-harness"
_LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")


def perplexity_card_entry(result: PerplexityResult, text: str | os.PathLike, max_tokens: int | None = None) -> dict:
    """The card entry for a perplexity; ``dataset_args`` hold what is needed to recompute it."""
    return perplexity_result(
        result.perplexity,
        text,
        text_path=resolve_text(text),
        max_tokens=max_tokens or None,
        window=result.window,
        stride=result.stride,
        tokens=result.tokens,
    )


def verification_card_entries(v) -> list[dict]:
    """Card entries from a :class:`~hf_symmetry.evaluation.verification.Verification`: the
    converted model's perplexity on the verification text (none for encoders)."""
    if v.perplexity_converted is None:
        return []
    return [
        perplexity_result(
            v.perplexity_converted,
            v.text,
            text_path=v.text_path,
            max_tokens=v.ppl_tokens,
            window=v.ppl_window,
            stride=v.ppl_stride,
            tokens=v.ppl_tokens,
        )
    ]


def text_perplexity_result(
    folder,
    text: str | os.PathLike,
    max_tokens: int | None = PPL.tokens,
    window: int = PPL.window,
    stride: int = PPL.stride,
    progress: bool = True,
) -> dict:
    """The perplexity of a written folder on a text, as a card entry."""
    trust = bool(json.loads((Path(folder) / "config.json").read_text()).get("auto_map"))
    r = text_perplexity(folder, text, max_tokens, window, stride, trust_remote_code=trust, progress=progress)
    return perplexity_card_entry(r, text, max_tokens)


def _task_dataset(name: str, config: dict) -> dict:
    """Card fields naming a task's data: a Hub dataset, or local files (never passed off as
    the benchmark they imitate)."""
    meta = config.get("metadata") or {}
    path = str(config.get("dataset_path") or "")
    split = config.get("test_split") or config.get("validation_split")
    if path in _LOCAL_LOADERS or os.path.exists(path):
        label = meta.get("card_name") or f"{name} (local data)"
        return {"dataset_type": f"local/{name}", "dataset_name": label, "dataset_split": split}
    return {
        "dataset_type": path,
        "dataset_name": meta.get("card_name") or name,
        "dataset_config": config.get("dataset_name"),
        "dataset_split": split,
    }


def lm_eval_card_entries(results: dict) -> list[dict]:
    """Card entries for every (task, metric) lm-eval reported, stderr left out."""
    import lm_eval  # optional dependency

    entries = []
    for task, metrics in results["results"].items():
        config = results.get("configs", {}).get(task, {})
        n = (results.get("n-samples", {}).get(task) or {}).get("effective")
        fewshot = config.get("num_fewshot", 0)
        declared = {m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)}
        for key, value in metrics.items():
            metric, _, _filter = key.partition(",")
            # only the task's declared metrics: lm-eval also reports bookkeeping such as sample_len
            if (
                (declared and metric not in declared)
                or metric in ("alias", "name", "sample_len")
                or metric.endswith("_stderr")
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                continue
            entries.append(
                {
                    "task_type": "multiple-choice"
                    if config.get("output_type") == "multiple_choice"
                    else "text-generation",
                    "task_name": task,
                    **_task_dataset(task, config),
                    "dataset_args": {"num_fewshot": fewshot, "samples": n},
                    "metric_type": metric,
                    "metric_name": metric,
                    "metric_value": float(value),
                    "source_name": f"lm-evaluation-harness {lm_eval.__version__}",
                    "source_url": LM_EVAL_URL,
                    "notes": (config.get("metadata") or {}).get("card_note"),
                }
            )
    return entries


def lm_eval_results(folder, tasks, task_dir=None, limit: int | None = None) -> list[dict]:
    """lm-eval on a written folder (remote code trusted when its config maps it), as card entries."""
    trust = bool(json.loads((Path(folder) / "config.json").read_text()).get("auto_map"))
    return lm_eval_card_entries(run_lm_eval(folder, tasks, task_dir=task_dir, limit=limit, trust_remote_code=trust))
