"""Pretrain a causal language model from scratch on local text: T6 (Tensor Product Attention), Llama with
multi-head (MHA) or grouped-query attention (GQA), or MLA (transformers' DeepSeek-V3 attention, MoE off).

In the style of transformers' ``run_clm.py``, offline: text files or JSONL (``"text"`` field) are split
into training and validation by document, tokenised (SmolLM2's tokenizer by default) and packed into
fixed-length sequences. ``--params`` is the size without embeddings; the four architectures come out
equal at that size (same depth, width and FFN; the heads are chosen as in the TPA paper, see
``hf_symmetry.training.tpa_paper_configs``). Training is hf_symmetry's shared Trainer setup (the one
``hf-symmetry heal`` uses): AdamW, cosine schedule with warmup, clipping, a progress bar, held-out loss
every ``--eval-steps``, checkpoints every ``--save-steps`` and ``--resume``.

    python examples/train_clm.py --arch t6 --params 20M --text a.txt --text b.jsonl --max-steps 2000 --out t6-20m
    python examples/train_clm.py --arch gqa --params 20M --text a.txt --max-steps 2000 --out gqa-20m --resume
    torchrun --nproc_per_node 4 examples/train_clm.py --arch mla ...   # or: accelerate launch examples/train_clm.py

``--batch-size`` is the global batch (sequences per optimizer step), whatever the number of processes.
``OUT`` receives the model, tokenizer and ``train_results.json`` (loss curve, perplexity, KV-cache size,
tokens/s); checkpoints go to ``OUT/checkpoints``. A T6 folder carries its modeling code and loads with
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` where hf_symmetry is not installed;
MHA/GQA/MLA folders are stock transformers families (Llama or Mistral, DeepSeek-V3).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ARCH_HELP = {
    "t6": "T6 / Tensor Product Attention (R_Q=6, R_K=R_V=2)",
    "mha": "Llama, multi-head attention",
    "gqa": "Llama, grouped-query attention (2 KV heads)",
    "mla": "DeepSeek-V3 multi-head latent attention",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train_clm.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--arch", required=True, choices=list(ARCH_HELP), help="; ".join(f"{k}: {v}" for k, v in ARCH_HELP.items())
    )
    p.add_argument("--params", default="20M", help="size without embeddings, e.g. 5M, 20M, 124M (default 20M)")
    p.add_argument(
        "--text",
        action="append",
        required=True,
        metavar="FILE",
        help="training text: a UTF-8 text file (documents separated by blank lines) or JSONL with a "
        "'text' field; repeat for several files",
    )
    p.add_argument("--max-steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", required=True, help="output folder (model, tokenizer, train_results.json, checkpoints/)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2-135M's, offline)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch in sequences per step (default 16)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4, the paper's small models)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default 5%% of --max-steps)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (default 1.0; 0: off)")
    p.add_argument("--eval-steps", type=int, default=None, help="held-out loss every N steps (default: at the end)")
    p.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (default: no checkpoints)")
    p.add_argument("--save-total-limit", type=int, default=2, help="checkpoints kept (default 2)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/checkpoints")
    p.add_argument(
        "--validation-fraction",
        type=float,
        default=0.05,
        help="fraction of documents held out for validation (default 0.05)",
    )
    p.add_argument("--max-train-tokens", type=int, default=None, help="cap on packed training tokens")
    p.add_argument("--max-validation-tokens", type=int, default=None, help="cap on packed validation tokens")
    p.add_argument("--hidden-size", type=int, default=None, help="override the derived width (multiple of 64)")
    p.add_argument("--layers", type=int, default=None, help="override the derived depth")
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="attention kernel for the materialised path (default sdpa)",
    )
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations (less memory)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    p.add_argument("--seed", type=int, default=0, help="initialisation, data split and order (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def fail(msg):
        p.exit(2, f"{p.prog}: error: {msg}\n")

    for f in args.text:
        if not Path(f).is_file():
            fail(f"--text {f}: no such file")
    for name in ("max_steps", "seq_len", "batch_size", "grad_accum"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.validation_fraction < 1.0:
        fail("--validation-fraction must be in [0, 1)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        fail(f"--out {out} exists and is not a folder")
    from hf_symmetry.training import is_main_process

    # only the main process judges OUT: the others may start after it has begun writing there
    if is_main_process() and out.is_dir() and any(out.iterdir()) and not args.resume:
        fail(f"--out {out} is not empty; pass --resume to continue its run or choose another folder")
    from hf_symmetry.training.tpa_paper_configs import parse_parameter_count

    try:
        args.params_count = parse_parameter_count(args.params)
    except ValueError as e:
        fail(f"--params: {e}")
    from hf_symmetry.training import per_device_batch

    try:
        args.per_device = per_device_batch(args.batch_size, args.grad_accum)
    except ValueError as e:
        fail(f"--batch-size: {e}")
    return args


def main(argv=None, callbacks=()) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from hf_symmetry.training import TrainSettings, build_datasets, is_main_process, train, world_size
    from hf_symmetry.training.tpa_paper_configs import build_model, equal_size_configs, kv_cache_elements

    def fail(msg):
        print(f"train_clm.py: error: {msg}", file=sys.stderr)
        return 2

    if args.tokenizer is None:
        from hf_symmetry.assets import smollm2_dir

        args.tokenizer = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        plan = equal_size_configs(
            args.params_count,
            len(tok),
            hidden_size=args.hidden_size,
            num_hidden_layers=args.layers,
            max_position_embeddings=max(2048, args.seq_len),
            **ids,
        )
        data = build_datasets(
            tok,
            args.text,
            seq_len=args.seq_len,
            validation_fraction=args.validation_fraction,
            max_train_tokens=args.max_train_tokens,
            max_validation_tokens=args.max_validation_tokens,
            seed=args.seed,
        )
    except ValueError as e:
        return fail(str(e).splitlines()[0])
    if data.validation is not None and len(data.validation) < args.per_device * world_size():
        return fail(
            f"the validation split has {len(data.validation)} sequence(s) of {args.seq_len} tokens, fewer than "
            f"one evaluation batch ({args.per_device} per process); raise --validation-fraction, add text "
            f"or pass --validation-fraction 0"
        )
    config = plan.configs[args.arch]
    if is_main_process():
        print(plan.table())
        print(
            f"training {args.arch}: {plan.parameters[args.arch] / 1e6:.3f} M parameters without embeddings; "
            f"data {data.as_dict()}; {world_size()} process(es)"
        )

    torch.manual_seed(args.seed)
    model = build_model(config, attn_implementation=args.attn_implementation)
    out = Path(args.out)
    settings = TrainSettings(
        output_dir=str(out / "checkpoints"),
        max_steps=args.max_steps,
        per_device_batch_size=args.per_device,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        eval_steps=args.eval_steps,
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        logging_steps=max(1, min(10, args.max_steps // 10)),
        seed=args.seed,
        use_cpu=args.cpu,
        resume=args.resume,
        progress=not args.quiet,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    outcome = train(model, data.train, data.validation, settings, callbacks=callbacks)

    if is_main_process():
        model = outcome.model
        model.save_pretrained(out)
        tok.save_pretrained(out)
        by_step = {h["step"]: h["eval_loss"] for h in outcome.log_history if "eval_loss" in h}  # the final
        curve = [{"step": k, "eval_loss": v} for k, v in sorted(by_step.items())]  # evaluation may repeat a step
        train_curve = [{"step": h["step"], "loss": h["loss"]} for h in outcome.log_history if "loss" in h]
        dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
        kv = kv_cache_elements(config)
        results = dict(
            arch=args.arch,
            model_type=config.model_type,
            architectures=[type(model).__name__],
            hidden_size=plan.hidden_size,
            num_hidden_layers=plan.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            parameters_without_embeddings=plan.parameters[args.arch],
            parameters_by_arch=plan.parameters,
            kv_cache_elements_per_token=kv,
            kv_cache_bytes_per_token=kv * dtype_bytes,
            kv_cache_dtype=str(next(model.parameters()).dtype),
            data=data.as_dict(),
            processes=world_size(),
            global_batch=args.batch_size,
            seq_len=args.seq_len,
            max_steps=args.max_steps,
            learning_rate=args.lr,
            seed=args.seed,
            global_step=outcome.global_step,
            train_tokens=outcome.train_tokens,
            tokens_per_second=outcome.tokens_per_second,
            seconds=outcome.seconds,
            train_loss=outcome.train_loss,
            eval_loss=outcome.eval_loss,
            eval_perplexity=None if outcome.eval_loss is None else math.exp(outcome.eval_loss),
            eval_curve=curve,
            train_curve=train_curve,
            resumed_from=outcome.resumed_from,
        )
        (out / "train_results.json").write_text(json.dumps(results, indent=1))
        ppl = (
            "n/a"
            if outcome.eval_loss is None
            else f"{outcome.eval_loss:.4f} (perplexity {math.exp(outcome.eval_loss):.1f})"
        )
        print(
            f"{args.arch}: {outcome.global_step} steps, {outcome.train_tokens} tokens, "
            f"{outcome.tokens_per_second:.0f} tokens/s; held-out loss {ppl}; KV cache {kv} elements/token; "
            f"saved {out}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
