"""Benchmark: healing SmolLM2's lossy conversions by distillation (``hf-symmetry heal``), CPU.

Each converted model (and, as the control, the dense SmolLM2 itself) is trained by the same recipe
on the same tokens of ``--text`` (LoRA on every projection, KL to the dense SmolLM2 teacher), and its
held-out perplexity is measured on two texts — one from the training source (britannica-eval, the
half of the article not trained on) and one from another source (hamlet) — before training and
every ``--eval-every`` steps. The dense control separates domain adaptation from recovery.

    python benchmarks/bench_heal.py --model slice25=/tmp/heal/conv/slice25 --model tpa22=... \\
        --model dense=smollm2 --tokens 16384 --seq-len 128

Outputs: ``benchmarks/results/heal.json`` (curves, tokens/s, settings, machine) and
``docs/img/heal_perplexity.png``. Results of earlier invocations in the JSON are kept (merged by model
name), so models can be run one at a time and plotted together.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "heal.json"
PLOT = ROOT / "docs" / "img" / "heal_perplexity.png"


def eval_ids(tok, texts, tokens):
    from hf_symmetry.assets import resolve_text
    from hf_symmetry.evaluation.perplexity import read_text, tokenize_text

    return {t: tokenize_text(tok, read_text(resolve_text(t)), max_tokens=tokens) for t in texts}


def make_callback(ids_by_text, every, global_tokens_per_step, window, record):
    from transformers import TrainerCallback

    from hf_symmetry.evaluation.perplexity import perplexity

    def measure(model, step):
        was = model.training
        model.eval()
        row = {"step": step, "tokens": step * global_tokens_per_step}
        for t, ids in ids_by_text.items():
            row[t] = perplexity(model, ids, window=window, stride=window // 2, progress=False).perplexity
        record.append(row)
        print(f"  step {step}: " + ", ".join(f"{t} {row[t]:.2f}" for t in ids_by_text), flush=True)
        model.train(was)

    class Curve(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            measure(model, state.global_step)

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                measure(model, state.global_step)

    return Curve()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="NAME=FOLDER")
    p.add_argument("--results", default=str(RESULTS), help="JSON to write (merged with its earlier content)")
    p.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                   help="only merge these result files into --results and plot")
    p.add_argument("--teacher", default="smollm2")
    p.add_argument("--text", default="britannica-calib")
    p.add_argument("--eval-text", action="append", default=None)
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lm-weight", type=float, default=0.5,
                   help="LM-loss share of the objective (default 0.5: with pure KD the dense control, which is "
                        "its own teacher, would not move; with LM loss it adapts to the domain like the others)")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--work", default="/tmp/heal/bench")
    p.add_argument("--heldout-seqs", type=int, default=8, help="held-out sequences for the KL figure")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = args.eval_text or ["britannica-eval", "hamlet"]
    results_path = Path(args.results)
    if args.merge is not None:
        merged = json.loads(results_path.read_text()) if results_path.is_file() else {"models": {}}
        for f in args.merge:
            part = json.loads(Path(f).read_text())
            merged["models"].update(part["models"])
            for k in ("teacher", "settings", "machine"):
                merged.setdefault(k, part.get(k))
        results_path.write_text(json.dumps(merged, indent=2) + "\n")
        plot(merged)
        return 0

    from hf_symmetry.assets import resolve_model
    from hf_symmetry.conversion.heal import HealOptions, heal_checkpoint
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer
    from hf_symmetry.evaluation.perplexity import perplexity

    tok = load_tokenizer(resolve_model(args.teacher))
    ids = eval_ids(tok, texts, args.eval_tokens)
    window = min(args.seq_len * 2, 512)
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"models": {}}
    if "teacher" not in results:
        teacher = load_model(resolve_model(args.teacher))
        results["teacher"] = {t: perplexity(teacher, i, window=window, stride=window // 2, progress=False).perplexity
                              for t, i in ids.items()}
        del teacher
    for spec in args.model:
        name, folder = spec.split("=", 1)
        out = Path(args.work) / name
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_name(out.name + ".heal-run"), ignore_errors=True)
        options = HealOptions(tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                              grad_accum=args.grad_accum, lora_rank=args.lora_rank, lr=args.lr, lm_weight=args.lm_weight,
                              validation_fraction=0.05)
        curve: list[dict] = []
        cb = make_callback(ids, args.eval_every, args.batch_size * args.seq_len, window, curve)
        print(f"{name}: healing {folder} ({options.steps()} steps)", flush=True)
        t0 = time.perf_counter()
        r = heal_checkpoint(folder, out, args.teacher, [args.text], options, progress=False, device="cpu",
                            eval_texts=None, heldout_kl_sequences=args.heldout_seqs, callbacks=[cb])
        results["models"][name] = {
            "source": Path(folder).name, "model_type": r.model_type, "curve": curve,
            "tokens_per_second": r.tokens_per_second, "train_seconds": r.train_tokens / max(r.tokens_per_second, 1e-9),
            "wall_seconds": time.perf_counter() - t0, "train_tokens": r.train_tokens,
            "heldout_kl_before": r.heldout_kl_before, "heldout_kl_after": r.heldout_kl_after,
            "trainable_params": r.trainable_params}
        results["settings"] = {**{k: v for k, v in vars(args).items() if k not in ("model",)}, "window": window,
                               "eval_texts": texts}
        results["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "torch": torch.__version__, "threads": args.threads,
                              "date": time.strftime("%Y-%m-%d", time.gmtime()),
                              "note": "2-core CPU VM shared with other jobs; no GPU"}
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"{name}: {r.tokens_per_second:.1f} tokens/s; KL {r.heldout_kl_before:.4f} -> {r.heldout_kl_after:.4f}",
              flush=True)
    if results_path.resolve() == RESULTS.resolve():
        plot(results)
    return 0


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = results["settings"]["eval_texts"]
    fig, axes = plt.subplots(1, len(texts), figsize=(5.5 * len(texts), 4.2))
    for ax, text in zip(axes, texts):
        for name, m in results["models"].items():
            xs = [row["tokens"] for row in m["curve"]]
            ax.plot(xs, [row[text] for row in m["curve"]], marker="o", label=name)
        ax.axhline(results["teacher"][text], color="k", ls="--", lw=1, label="dense SmolLM2 (teacher)")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("perplexity")
        ax.set_title(f"held-out: {text}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("hf-symmetry heal on SmolLM2-135M (distillation, LoRA, CPU)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
