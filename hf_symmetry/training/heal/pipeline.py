"""The healing run (:func:`heal_checkpoint`), one function per step: the refusals before any work
(:func:`check_inputs`), the data and the LoRA plan (:func:`prepare_data`), the layer targets
(:func:`layer_targets`), the processes' placement (:func:`place_processes`), the student
(:func:`load_student`), the teacher, loaded once on its device (:func:`load_teacher`), the teacher's
samples and cache (:func:`teacher_data`), the before-figures and adapters (:func:`before_training`), the
training (:func:`train_student`), the report (:func:`heal_report`), then, on the main process, the healed
folder (:func:`save_output`), the after-figures (:func:`verify_after`) and the card (:func:`write_card`).

What the run is asked to do travels as one :class:`~.options.HealJob` (the recipe, :class:`~.options.HealOptions`,
inside it); what it has built so far as one :class:`HealState`. The teacher is named once in each form: its
folder (:attr:`HealState.teacher_dir`), the model (:attr:`HealState.teacher`) and its device
(:attr:`HealState.teacher_device`), where it is loaded and stays."""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import PartialState

from ...assets import resolve_model, resolve_text
from ...conversion.layer_map import read_layer_map
from ...devices import parse_device
from ...evaluation.compare import load_tokenizer
from .. import build_datasets, is_main_process, train, world_size
from ..data import PackedDataset, read_documents
from ..distill import (
    DistillationLoss,
    build_teacher_cache,
    cached_teacher_samples,
    check_same_tokenizer,
    load_teacher_cache,
    mean_kl,
)
from ..peft_targets import apply_lora, lora_plan
from ..trainer import TrainSettings, per_device_batch
from .checks import check_output, check_student
from .models import load_quietly, perplexities, skeleton
from .options import HealJob, HealOptions
from .output import write_output
from .report import HealReport, last_loss, write_heal_card


@dataclass
class HealState:
    """What a healing run has built so far, filled in step by step (see the module docstring)."""

    t_start: float
    options: HealOptions  # the recipe in force (no teacher samples where the tokenizer cannot start one)
    out: Path
    run: Path  # the run folder (``<OUT>.heal-run``)
    student_dir: Path
    teacher_dir: Path
    student_cfg: dict
    teacher_cfg: dict
    text_paths: list[Path]
    eval_texts: list[str]
    device: torch.device  # where this process trains the student
    teacher_device_named: torch.device | None  # ``--teacher-device``; None: the teacher follows the student
    tok: object
    per_device: int = 0
    plan: object = None  # the LoRA plan; None for full fine-tuning
    data: object = None
    layer_map: object = None
    layer_targets: str = "off"
    processes: object = None  # accelerate's PartialState
    main: bool = True
    student: object = None
    teacher: object = None
    n_samples: int = 0
    samples_reused: bool = False
    train_ds: object = None
    val_seqs: torch.Tensor | None = None
    ppl: dict = field(default_factory=dict)
    kl_before: float | None = None
    model: object = None  # the model trained: the student, or the student with adapters
    trainable: int = 0
    result: object = None  # the training's outcome

    @property
    def teacher_device(self) -> torch.device:
        """Where the teacher is loaded and stays: ``--teacher-device``, else the student's device."""
        return self.teacher_device_named or self.device


def heal_checkpoint(job: HealJob) -> HealReport:
    """Heal ``job.converted`` by distillation from ``job.teacher`` on ``job.texts`` with the recipe
    ``job.options``; write the result to ``job.out`` (:class:`~.options.HealJob` documents the rest).
    Returns a :class:`HealReport` on every process (figures that only the main process measures are
    ``None``/empty elsewhere)."""
    s = check_inputs(job)
    prepare_data(s)
    layer_targets(s)
    s.processes, s.device = place_processes(s.device)
    load_student(job, s)
    load_teacher(job, s)
    teacher_data(job, s)
    before_training(job, s)
    train_student(job, s)
    report = heal_report(s)
    if not s.main:
        return report
    save_output(job, s, report)
    verify_after(job, s, report)
    write_card(job, s, report)
    return report


# ---- 1. checks (nothing written) --------------------------------------------------------------------
def check_inputs(job: HealJob) -> HealState:
    """Every refusal that needs no data: options, OUT and the run folder, both models, the texts, the
    devices (each ``--device`` read once, by :func:`~hf_symmetry.devices.parse_device`), the shared
    tokenizer."""
    t_start = time.perf_counter()
    options = job.options
    options.validate()
    out = Path(job.out).absolute()
    run = check_output(out, job.overwrite, job.resume)
    student_dir, teacher_dir = resolve_model(job.converted), resolve_model(job.teacher)
    student_cfg, teacher_cfg = check_student(student_dir), check_student(teacher_dir)
    texts = job.texts
    text_paths = [resolve_text(t) for t in ([texts] if isinstance(texts, (str, Path)) else list(texts))]
    read_documents(text_paths)  # empty / non-UTF-8 / bad JSONL fail here
    eval_texts = list(job.eval_texts or [])
    for t in eval_texts:
        resolve_text(t)
    if eval_texts and job.eval_tokens < 2:
        raise ValueError(f"--ppl-tokens must be 0 (skip) or at least 2, got {job.eval_tokens}")
    device = parse_device(job.device).device
    teacher_device = parse_device(job.teacher_device).device if job.teacher_device else None
    tok = load_tokenizer(student_dir)
    check_same_tokenizer(tok, load_tokenizer(teacher_dir), student_cfg.get("vocab_size"), teacher_cfg.get("vocab_size"))
    if options.teacher_samples is None and options.sample_count() and tok.bos_token_id is tok.eos_token_id is None:
        # the default fraction needs a start token; an explicit --teacher-samples N is refused instead
        print(
            "hf-symmetry heal: the tokenizer has neither a BOS nor an EOS token: no teacher samples, text only",
            file=sys.stderr,
            flush=True,
        )
        options = dataclasses.replace(options, teacher_sample_fraction=0.0)
    return HealState(
        t_start=t_start,
        options=options,
        out=out,
        run=run,
        student_dir=student_dir,
        teacher_dir=teacher_dir,
        student_cfg=student_cfg,
        teacher_cfg=teacher_cfg,
        text_paths=text_paths,
        eval_texts=eval_texts,
        device=device,
        teacher_device_named=teacher_device,
        tok=tok,
    )


def prepare_data(s: HealState) -> None:
    """The per-device batch, the LoRA plan (its rank checked on the weightless skeleton) and the packed
    train/held-out datasets."""
    options = s.options
    s.per_device = per_device_batch(options.batch_size, options.grad_accum)
    s.plan = None if options.full else lora_plan(skeleton(s.student_dir), options.lora_rank)  # no weights read
    s.data = build_datasets(
        s.tok,
        s.text_paths,
        options.seq_len,
        options.validation_fraction,
        max_train_tokens=options.text_tokens(),
        seed=options.seed,
    )


def layer_targets(s: HealState) -> None:
    """With ``layer_loss_weight > 0``: the student's layer map, or, where it has none or it does not fit
    the teacher, one line saying so (the logits alone are distilled)."""
    if s.options.layer_loss_weight <= 0:
        return
    layer_map = read_layer_map(s.student_dir)
    why = (
        f"{s.student_dir.name} has no layer map (layer_map.safetensors)"
        if layer_map is None
        else layer_map.mismatch(s.teacher_cfg, s.student_cfg)
    )
    if why:
        s.layer_map, s.layer_targets = None, f"none: {why}"
        if is_main_process():
            print(f"hf-symmetry heal: {why}: distilling the logits only", file=sys.stderr, flush=True)
        return
    n, lo, hi = len(layer_map.bases), min(layer_map.layer_width), max(layer_map.layer_width)
    s.layer_map = layer_map
    s.layer_targets = layer_map.kind + (
        f" ({n} rotation{'s' * (n > 1)}, width {lo}" + (f"-{hi}" if hi > lo else "") + ")"
        if layer_map.kind == "rotation"
        else ""
    )


# ---- 2. processes, models, teacher data (run folder from here on) -----------------------------------
def place_processes(dev: torch.device):
    """accelerate's process state for a run on the resolved device ``dev``, and the device this process
    trains on: ``dev`` itself in one process; under several processes on CUDA, each process's own GPU
    (LOCAL_RANK), as the Trainer places it."""
    if dev.type == "cuda" and world_size() == 1:
        torch.cuda.set_device(dev)  # parse_device always names the index
    state = PartialState(cpu=dev.type == "cpu")
    if dev.type == "cuda" and world_size() > 1:
        dev = state.device  # each process its own GPU (LOCAL_RANK), as the Trainer places it
    return state, dev


def load_student(job: HealJob, s: HealState) -> None:
    """The run folder (main process), the seed, then the student in float32 on the CPU (the Trainer
    places it)."""
    if s.processes.is_main_process:
        s.run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s.options.seed)
    s.student = load_quietly(s.student_dir, job.progress)


def load_teacher(job: HealJob, s: HealState) -> None:
    """The teacher in float32 on its device (:attr:`HealState.teacher_device`), where it stays: it samples,
    fills the cache, is measured and teaches there."""
    s.teacher = load_quietly(s.teacher_dir, job.progress).to(s.teacher_device)


def teacher_data(job: HealJob, s: HealState) -> None:
    """The training sequences with the teacher's samples (sampled by the main process, or read from the
    cache) and, with ``teacher_cache``, its cached top-k logits; the held-out sequences for the KL."""
    options, state = s.options, s.processes
    progress = job.progress and state.is_main_process
    train_seqs = s.data.train.sequences
    s.n_samples = options.sample_count()
    if s.n_samples:
        with state.main_process_first():  # the main process samples (or reads the cache), the others read
            sampled, _, s.samples_reused = cached_teacher_samples(
                s.teacher, s.tok, s.teacher_dir, s.n_samples, options.seq_len, seed=options.seed, progress=progress
            )
        train_seqs = torch.cat([train_seqs, sampled])
    extras = None
    if options.teacher_cache:
        path = s.run / f"teacher-top{options.cache_k}.safetensors"
        with state.main_process_first():
            build_teacher_cache(
                s.teacher, train_seqs, path, k=options.cache_k, teacher_id=str(s.teacher_dir), progress=progress
            )
            extras = load_teacher_cache(path, train_seqs)
    s.train_ds = PackedDataset(train_seqs, extras)
    data = s.data
    s.val_seqs = data.validation.sequences[: job.heldout_kl_sequences] if data.validation is not None else None


# ---- 3. before-figures, adapters ----------------------------------------------------------------------
def before_training(job: HealJob, s: HealState) -> None:
    """On the main process, the teacher's and the student's perplexities and the student's held-out KL
    before training; then the model to train: the student (``full``) or the student with LoRA adapters."""
    s.main = is_main_process()
    if s.main:
        s.student.to(s.device)
        if s.eval_texts:
            tp = perplexities(s.teacher, s.tok, s.eval_texts, job.eval_tokens, job.progress)
            bp = perplexities(s.student, s.tok, s.eval_texts, job.eval_tokens, job.progress)
            s.ppl = {t: {"teacher": tp[t], "before": bp[t], "tokens": job.eval_tokens} for t in s.eval_texts}
        if s.val_seqs is not None:
            s.kl_before = mean_kl(s.student, s.teacher, s.val_seqs, temperature=s.options.temperature)
        s.student.to("cpu")
    if s.options.full:
        s.student.requires_grad_(True)
        s.model = s.student
    else:
        s.model = apply_lora(s.student, s.plan)
    s.trainable = sum(p.numel() for p in s.model.parameters() if p.requires_grad)


# ---- 4. training ----------------------------------------------------------------------------------------
def train_student(job: HealJob, s: HealState) -> None:
    """Distil the teacher into :attr:`HealState.model` with the shared Trainer setup."""
    options, data = s.options, s.data
    # with layer targets the teacher runs alongside even with --teacher-cache (its states are not cached)
    loss = DistillationLoss(
        None if options.teacher_cache and s.layer_map is None else s.teacher,
        options.temperature,
        options.lm_weight,
        teacher_device=s.teacher_device_named,
        layer_map=s.layer_map,
        layer_weight=options.layer_loss_weight if s.layer_map is not None else 0.0,
        chunk_tokens=options.logit_chunk or None,
    )
    eval_ds = PackedDataset(data.validation.sequences) if (data.validation is not None and options.eval_steps) else None
    if eval_ds is not None and options.teacher_cache:
        loss.teacher = s.teacher  # held-out batches carry no cached logits
        loss.__post_init__()
    s.result = train(s.model, s.train_ds, eval_ds, train_settings(job, s), loss_fn=loss, callbacks=job.callbacks)


def train_settings(job: HealJob, s: HealState) -> TrainSettings:
    """The Trainer's settings of the run: the recipe's, the run folder, where it trains, ``resume``."""
    options = s.options
    steps = options.steps()
    return TrainSettings(
        output_dir=str(s.run),
        max_steps=steps,
        per_device_batch_size=s.per_device,
        gradient_accumulation_steps=options.grad_accum,
        learning_rate=options.learning_rate,
        warmup_steps=options.warmup_steps,
        weight_decay=options.weight_decay,
        max_grad_norm=options.max_grad_norm,
        eval_steps=options.eval_steps,
        save_steps=options.save_steps or max(25, math.ceil(steps / 10)),
        save_total_limit=2,
        logging_steps=max(1, min(10, steps // 20)),
        seed=options.seed,
        use_cpu=s.device.type == "cpu",
        resume=job.resume,
        progress=job.progress,
        loss_name="kd_loss",
    )


# ---- 5. report, output, after-figures, card (main process) ------------------------------------------------
def heal_report(s: HealState) -> HealReport:
    """The report of the run so far (every process); the main process adds the after-figures."""
    options, result = s.options, s.result
    return HealReport(
        source=str(s.student_dir),
        teacher=str(s.teacher_dir),
        output=str(s.out),
        model_type=s.student_cfg["model_type"],
        mode="full" if options.full else "lora",
        options=options.as_dict(),
        data=s.data.as_dict(),
        lora=None if s.plan is None else s.plan.as_dict(),
        trainable_params=s.trainable,
        steps=result.global_step,
        train_tokens=result.train_tokens,
        tokens_per_second=result.tokens_per_second,
        seconds=0.0,
        resumed_from=result.resumed_from,
        final_train_loss=last_loss(result.log_history),
        teacher_samples=s.n_samples,
        teacher_samples_reused=s.samples_reused,
        layer_targets=s.layer_targets,
        device=str(s.device),
        processes=world_size(),
        train_cpu_seconds=result.cpu_seconds,
    )


def save_output(job: HealJob, s: HealState, report: HealReport) -> None:
    """The healed folder: adapters merged, the model in its own family, tokenizer, side files, report."""
    write_output(
        s.result.model,
        s.tok,
        s.student_dir,
        s.out,
        report,
        s.plan,
        overwrite=job.overwrite,
        save_adapter=job.save_adapter,
    )


def verify_after(job: HealJob, s: HealState, report: HealReport) -> None:
    """The healed folder read back: its perplexities and held-out KL to the teacher, beside the before-figures."""
    merged = load_quietly(s.out, job.progress).to(s.device)
    if s.eval_texts:
        ap = perplexities(merged, s.tok, s.eval_texts, job.eval_tokens, job.progress)
        for t in s.eval_texts:
            s.ppl[t]["after"] = ap[t]
    if s.val_seqs is not None:
        report.heldout_kl_before = s.kl_before
        report.heldout_kl_after = mean_kl(merged, s.teacher, s.val_seqs, temperature=s.options.temperature)
    report.perplexity = s.ppl


def write_card(job: HealJob, s: HealState, report: HealReport) -> None:
    """The run's time, the model card; the run folder is removed unless kept."""
    report.seconds = time.perf_counter() - s.t_start
    write_heal_card(s.out, report, s.tok)
    if not job.keep_run_dir:
        shutil.rmtree(s.run, ignore_errors=True)
