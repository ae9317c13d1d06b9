"""The healing run (:func:`heal_checkpoint`): checks, data, teacher samples and cache, before-figures,
adapters, training, then the output, the after-figures and the card."""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from ...assets import resolve_model, resolve_text
from .checks import check_output, check_student
from .models import load_quietly, perplexities, skeleton
from .options import HealOptions
from .output import write_output
from .report import HealReport, last_loss, write_heal_card


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
    from ...devices import resolve_device
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
    from ...conversion.layer_map import read_layer_map
    from ..peft_targets import apply_lora, lora_plan
    from ..trainer import TrainSettings, per_device_batch

    t_start = time.perf_counter()
    # ---- 1. checks (nothing written) -------------------------------------------------------
    options.validate()
    out = Path(out).absolute()
    run = check_output(out, overwrite, resume)
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
    plan = None if options.full else lora_plan(skeleton(src), options.lora_rank)  # rank check, no weights read
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
    student = load_quietly(src, progress)
    tmodel = load_quietly(tea, progress)
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
            tp = perplexities(tmodel, tok, eval_texts, eval_tokens, progress)
            bp = perplexities(student, tok, eval_texts, eval_tokens, progress)
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
        final_train_loss=last_loss(result.log_history),
        teacher_samples=n_samples,
        teacher_samples_reused=samples_reused,
        layer_targets=layer_targets,
        device=str(dev),
        processes=world_size(),
        train_cpu_seconds=result.cpu_seconds,
    )
    if not main:
        return report
    write_output(trained, tok, src, tea, out, overwrite, report, save_adapter, options, plan)
    merged = load_quietly(out, progress).to(dev)
    tmodel.to(tdev or dev)
    if eval_texts:
        ap = perplexities(merged, tok, eval_texts, eval_tokens, progress)
        for t in eval_texts:
            ppl[t]["after"] = ap[t]
    if val_seqs is not None:
        report.heldout_kl_before = kl_before
        report.heldout_kl_after = mean_kl(merged, tmodel, val_seqs, temperature=options.temperature)
    report.perplexity = ppl
    report.seconds = time.perf_counter() - t_start
    write_heal_card(out, report, tok)
    if not keep_run_dir:
        shutil.rmtree(run, ignore_errors=True)
    return report
