"""``heal``: recovery fine-tuning of a converted model by distillation from the original.

Pipeline (:func:`heal_checkpoint`):

1. **Checks, before any work** (one ``ValueError``/``FileExistsError`` each, nothing written): options,
   OUT (must not exist unless ``overwrite``), the run folder (``<OUT>.heal-run``: must exist for
   ``resume``, must not otherwise), the student is a causal LM of a supported family, teacher and
   student share the tokenizer and output vocabulary, the training text is non-empty and long
   enough for one sequence, the LoRA rank fits every adapted projection.
2. **Data**: the training text packed into ``seq_len`` sequences (:mod:`.data`),
   split by document into train and held-out; by default half of the training sequences
   (``teacher_sample_fraction``, or ``teacher_samples`` of them) sampled from the teacher instead
   (cached under the hf_symmetry cache and reused while the teacher is unchanged); optionally the
   teacher's top-k logits of every training sequence cached on disk (``teacher_cache``) so that
   later epochs and resumed runs skip the teacher.
3. **Adapters**: LoRA on every projection (:mod:`.peft_targets`; for the
   compressed family its structured factors) or ``full`` fine-tuning of all weights.
4. **Training**: :func:`hf_symmetry.training.train` with :class:`~.distill.DistillationLoss`
   (logits, plus with ``layer_loss_weight > 0`` the decoder-layer states through the conversion's layer
   map, :mod:`hf_symmetry.conversion.layer_map`; a student without one is distilled on the logits only, said in one
   line);
   checkpoints in the run folder make ``resume`` continue an interrupted run.
5. **Output** (main process only): adapters merged into the weights, the model saved in its own
   family (``save_pretrained``: custom families carry their remote code), tokenizer copied, optional
   ``adapter/`` (the PEFT adapter alone), held-out perplexity before/after, model card. Written to a
   temporary sibling and renamed, so OUT is complete or absent. The run folder is removed on success.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..assets import resolve_model, resolve_text
from ..modeling import causal_lm_model_types

__all__ = ["HealOptions", "HealReport", "heal_checkpoint", "run_dir_for", "check_student"]

ADAPTER_DIR = "adapter"


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


def run_dir_for(out) -> Path:
    """Where a run keeps its checkpoints and caches until OUT is written: ``<OUT>.heal-run``."""
    out = Path(out).absolute()
    return out.with_name(out.name + ".heal-run")


def _read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def check_student(folder: Path) -> dict:
    """The student's config, or ``ValueError`` if it is not a causal LM heal can train."""
    import transformers

    cfg = _read_config(folder)
    arch = " ".join(cfg.get("architectures") or [])
    mt = cfg.get("model_type")
    if "CausalLM" not in arch and "LMHeadModel" not in arch:
        raise ValueError(
            f"unsupported student {folder.name}: heal needs a causal language model, this is "
            f"{arch or mt} (no next-token distribution to distil)"
        )
    ours = causal_lm_model_types()
    known = mt in ours or mt in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if not known:
        raise ValueError(
            f"unsupported student {folder.name}: model_type {mt!r} is neither a transformers "
            f"family nor one of hf_symmetry's ({', '.join(ours)})"
        )
    return cfg


def _check_output(out: Path, overwrite: bool, resume: bool) -> Path:
    from ..checkpoint import check_output_dir

    check_output_dir(out, overwrite)
    run = run_dir_for(out)
    if resume and not (run.is_dir() and any(run.glob("checkpoint-*"))):
        raise FileNotFoundError(f"--resume: no interrupted run to continue ({run} has no checkpoint)")
    if not resume and run.exists():
        raise FileExistsError(f"an interrupted run exists at {run}: pass --resume to continue it, or remove it")
    return run


def _load(folder: Path, progress: bool = True):
    from transformers.utils import logging as hf_logging

    from ..evaluation.compare import load_model

    was = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        return load_model(folder, dtype=torch.float32)
    finally:
        if was and not progress:
            hf_logging.enable_progress_bar()


def _skeleton(folder: Path):
    """The model of ``folder`` built on the meta device from its config (structure only, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..modeling import register_auto_classes

    register_auto_classes()

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _perplexities(model, tokenizer, texts: list[str], eval_tokens: int, progress: bool) -> dict:
    from ..evaluation.perplexity import perplexity
    from ..text import read_text, tokenize_text

    out = {}
    for text in texts:
        ids = tokenize_text(tokenizer, read_text(resolve_text(text)), max_tokens=eval_tokens)
        out[text] = perplexity(model, ids, progress=False).perplexity
    return out


def heal_checkpoint(
    converted,
    out,
    teacher,
    texts,
    options: HealOptions,
    *,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    device: str = "auto",
    teacher_device: str | None = None,
    save_adapter: bool = False,
    eval_texts: list[str] | None = ("britannica-eval",),
    eval_tokens: int = 2048,
    heldout_kl_sequences: int = 16,
    keep_run_dir: bool = False,
    callbacks=(),
) -> HealReport:
    """Heal ``converted`` by distillation from ``teacher`` on ``texts``; write the result to ``out``.

    ``eval_texts``: texts scored for perplexity (teacher, before, after) on the main process; empty
    or ``None`` skips (``--no-verify``). ``callbacks``: extra ``TrainerCallback`` objects. Returns a
    :class:`HealReport` on every process (figures that
    only the main process measures are ``None``/empty elsewhere)."""
    from ..devices import resolve_device
    from ..evaluation.compare import load_tokenizer
    from . import build_datasets, is_main_process, train, world_size
    from .data import PackedDataset, read_documents
    from .distill import (
        DistillationLoss,
        build_teacher_cache,
        cached_teacher_samples,
        check_same_tokenizer,
        load_teacher_cache,
        mean_kl,
    )
    from ..conversion.layer_map import read_layer_map
    from .peft_targets import apply_lora, lora_plan
    from .run import TrainSettings, per_device_batch

    t_start = time.perf_counter()
    # ---- 1. checks (nothing written) -------------------------------------------------------
    options.validate()
    out = Path(out).absolute()
    run = _check_output(out, overwrite, resume)
    src, tea = resolve_model(converted), resolve_model(teacher)
    student_cfg = check_student(src)
    teacher_cfg = check_student(tea)
    text_paths = [resolve_text(t) for t in ([texts] if isinstance(texts, (str, Path)) else list(texts))]
    read_documents(text_paths)  # empty / non-UTF-8 / bad JSONL fail here
    eval_texts = list(eval_texts or [])
    for t in eval_texts:
        resolve_text(t)
    if eval_texts and eval_tokens < 2:
        raise ValueError(f"--ppl-tokens must be 0 (skip) or at least 2, got {eval_tokens}")
    dev = resolve_device(device)
    tdev = resolve_device(teacher_device) if teacher_device else None
    tok = load_tokenizer(src)
    check_same_tokenizer(tok, load_tokenizer(tea), student_cfg.get("vocab_size"), teacher_cfg.get("vocab_size"))
    if options.teacher_samples is None and options.sample_count() and tok.bos_token_id is tok.eos_token_id is None:
        # the default fraction needs a start token; an explicit --teacher-samples N is refused instead
        print(
            "hf-symmetry heal: the tokenizer has neither a BOS nor an EOS token: no teacher samples, text only",
            file=sys.stderr,
            flush=True,
        )
        options = dataclasses.replace(options, teacher_sample_fraction=0.0)
    per_device = per_device_batch(options.batch_size, options.grad_accum)
    plan = None if options.full else lora_plan(_skeleton(src), options.lora_rank)  # rank check, no weights read
    data = build_datasets(
        tok,
        text_paths,
        options.seq_len,
        options.validation_fraction,
        max_train_tokens=options.text_tokens(),
        seed=options.seed,
    )
    layer_map, layer_targets = None, "off"
    if options.layer_loss_weight > 0:
        layer_map = read_layer_map(src)
        why = (
            f"{src.name} has no layer map (layer_map.safetensors)"
            if layer_map is None
            else layer_map.mismatch(teacher_cfg, student_cfg)
        )
        if why:
            layer_map, layer_targets = None, f"none: {why}"
            if is_main_process():
                print(f"hf-symmetry heal: {why}: distilling the logits only", file=sys.stderr, flush=True)
        else:
            n, lo, hi = len(layer_map.bases), min(layer_map.layer_width), max(layer_map.layer_width)
            layer_targets = layer_map.kind + (
                f" ({n} rotation{'s' * (n > 1)}, width {lo}" + (f"-{hi}" if hi > lo else "") + ")"
                if layer_map.kind == "rotation"
                else ""
            )

    # ---- 2. teacher, data extras (run folder from here on) -----------------------------------
    from accelerate import PartialState

    if dev.type == "cuda" and world_size() == 1:
        torch.cuda.set_device(dev)  # resolve_device always names the index
    state = PartialState(cpu=dev.type == "cpu")
    if dev.type == "cuda" and world_size() > 1:
        dev = state.device  # each process its own GPU (LOCAL_RANK), as the Trainer places it
    if state.is_main_process:
        run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(options.seed)
    student = _load(src, progress)
    tmodel = _load(tea, progress)
    train_seqs = data.train.sequences
    samples_reused = False
    n_samples = options.sample_count()
    if n_samples:
        with state.main_process_first():  # the main process samples (or reads the cache), the others read
            sampled, _, samples_reused = cached_teacher_samples(
                tmodel,
                tok,
                tea,
                n_samples,
                options.seq_len,
                seed=options.seed,
                device=tdev or dev,
                progress=progress and state.is_main_process,
            )
        train_seqs = torch.cat([train_seqs, sampled])
    extras = None
    if options.teacher_cache:
        path = run / f"teacher-top{options.cache_k}.safetensors"
        with state.main_process_first():
            build_teacher_cache(
                tmodel,
                train_seqs,
                path,
                k=options.cache_k,
                teacher_id=str(tea),
                device=tdev or dev,
                progress=progress and state.is_main_process,
            )
            extras = load_teacher_cache(path, train_seqs)
        tmodel.to("cpu")
    train_ds = PackedDataset(train_seqs, extras)
    val_seqs = data.validation.sequences[:heldout_kl_sequences] if data.validation is not None else None

    # ---- 3. before-figures, adapters ---------------------------------------------------------
    ppl = {}
    kl_before = None
    main = is_main_process()
    if main:
        tmodel.to(tdev or dev)
        student.to(dev)
        if eval_texts:
            tp = _perplexities(tmodel, tok, eval_texts, eval_tokens, progress)
            bp = _perplexities(student, tok, eval_texts, eval_tokens, progress)
            ppl = {t: {"teacher": tp[t], "before": bp[t], "tokens": eval_tokens} for t in eval_texts}
        if val_seqs is not None:
            kl_before = mean_kl(student, tmodel, val_seqs, temperature=options.temperature)
        student.to("cpu")
    if options.full:
        student.requires_grad_(True)
        model = student
    else:
        model = apply_lora(student, plan)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # ---- 4. training -------------------------------------------------------------------------
    # with layer targets the teacher runs alongside even with --teacher-cache (its states are not cached)
    loss = DistillationLoss(
        None if options.teacher_cache and layer_map is None else tmodel,
        options.temperature,
        options.lm_weight,
        teacher_device=tdev,
        layer_map=layer_map,
        layer_weight=options.layer_loss_weight if layer_map is not None else 0.0,
        chunk_tokens=options.logit_chunk or None,
    )
    steps = options.steps()
    settings = TrainSettings(
        output_dir=str(run),
        max_steps=steps,
        per_device_batch_size=per_device,
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
        use_cpu=dev.type == "cpu",
        resume=resume,
        progress=progress,
        loss_name="kd_loss",
    )
    eval_ds = PackedDataset(data.validation.sequences) if (data.validation is not None and options.eval_steps) else None
    if eval_ds is not None and options.teacher_cache:
        loss.teacher = tmodel  # held-out batches carry no cached logits
        loss.__post_init__()
    result = train(model, train_ds, eval_ds, settings, loss_fn=loss, callbacks=callbacks)
    trained = result.model

    # ---- 5. output (main process) ------------------------------------------------------------
    report = HealReport(
        source=str(src),
        teacher=str(tea),
        output=str(out),
        model_type=student_cfg["model_type"],
        mode="full" if options.full else "lora",
        options=options.as_dict(),
        data=data.as_dict(),
        lora=None if plan is None else plan.as_dict(),
        trainable_params=trainable,
        steps=result.global_step,
        train_tokens=result.train_tokens,
        tokens_per_second=result.tokens_per_second,
        seconds=0.0,
        resumed_from=result.resumed_from,
        final_train_loss=_last_loss(result.log_history),
        teacher_samples=n_samples,
        teacher_samples_reused=samples_reused,
        layer_targets=layer_targets,
        device=str(dev),
        processes=world_size(),
        train_cpu_seconds=result.cpu_seconds,
    )
    if not main:
        return report
    _write_output(trained, tok, src, tea, out, overwrite, report, save_adapter, options, plan)
    merged = _load(out, progress).to(dev)
    tmodel.to(tdev or dev)
    if eval_texts:
        ap = _perplexities(merged, tok, eval_texts, eval_tokens, progress)
        for t in eval_texts:
            ppl[t]["after"] = ap[t]
    if val_seqs is not None:
        report.heldout_kl_before = kl_before
        report.heldout_kl_after = mean_kl(merged, tmodel, val_seqs, temperature=options.temperature)
    report.perplexity = ppl
    report.seconds = time.perf_counter() - t_start
    _write_card(out, report, tok)
    if not keep_run_dir:
        shutil.rmtree(run, ignore_errors=True)
    return report


def _last_loss(history: list[dict]) -> float | None:
    losses = [h["loss"] for h in history if "loss" in h]
    return float(losses[-1]) if losses else None


def _write_output(
    trained,
    tok,
    src: Path,
    tea: Path,
    out: Path,
    overwrite: bool,
    report: HealReport,
    save_adapter: bool,
    options: HealOptions,
    plan,
) -> None:
    from ..checkpoint import atomic_output_dir

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        if plan is not None:
            if save_adapter:
                trained.save_pretrained(tmp / ADAPTER_DIR)
                report.adapter_dir = str(out / ADAPTER_DIR)
            model = trained.merge_and_unload()
        else:
            model = trained
        dtype = _saved_dtype(src)
        model = model.to("cpu", dtype)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        gen = src / "generation_config.json"
        if gen.is_file() and not (tmp / "generation_config.json").is_file():
            shutil.copy2(gen, tmp / "generation_config.json")
        from ..conversion.layer_map import MAP_FILE

        if (src / MAP_FILE).is_file():  # the healed model relates to the original as its input did
            shutil.copy2(src / MAP_FILE, tmp / MAP_FILE)
        (tmp / "heal_report.json").write_text(json.dumps(_public(report.as_dict()), indent=2, default=str) + "\n")


def _public(d: dict) -> dict:
    from ..hub.lineage import public_report

    return public_report({**d, "teacher": Path(d["teacher"]).name})


def _saved_dtype(src: Path) -> torch.dtype:
    cfg = _read_config(src)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, str(name).removeprefix("torch."), torch.float32)


def _write_card(out: Path, report: HealReport, tok) -> None:
    from ..hub.cards import write_card
    from ..hub.eval_results import perplexity_result
    from ..hub.lineage import public_model_label

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
            "tokens_per_second": report.tokens_per_second,
            "device": report.device,
            "processes": report.processes,
        },
        "tags": ["distillation", "lora" if report.mode == "lora" else "full-fine-tuning"],
    }
    write_card(out, "heal", data)
