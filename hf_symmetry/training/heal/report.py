"""What a healing run reports: :class:`HealReport` (``heal_report.json``), the last training loss
of the log, and the model card written from the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...assets import resolve_text
from ...hub.cards import write_card
from ...hub.eval_results import perplexity_result
from ...hub.lineage import public_model_label


@dataclass
class HealReport:
    source: str
    teacher: str
    output: str
    model_type: str
    mode: str  # "lora" or "full"
    options: dict
    data: dict
    lora: dict | None
    trainable_params: int
    steps: int
    train_tokens: int
    tokens_per_second: float
    seconds: float
    resumed_from: str | None
    final_train_loss: float | None
    heldout_kl_before: float | None = None
    heldout_kl_after: float | None = None
    perplexity: dict = field(default_factory=dict)  # text -> {"teacher", "before", "after", "tokens"}
    adapter_dir: str | None = None
    teacher_samples: int = 0
    teacher_samples_reused: bool = False  # read from the hf_symmetry cache instead of sampled
    layer_targets: str = "off"  # the layer map used ("identity"/"rotation ..."), or why none
    device: str = "cpu"
    processes: int = 1
    train_cpu_seconds: float = 0.0  # CPU seconds of the training steps on the main process

    def as_dict(self) -> dict:
        return asdict(self)


def last_loss(history: list[dict]) -> float | None:
    losses = [h["loss"] for h in history if "loss" in h]
    return float(losses[-1]) if losses else None


def write_heal_card(out: Path, report: HealReport, tok) -> None:
    o = report.options
    results = []
    for text, p in report.perplexity.items():
        if p.get("after") is not None:
            results.append(perplexity_result(p["after"], text, resolve_text(text), max_tokens=p["tokens"]))
    summary = (
        f"`{public_model_label(report.source)}` healed by distillation from "
        f"`{public_model_label(report.teacher)}` with `hf-symmetry heal` "
        f"({'LoRA rank %d, merged into the weights' % o['lora_rank'] if report.mode == 'lora' else 'full fine-tuning'}"
        f", {report.train_tokens:,} training tokens). Same model family as its input"
        + ("; load it with `trust_remote_code=True`." if report.model_type.startswith("hf_symmetry") else ".")
    )
    data = {
        "title": out.name,
        "method": "heal",
        "summary": summary,
        "seed": o["seed"],
        "inputs": [str(report.source), str(report.teacher)],
        "parameters": {
            "mode": report.mode,
            **({"lora_rank": o["lora_rank"]} if report.mode == "lora" else {}),
            "train_tokens": report.train_tokens,
            "steps": report.steps,
            "seq_len": o["seq_len"],
            "batch_size": o["batch_size"],
            "learning_rate": o["learning_rate"],
            "temperature": o["temperature"],
            "lm_weight": o["lm_weight"],
            "teacher_cache": o["teacher_cache"],
            "teacher_samples": o["teacher_samples"],
            "layer_loss_weight": o["layer_loss_weight"],
        },
        "eval_results": results,
        "extra": {
            "teacher": public_model_label(report.teacher),
            "perplexity": report.perplexity,
            "heldout_kl_before": report.heldout_kl_before,
            "heldout_kl_after": report.heldout_kl_after,
            "train_documents": report.data.get("train_documents"),
            "trainable_params": report.trainable_params,
            "teacher_samples": report.teacher_samples,
            "layer_targets": report.layer_targets,
            "device": report.device,
            "processes": report.processes,
        },
        "tags": ["distillation", "lora" if report.mode == "lora" else "full-fine-tuning"],
    }
    write_card(out, "heal", data)
