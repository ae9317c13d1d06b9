"""The healing run, read top to bottom as the algorithm (:func:`heal_checkpoint`):

1. :class:`HealRun` is made from one :class:`~.options.HealJob`: every refusal before any work (nothing written),
   and what the run derives from the job, once: the recipe in force (:attr:`HealRun.options`), OUT and its run
   folder, both models' folders and configs, the evaluation texts, the devices, the shared tokenizer, the LoRA plan,
   the packed training and held-out data, the layer targets.
2. :meth:`HealRun.train` (every process): the processes placed, the student loaded, the teacher loaded once on its
   device (where it stays), the teacher's samples and cache, the before-figures (main process), the adapters, the
   training, the report; the main process writes the healed folder.
3. :meth:`HealRun.verify` (main process): the healed folder read back, its perplexities and held-out KL beside the
   before-figures, the model card; the run folder is removed.

What changes as the run goes is only what it makes: the device this process trains on (:attr:`HealRun.trains_on`,
known once the processes are placed), the teacher model (loaded once) and the perplexities and held-out KL measured
before training."""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
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


def heal_checkpoint(job: HealJob) -> HealReport:
    """Heal ``job.converted`` by distillation from ``job.teacher`` on ``job.train_texts`` with the recipe
    ``job.options``; write the result to ``job.out`` (:class:`~.options.HealJob` documents the rest).
    Returns a :class:`HealReport` on every process (figures that only the main process measures are
    ``None``/empty elsewhere)."""
    run = HealRun(job)
    report = run.train()
    if run.main:
        run.verify(report)
    return report


class HealRun:
    """One healing run (module docstring). Made from a :class:`~.options.HealJob`, it refuses what cannot run and
    derives the rest once; :meth:`train` and :meth:`verify` are the run."""

    # ---- 1. the checks, nothing written, and what the run derives once -------------------------------------------
    def __init__(self, job: HealJob) -> None:
        self.started = time.perf_counter()
        job.options.validate()
        self.out = Path(job.out).absolute()
        self.run_dir = check_output(self.out, job.overwrite, job.resume)  # (``<OUT>.heal-run``)
        self.student_dir, self.teacher_dir = resolve_model(job.converted), resolve_model(job.teacher)
        self.student_cfg, teacher_cfg = check_student(self.student_dir), check_student(self.teacher_dir)
        texts = job.train_texts
        train_texts = [resolve_text(t) for t in ([texts] if isinstance(texts, (str, Path)) else texts)]
        read_documents(train_texts)  # empty / non-UTF-8 / bad JSONL fail here
        self.eval_texts = list(job.eval_texts or [])
        for t in self.eval_texts:
            resolve_text(t)
        if self.eval_texts and job.eval_tokens < 2:
            raise ValueError(f"--ppl-tokens must be 0 (skip) or at least 2, got {job.eval_tokens}")
        self.device = parse_device(job.device).device  # (each --device read once)
        self.teacher_device = parse_device(job.teacher_device).device if job.teacher_device else None
        self.tok = load_tokenizer(self.student_dir)
        check_same_tokenizer(
            self.tok,
            load_tokenizer(self.teacher_dir),
            self.student_cfg.get("vocab_size"),
            teacher_cfg.get("vocab_size"),
        )
        #: what was asked, with the recipe in force: the one set of options every step reads
        self.job = dataclasses.replace(job, options=options_in_force(job.options, self.tok))
        self.main = is_main_process()
        options = self.options
        self.per_device = per_device_batch(options.batch_size, options.grad_accum)
        self.plan = None if options.full else lora_plan(skeleton(self.student_dir), options.lora_rank)  # no weights
        self.data = build_datasets(
            self.tok,
            train_texts,
            options.seq_len,
            options.validation_fraction,
            max_train_tokens=options.text_tokens(),
            seed=options.seed,
        )
        validation = self.data.validation
        self.held_out = validation.sequences[: job.heldout_kl_sequences] if validation is not None else None
        self.layer_map, self.layer_targets = layer_targets(self.student_dir, self.student_cfg, teacher_cfg, options)
        # what the run makes as it goes (set by train)
        self.trains_on: torch.device = self.device
        self.teacher = None
        self.perplexity: dict = {}  # text -> {"teacher", "before", "after", "tokens"}
        self.kl_before: float | None = None

    @property
    def options(self) -> HealOptions:
        """The recipe in force (no teacher samples where the tokenizer cannot start one)."""
        return self.job.options

    # ---- 2. the training (every process); the main process writes OUT ------------------------------------------
    def train(self) -> HealReport:
        """Place the processes, load the student and the teacher, add the teacher's sequences, measure the student
        before, distil, report; the main process writes the healed folder."""
        job, options = self.job, self.options
        processes, self.trains_on = place_processes(self.device)
        if processes.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(options.seed)
        student = load_quietly(self.student_dir, job.progress)
        self.teacher = load_quietly(self.teacher_dir, job.progress).to(self.teacher_device or self.trains_on)
        train_ds, samples = self.teacher_data(processes)
        if self.main:
            self.measure_before(student)
        if options.full:
            model = student.requires_grad_(True)
        else:
            model = apply_lora(student, self.plan)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        validation = self.data.validation
        eval_ds = PackedDataset(validation.sequences) if (validation is not None and options.eval_steps) else None
        result = train(
            model, train_ds, eval_ds, self.train_settings(), loss_fn=self.loss(eval_ds), callbacks=job.callbacks
        )
        report = self.report(result, trainable, samples)
        if self.main:
            write_output(
                result.model,
                self.tok,
                self.student_dir,
                self.out,
                report,
                self.plan,
                overwrite=job.overwrite,
                save_adapter=job.save_adapter,
            )
        return report

    def teacher_data(self, processes) -> tuple[PackedDataset, tuple[int, bool]]:
        """The training dataset: the text's sequences, the teacher's samples (sampled by the main process, or read
        from the cache) and, with ``teacher_cache``, its cached top-k logits; and ``(samples, whether reused)``."""
        options = self.options
        progress = self.job.progress and processes.is_main_process
        train_seqs, reused = self.data.train.sequences, False
        n_samples = options.sample_count()
        if n_samples:
            with processes.main_process_first():  # the main process samples (or reads the cache), the others read
                sampled, _, reused = cached_teacher_samples(
                    self.teacher,
                    self.tok,
                    self.teacher_dir,
                    n_samples,
                    options.seq_len,
                    seed=options.seed,
                    progress=progress,
                )
            train_seqs = torch.cat([train_seqs, sampled])
        extras = None
        if options.teacher_cache:
            path = self.run_dir / f"teacher-top{options.cache_k}.safetensors"
            with processes.main_process_first():
                build_teacher_cache(
                    self.teacher,
                    train_seqs,
                    path,
                    k=options.cache_k,
                    teacher_id=str(self.teacher_dir),
                    progress=progress,
                )
                extras = load_teacher_cache(path, train_seqs)
        return PackedDataset(train_seqs, extras), (n_samples, reused)

    def measure_before(self, student) -> None:
        """The teacher's and the student's perplexities and the student's held-out KL before training, on the
        device this process trains on (the student goes back to the CPU: the Trainer places it)."""
        job = self.job
        student.to(self.trains_on)
        if self.eval_texts:
            tp = perplexities(self.teacher, self.tok, self.eval_texts, job.eval_tokens, job.progress)
            bp = perplexities(student, self.tok, self.eval_texts, job.eval_tokens, job.progress)
            self.perplexity = {
                t: {"teacher": tp[t], "before": bp[t], "tokens": job.eval_tokens} for t in self.eval_texts
            }
        if self.held_out is not None:
            self.kl_before = mean_kl(student, self.teacher, self.held_out, temperature=self.options.temperature)
        student.to("cpu")

    def loss(self, eval_ds) -> DistillationLoss:
        """The distillation loss, made once with its teacher: none where every batch carries the teacher's cached
        top-k logits (``teacher_cache``), unless layer targets (their states are not cached) or held-out batches
        during training (they carry no cached logits) need it alongside."""
        options = self.options
        cached_only = options.teacher_cache and self.layer_map is None and eval_ds is None
        return DistillationLoss(
            None if cached_only else self.teacher,
            options.temperature,
            options.lm_weight,
            teacher_device=self.teacher_device,
            layer_map=self.layer_map,
            layer_weight=options.layer_loss_weight if self.layer_map is not None else 0.0,
            chunk_tokens=options.logit_chunk or None,
        )

    def train_settings(self) -> TrainSettings:
        """The Trainer's settings of the run: the recipe's, the run folder, where it trains, ``resume``."""
        options = self.options
        steps = options.steps()
        return TrainSettings(
            output_dir=str(self.run_dir),
            max_steps=steps,
            per_device_batch_size=self.per_device,
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
            use_cpu=self.trains_on.type == "cpu",
            resume=self.job.resume,
            progress=self.job.progress,
            loss_name="kd_loss",
        )

    def report(self, result, trainable: int, samples: tuple[int, bool]) -> HealReport:
        """The report of the run so far (every process); :meth:`verify` adds the after-figures."""
        options = self.options
        return HealReport(
            source=str(self.student_dir),
            teacher=str(self.teacher_dir),
            output=str(self.out),
            model_type=self.student_cfg["model_type"],
            mode="full" if options.full else "lora",
            options=options.as_dict(),
            data=self.data.as_dict(),
            lora=None if self.plan is None else self.plan.as_dict(),
            trainable_params=trainable,
            steps=result.global_step,
            train_tokens=result.train_tokens,
            tokens_per_second=result.tokens_per_second,
            seconds=0.0,
            resumed_from=result.resumed_from,
            final_train_loss=last_loss(result.log_history),
            teacher_samples=samples[0],
            teacher_samples_reused=samples[1],
            layer_targets=self.layer_targets,
            device=str(self.trains_on),
            processes=world_size(),
            train_cpu_seconds=result.cpu_seconds,
        )

    # ---- 3. the after-figures and the card (main process) -----------------------------------------------------
    def verify(self, report: HealReport) -> None:
        """The healed folder read back: its perplexities and held-out KL to the teacher beside the before-figures,
        in ``report``; the run's time; the model card; the run folder removed unless kept."""
        job = self.job
        merged = load_quietly(self.out, job.progress).to(self.trains_on)
        if self.eval_texts:
            after = perplexities(merged, self.tok, self.eval_texts, job.eval_tokens, job.progress)
            for t in self.eval_texts:
                self.perplexity[t]["after"] = after[t]
        if self.held_out is not None:
            report.heldout_kl_before = self.kl_before
            report.heldout_kl_after = mean_kl(merged, self.teacher, self.held_out, temperature=self.options.temperature)
        report.perplexity = self.perplexity
        report.seconds = time.perf_counter() - self.started
        write_heal_card(self.out, report, self.tok)
        if not job.keep_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def options_in_force(options: HealOptions, tok) -> HealOptions:
    """``options``, without teacher samples where the tokenizer has no token to start one from (said in one
    line; an explicit ``teacher_samples`` is refused when sampling instead)."""
    if options.teacher_samples is None and options.sample_count() and tok.bos_token_id is tok.eos_token_id is None:
        print(
            "hf-symmetry heal: the tokenizer has neither a BOS nor an EOS token: no teacher samples, text only",
            file=sys.stderr,
            flush=True,
        )
        return dataclasses.replace(options, teacher_sample_fraction=0.0)
    return options


def layer_targets(student_dir: Path, student_cfg: dict, teacher_cfg: dict, options: HealOptions) -> tuple:
    """``(layer map, what it is)``: with ``layer_loss_weight > 0``, the student's layer map, or, where it has none
    or it does not fit the teacher, ``None`` and one line saying so (the logits alone are distilled);
    ``(None, "off")`` otherwise."""
    if options.layer_loss_weight <= 0:
        return None, "off"
    layer_map = read_layer_map(student_dir)
    why = (
        f"{student_dir.name} has no layer map (layer_map.safetensors)"
        if layer_map is None
        else layer_map.mismatch(teacher_cfg, student_cfg)
    )
    if why:
        if is_main_process():
            print(f"hf-symmetry heal: {why}: distilling the logits only", file=sys.stderr, flush=True)
        return None, f"none: {why}"
    n, lo, hi = len(layer_map.bases), min(layer_map.layer_width), max(layer_map.layer_width)
    return layer_map, layer_map.kind + (
        f" ({n} rotation{'s' * (n > 1)}, width {lo}" + (f"-{hi}" if hi > lo else "") + ")"
        if layer_map.kind == "rotation"
        else ""
    )


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
