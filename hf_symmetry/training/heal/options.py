"""What one healing run is asked to do: :class:`HealOptions` (the recipe: token budget, batches, LoRA or
full fine-tuning, loss weights, teacher samples and cache) with its checks and the figures derived
from it (learning rate, teacher samples, text tokens, steps), and :class:`HealJob` (the recipe with the
run's inputs and how it runs: what :func:`~.pipeline.heal_checkpoint` takes, as one object). In a recipe,
``tokens`` is the training budget (``heal --tokens``), never the verification's token count."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class HealOptions:
    """Settings of one healing run (see ``hf-symmetry heal --help``)."""

    tokens: int = 262_144  # training tokens the optimizer sees (all epochs)
    seq_len: int = 512
    batch_size: int = 8  # sequences per optimizer step (global, all processes)
    grad_accum: int = 1
    lora_rank: int = 16
    full: bool = False
    lr: float | None = None  # None: 1e-3 with LoRA (every measured recipe), 2e-5 for --full
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    lm_weight: float = 0.0
    teacher_cache: bool = False
    cache_k: int = 64
    teacher_samples: int | None = None  # sequences sampled from the teacher; None: teacher_sample_fraction
    teacher_sample_fraction: float = 0.5  # share of the tokens/seq_len training sequences (issue 30's recipe)
    layer_loss_weight: float = 0.0  # weight of the per-layer state loss (layer map); 0: logits only
    logit_chunk: int = 2048  # positions whose logits are formed at once (training.logit_loss); 0: all
    validation_fraction: float = 0.05
    eval_steps: int | None = None
    save_steps: int | None = None  # None: every 10 % of the steps, at most every 25 steps
    seed: int = 0

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (2e-5 if self.full else 1e-3)

    def sample_count(self) -> int:
        """Training sequences sampled from the teacher: ``teacher_samples`` if set, else
        ``teacher_sample_fraction`` of the ``tokens // seq_len`` sequences the optimizer sees."""
        if self.teacher_samples is not None:
            return self.teacher_samples
        return round(self.teacher_sample_fraction * (self.tokens // self.seq_len))

    def text_tokens(self) -> int:
        """Tokens of the user's text read for training: the budget less the teacher samples' share."""
        return max(self.seq_len, self.tokens - self.sample_count() * self.seq_len)

    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.batch_size * self.seq_len)))

    def validate(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"--tokens must be positive, got {self.tokens}")
        if self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.batch_size < 1 or self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(
                f"--batch-size {self.batch_size} must be a positive multiple of --grad-accum {self.grad_accum}"
            )
        if not self.full and self.lora_rank < 1:
            raise ValueError(f"--lora-rank must be at least 1, got {self.lora_rank}")
        if self.lr is not None and (self.lr < 0 or not math.isfinite(self.lr)):
            raise ValueError(f"--lr must be finite and >= 0, got {self.lr}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not 0 <= self.lm_weight <= 1:
            raise ValueError(f"--lm-weight must be in [0, 1], got {self.lm_weight}")
        if (self.teacher_samples is not None and self.teacher_samples < 0) or self.cache_k < 1:
            raise ValueError("--teacher-samples must be >= 0 and --cache-k >= 1")
        if not 0 <= self.teacher_sample_fraction <= 1:
            raise ValueError(f"--teacher-sample-fraction must be in [0, 1], got {self.teacher_sample_fraction}")
        if self.logit_chunk < 0:
            raise ValueError(f"--logit-chunk must be >= 0 (0: all positions at once), got {self.logit_chunk}")
        if not (self.layer_loss_weight >= 0 and math.isfinite(self.layer_loss_weight)):
            raise ValueError(f"--layer-loss-weight must be finite and >= 0, got {self.layer_loss_weight}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["learning_rate"] = self.learning_rate
        d["teacher_samples"] = self.sample_count()
        d["steps"] = self.steps()
        return d


@dataclass
class HealJob:
    """What one healing run is asked to do, as one object: what :func:`~.pipeline.heal_checkpoint` takes (the run,
    :class:`~.pipeline.HealRun`, derives the rest from it once).

    ``converted``: the student folder (or alias); ``out``: the healed folder; ``teacher``: the original
    folder (or alias), sharing the student's tokenizer; ``train_texts``: the training text(s) (``heal --text``);
    ``options``: the recipe. ``overwrite``: replace OUT; ``resume``: continue the interrupted run kept in
    ``<OUT>.heal-run``; ``device``/``teacher_device``: ``--device`` strings (read by
    :func:`hf_symmetry.devices.parse_device`; the teacher follows the student unless given its own);
    ``save_adapter``: also write the PEFT adapter; ``eval_texts``: texts scored for perplexity (teacher, before,
    after) on the main process, empty or ``None`` skips (``--no-verify``), ``eval_tokens`` of each;
    ``heldout_kl_sequences``: held-out sequences of the KL before/after; ``keep_run_dir``: keep the run folder;
    ``callbacks``: extra ``TrainerCallback`` objects."""

    converted: str | Path
    out: str | Path
    teacher: str | Path
    train_texts: str | Path | list
    options: HealOptions = field(default_factory=HealOptions)
    overwrite: bool = False
    resume: bool = False
    progress: bool = True
    device: str = "auto"
    teacher_device: str | None = None
    save_adapter: bool = False
    eval_texts: list[str] | tuple[str, ...] | None = ("britannica-eval",)
    eval_tokens: int = 2048
    heldout_kl_sequences: int = 16
    keep_run_dir: bool = False
    callbacks: tuple | list = ()
