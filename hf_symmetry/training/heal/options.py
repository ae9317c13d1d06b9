"""What one healing run is asked to do: :class:`HealOptions` (the recipe: token budget, batches, LoRA or
full fine-tuning, loss weights, teacher samples and cache) with its checks and the figures derived
from it (learning rate, teacher samples, text tokens, steps), and :class:`HealJob` (the recipe with the
run's inputs and how it runs: what :func:`~.pipeline.heal_checkpoint` takes, as one object). In a recipe,
``tokens`` is the training budget (``heal --tokens``), never the verification's token count."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...flags import flag


@dataclass
class HealOptions:
    """Settings of one healing run: the recipe. Each field that ``hf-symmetry heal`` sets declares its flag
    (:func:`hf_symmetry.flags.flag`: the flag, its help, type and metavar, once)."""

    # the budget, the batches, LoRA or full fine-tuning, the learning rate and its warmup
    tokens: int = flag(262_144, "training tokens the optimizer sees, over all epochs (default: 262144)", type=int)
    seq_len: int = flag(512, "tokens per training sequence (default: 512)", type=int)
    batch_size: int = flag(8, "sequences per optimizer step, over all processes (default: 8)", type=int)
    grad_accum: int = flag(1, "gradient accumulation steps (default: 1)", type=int)
    lora_rank: int = flag(16, "LoRA rank (default: 16)", type=int)
    full: bool = flag(False, "fine-tune every weight instead of LoRA adapters", action="store_true")
    lr: float | None = flag(None, "peak learning rate (default: 1e-3 LoRA, 2e-5 --full)", type=float)
    warmup_steps: int | None = flag(None, "linear warmup steps (default: 5%% of the steps)", type=int)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # the distillation loss
    temperature: float = flag(1.0, "distillation temperature (default: 1)", type=float)
    lm_weight: float = flag(
        0.0, "weight λ of the plain LM loss: loss = (1-λ) KD + λ LM (default: 0, pure distillation)", type=float
    )
    teacher_cache: bool = flag(
        False,
        "run the teacher once and keep its top-k logits on disk (safetensors), reused every epoch "
        "and on --resume, instead of running it alongside the student",
        action="store_true",
    )
    cache_k: int = flag(64, "logits kept per position by --teacher-cache (default: 64)", type=int)
    teacher_samples: int | None = flag(  # None: teacher_sample_fraction
        None,
        "exactly N sequences sampled from the teacher instead of the fraction (0: none)",
        type=int,
        metavar="N",
    )
    teacher_sample_fraction: float = flag(  # (issue 30's recipe)
        0.5,
        "share of the tokens/seq-len training sequences sampled from the teacher itself instead of read "
        "from --text (data-free distillation; stated on the card), generated in batches on the teacher's "
        "device, deterministic for --seed, cached under the hf_symmetry cache and reused while the teacher "
        "is unchanged (default: 0.5, HealOptions' default; 0: --text only)",
        type=float,
        metavar="F",
    )
    layer_loss_weight: float = flag(
        0.0,
        "also distil every decoder layer's output state through the conversion's layer map "
        "(layer_map.safetensors: identity for TPA/FaRR, the residual rotation cut to the kept width for "
        "compress), relative squared error per position, weighted by W (default: 0, logits only); "
        "a student without a map is distilled on the logits only",
        type=float,
        metavar="W",
    )
    logit_chunk: int = flag(  # (training.logit_loss)
        2048,
        "form the student's and teacher's logits, the KL and the LM loss N positions at a time "
        "(no [batch, seq, vocab] logits; same loss and gradients); 0: all at once (default: 2048)",
        type=int,
        metavar="N",
    )
    validation_fraction: float = 0.05
    # the held-out loss and the checkpoints
    eval_steps: int | None = flag(None, "held-out KD loss every N steps (default: at the end)", type=int)
    save_steps: int | None = flag(
        None, "checkpoint every N steps (default: every 10%% of the steps, at most every 25)", type=int
    )
    seed: int = flag(0, "seed of data order and adapter initialisation (default: 0)", type=int)

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
