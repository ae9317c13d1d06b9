"""The one training setup of hf_symmetry: transformers' ``Trainer`` configured for causal LMs.

Used by ``hf-symmetry heal`` (distillation, with a custom loss) and ``examples/train_clm.py``
(pretraining, the model's own LM loss). :func:`train` builds the ``Trainer`` from a model, packed
datasets (:mod:`hf_symmetry.training.data`) and :class:`TrainSettings`, and runs it:

* AdamW, cosine learning-rate schedule with linear warmup, gradient clipping, gradient accumulation;
* bf16 autocast where the device supports it (CUDA with bf16), float32 elsewhere (CPU);
* a tqdm progress bar whose postfix shows the running training loss (named ``loss_name``, e.g.
  ``kd_loss``), and the held-out loss every ``eval_steps``;
* checkpoints (model or adapter, optimizer, scheduler, RNG and data position) every ``save_steps``
  into ``output_dir/checkpoint-N``; ``resume=True`` continues from the last one;
* no distributed code of its own: run the same script under ``accelerate launch`` or
  ``torchrun --nproc_per_node N`` and the Trainer (through accelerate) wraps the model in DDP
  (gloo on CPU, NCCL on GPU) and shards the batches. ``per_device_batch_size`` is per process, so the
  global batch is ``per_device_batch_size × gradient_accumulation_steps × processes``; use
  :func:`per_device_batch` to keep a global batch fixed whatever the number of processes. The data
  order depends only on ``seed`` and the global batch, so N processes see the same global batches
  as one process does.

A custom loss is any callable ``loss(model, inputs) -> Tensor | (Tensor, dict[str, float])``: a
scalar mean over the micro-batch (the Trainer divides by the accumulation steps; DDP averages over
processes) plus, optionally, named components that are averaged and logged next to the loss.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = [
    "TrainSettings",
    "TrainOutcome",
    "train",
    "per_device_batch",
    "world_size",
    "is_main_process",
    "last_checkpoint",
    "bf16_available",
]

LossFn = Callable[[torch.nn.Module, dict], Any]


def world_size() -> int:
    """Number of processes of this run (``WORLD_SIZE`` set by torchrun / accelerate launch; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """True on the process that writes outputs (global rank 0)."""
    return int(os.environ.get("RANK", "0")) == 0


def per_device_batch(global_batch: int, gradient_accumulation_steps: int = 1, processes: int | None = None) -> int:
    """The per-process micro-batch that gives ``global_batch`` sequences per optimizer step.
    Raises ``ValueError`` when it does not divide."""
    processes = world_size() if processes is None else processes
    denom = gradient_accumulation_steps * processes
    if global_batch % denom:
        raise ValueError(
            f"global batch {global_batch} is not divisible by {gradient_accumulation_steps} "
            f"accumulation step(s) x {processes} process(es)"
        )
    return global_batch // denom


def bf16_available() -> bool:
    """bf16 autocast is used where the device has it: CUDA devices with bf16 support (not CPU)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` folder under ``output_dir`` (``None`` if there is none)."""
    from transformers.trainer_utils import get_last_checkpoint  # lazy: keeps `hf-symmetry --help` fast

    return get_last_checkpoint(str(output_dir)) if Path(output_dir).is_dir() else None


@dataclass
class TrainSettings:
    """Everything :func:`train` needs besides the model and data.

    Attributes:
        output_dir: checkpoints (``checkpoint-N``) go here; the final model is saved by the caller.
        max_steps: optimizer steps.
        per_device_batch_size: sequences per process per micro-batch.
        gradient_accumulation_steps: micro-batches per optimizer step.
        learning_rate: peak learning rate (after warmup; cosine decay to 0 at ``max_steps``).
        warmup_steps: linear warmup steps (``None``: 5 % of ``max_steps``, at least 1 when
            ``max_steps >= 10``).
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient clipping norm (0 or ``None``: no clipping).
        eval_steps: evaluate the held-out loss every N steps (``None``: only at the end).
        save_steps: checkpoint every N steps (``None``: no intermediate checkpoints).
        save_total_limit: keep at most this many checkpoints (``None``: all).
        logging_steps: running-loss window and logging interval.
        seed: seeds the data order, dropout and any random initialisation done by the Trainer.
        bf16: ``None``: bf16 autocast where :func:`bf16_available` and not ``use_cpu`` (a run told to
            use the CPU trains in float32 even on a machine with a GPU); ``True``/``False`` forces it.
        use_cpu: train on CPU even when an accelerator is present.
        resume: continue from the last checkpoint in ``output_dir`` (none there: start fresh).
        progress: show the tqdm progress bar.
        loss_name: label of the running loss in the progress bar (e.g. ``"kd_loss"``).
        gradient_checkpointing: recompute activations in the backward pass (less memory).
        extra: further ``TrainingArguments`` fields, passed through unchanged.
    """

    output_dir: str
    max_steps: int
    per_device_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    eval_steps: int | None = None
    save_steps: int | None = None
    save_total_limit: int | None = None
    logging_steps: int = 10
    seed: int = 0
    bf16: bool | None = None
    use_cpu: bool = False
    resume: bool = False
    progress: bool = True
    loss_name: str = "loss"
    gradient_checkpointing: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` for impossible settings (before any work)."""
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {self.max_steps}")
        if self.per_device_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError("batch size and gradient accumulation steps must be at least 1")
        if self.learning_rate < 0 or not math.isfinite(self.learning_rate):
            raise ValueError(f"learning rate must be finite and >= 0, got {self.learning_rate}")
        for name in ("eval_steps", "save_steps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")

    def global_batch(self, processes: int | None = None) -> int:
        return self.per_device_batch_size * self.gradient_accumulation_steps * (processes or world_size())

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainOutcome:
    """What :func:`train` returns."""

    model: torch.nn.Module  # the trained model (unwrapped from DDP; a PeftModel stays a PeftModel)
    global_step: int
    train_loss: float  # mean training loss over this run's steps (as reported by the Trainer)
    eval_loss: float | None  # held-out loss at the end (None without an eval dataset)
    log_history: list[dict]
    resumed_from: str | None
    train_tokens: int  # tokens seen by the optimizer over all steps (all processes)
    seconds: float
    tokens_per_second: float  # this run's training throughput (all processes together)
    cpu_seconds: float = 0.0  # process CPU seconds of this process's training (all its threads)


def _make_trainer_class():
    from transformers import Trainer  # lazy: keeps `hf-symmetry --help` fast

    class HFSymmetryTrainer(Trainer):
        """``Trainer`` with a pluggable loss (``loss_fn``) and logged loss components."""

        def __init__(self, *a, loss_fn: LossFn | None = None, **kw):
            super().__init__(*a, **kw)
            self.loss_fn = loss_fn
            self._components: dict[str, list[float]] = {}
            if loss_fn is not None:
                # our loss is a per-micro-batch mean: let the Trainer divide it by the accumulation steps
                self.loss_is_scaled_for_ga = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.loss_fn is None:
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            out = self.loss_fn(model, inputs)
            loss, parts = out if isinstance(out, tuple) else (out, {})
            if model.training:
                for k, v in parts.items():
                    self._components.setdefault(k, []).append(float(v))
            return (loss, None) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            if "loss" in logs and self._components:
                for k, v in self._components.items():
                    logs[k] = sum(v) / len(v)
                self._components = {}
            super().log(logs, *args, **kwargs)

    return HFSymmetryTrainer


def _progress_callback(loss_name: str):
    from transformers.trainer_callback import ProgressCallback  # lazy: keeps `hf-symmetry --help` fast

    class LossProgressCallback(ProgressCallback):
        """The Trainer's progress bar with the running loss as its postfix; eval losses are printed."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs:
                return
            if "loss" in logs:
                post = {loss_name: f"{logs['loss']:.4g}"}
                post.update({k: f"{v:.4g}" for k, v in logs.items() if k.endswith("_part")})
                self.training_bar.set_postfix(post, refresh=True)
            if "eval_loss" in logs:
                self.training_bar.write(f"step {state.global_step}: held-out {loss_name} {logs['eval_loss']:.4f}")

    return LossProgressCallback()


def training_arguments(settings: TrainSettings, has_eval: bool):
    """The ``TrainingArguments`` :func:`train` uses (exposed for inspection and tests)."""
    from transformers import TrainingArguments  # lazy: keeps `hf-symmetry --help` fast

    s = settings
    warmup = (
        s.warmup_steps
        if s.warmup_steps is not None
        else (max(1, round(0.05 * s.max_steps)) if s.max_steps >= 10 else 0)
    )
    bf16 = (bf16_available() and not s.use_cpu) if s.bf16 is None else s.bf16
    kw = dict(
        output_dir=s.output_dir,
        max_steps=s.max_steps,
        per_device_train_batch_size=s.per_device_batch_size,
        per_device_eval_batch_size=s.per_device_batch_size,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        learning_rate=s.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=warmup,
        weight_decay=s.weight_decay,
        max_grad_norm=s.max_grad_norm or 0.0,
        logging_steps=s.logging_steps,
        seed=s.seed,
        data_seed=s.seed,
        bf16=bf16,
        use_cpu=s.use_cpu,
        report_to="none",
        disable_tqdm=not s.progress,
        save_strategy="steps" if s.save_steps else "no",
        save_steps=s.save_steps or 500,
        save_total_limit=s.save_total_limit,
        eval_strategy="steps" if (has_eval and s.eval_steps) else "no",
        eval_steps=s.eval_steps,
        prediction_loss_only=True,
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    if s.gradient_checkpointing:
        kw["gradient_checkpointing"] = True
    kw.update(s.extra)
    return TrainingArguments(**kw)


def train(
    model: torch.nn.Module,
    train_dataset,
    eval_dataset=None,
    settings: TrainSettings | None = None,
    loss_fn: LossFn | None = None,
    callbacks=(),
    data_collator=None,
) -> TrainOutcome:
    """Build the ``Trainer`` for ``model`` and run ``settings.max_steps`` optimizer steps.

    Args:
        model: a causal LM (``PreTrainedModel`` or a PEFT ``PeftModel``); only parameters with
            ``requires_grad`` are trained.
        train_dataset / eval_dataset: map-style datasets of equal-length ``input_ids``/``labels``
            (e.g. :class:`~hf_symmetry.training.data.PackedDataset`); extra keys reach ``loss_fn``.
        settings: :class:`TrainSettings` (validated first).
        loss_fn: ``None`` for the model's own LM loss, else ``loss_fn(model, inputs)`` (see module doc).
        callbacks: extra ``TrainerCallback`` objects.
        data_collator: defaults to stacking the tensors of each item.

    Returns a :class:`TrainOutcome`. Saving the final model is the caller's job (only on
    :func:`is_main_process`); checkpoints for ``resume`` are written here.
    """
    from transformers.trainer_callback import ProgressCallback  # lazy: keeps `hf-symmetry --help` fast

    settings.validate()
    if len(train_dataset) < settings.per_device_batch_size * world_size():
        raise ValueError(
            f"{len(train_dataset)} training sequences are fewer than one global micro-batch "
            f"({settings.per_device_batch_size} x {world_size()} process(es))"
        )
    args = training_arguments(settings, eval_dataset is not None)
    collate = data_collator or _stack
    trainer = _make_trainer_class()(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collate,
        loss_fn=loss_fn,
        callbacks=list(callbacks),
    )
    if settings.progress:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(_progress_callback(settings.loss_name))
    resume = last_checkpoint(settings.output_dir) if settings.resume else None
    start_step = int(Path(resume).name.split("-")[-1]) if resume else 0
    t0, c0 = time.perf_counter(), time.process_time()
    result = trainer.train(resume_from_checkpoint=resume)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    eval_loss = None
    if eval_dataset is not None:
        eval_loss = float(trainer.evaluate()["eval_loss"])
    seq_len = int(train_dataset[0]["input_ids"].shape[-1])
    global_batch = settings.per_device_batch_size * settings.gradient_accumulation_steps * trainer.args.world_size
    steps_run = trainer.state.global_step - start_step
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return TrainOutcome(
        model=unwrapped,
        global_step=trainer.state.global_step,
        train_loss=float(result.training_loss),
        eval_loss=eval_loss,
        log_history=list(trainer.state.log_history),
        resumed_from=resume,
        train_tokens=trainer.state.global_step * global_batch * seq_len,
        seconds=seconds,
        tokens_per_second=steps_run * global_batch * seq_len / max(seconds, 1e-9),
        cpu_seconds=cpu_seconds,
    )


def _stack(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}
