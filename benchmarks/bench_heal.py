"""Benchmark: healing SmolLM2's lossy conversions by distillation (``hf-symmetry heal``), CPU.

Each converted model (and, as the control, the dense SmolLM2 itself) is trained by the same recipe
on the same tokens of ``--text`` (LoRA on every projection, KL to the dense SmolLM2 teacher mixed with
the LM loss), and its held-out perplexity is measured with the project's definition (first
``--eval-tokens`` tokens, window 512, stride 256) on two texts — one from the training source
(britannica-eval, the half of the article not trained on) and one from another source (hamlet) —
before training and at the steps of ``--eval-at``. The dense control separates domain adaptation
from recovery. Training throughput is measured in process CPU seconds and wall seconds of the
training steps alone (the perplexity evaluations inside the run are subtracted).

    python benchmarks/bench_heal.py --model dense=smollm2 --tokens 16384 --eval-at 0,8,16,32
    python benchmarks/bench_heal.py --model slice25=/tmp/heal/conv/slice25 ...   # one model per process
    python benchmarks/bench_heal.py --table            # markdown table (ratios to the fine-tuned dense model)

Outputs: ``benchmarks/results/heal.json`` (curves, throughput, settings, machine) and
``docs/img/heal_perplexity.png``. Results of earlier invocations in the JSON are kept (merged by model
name), so models can be run one at a time and plotted together.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "heal.json"
PLOT = ROOT / "docs" / "img" / "heal_perplexity.png"
GOALS = {"compressed": 1.5, "tpa": 1.2}


def eval_ids(tok, texts, tokens):
    from hf_symmetry.assets import resolve_text
    from hf_symmetry.evaluation.perplexity import read_text, tokenize_text

    return {t: tokenize_text(tok, read_text(resolve_text(t)), max_tokens=tokens) for t in texts}


class Clock:
    """Process CPU and wall seconds of the training alone: evaluation time is booked apart."""

    def __init__(self):
        self.cpu0 = self.wall0 = None
        self.eval_cpu = self.eval_wall = 0.0
        self.cpu = self.wall = None

    def start(self):
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def stop(self):
        self.cpu = time.process_time() - self.cpu0 - self.eval_cpu
        self.wall = time.perf_counter() - self.wall0 - self.eval_wall


def make_callback(ids_by_text, eval_at, every, global_tokens_per_step, record, clock):
    from transformers import TrainerCallback

    from hf_symmetry.evaluation.perplexity import perplexity

    def measure(model, step):
        c0, w0 = time.process_time(), time.perf_counter()
        was = model.training
        model.eval()
        row = {"step": step, "tokens": step * global_tokens_per_step}
        for t, ids in ids_by_text.items():
            row[t] = perplexity(model, ids, progress=False).perplexity
        record.append(row)
        print(f"  step {step}: " + ", ".join(f"{t} {row[t]:.2f}" for t in ids_by_text), flush=True)
        model.train(was)
        clock.eval_cpu += time.process_time() - c0
        clock.eval_wall += time.perf_counter() - w0

    def due(step, last):
        return step in eval_at if eval_at else (step % every == 0 or step == last)

    class Curve(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            clock.start()
            if due(state.global_step, state.max_steps) or state.global_step == 0:
                measure(model, state.global_step)

        def on_step_end(self, args, state, control, model=None, **kw):
            if due(state.global_step, state.max_steps) or state.global_step == state.max_steps:
                measure(model, state.global_step)

        def on_train_end(self, args, state, control, **kw):
            clock.stop()

    return Curve()


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "note": "2-core CPU VM shared with other jobs; no GPU lent"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="NAME=FOLDER")
    p.add_argument("--results", default=str(RESULTS), help="JSON to write (merged with its earlier content)")
    p.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                   help="only merge these result files into --results and plot")
    p.add_argument("--table", action="store_true", help="only print the markdown table of --results and plot")
    p.add_argument("--teacher", default="smollm2")
    p.add_argument("--text", action="append", default=None, help="training text(s) (default: britannica-calib)")
    p.add_argument("--eval-text", action="append", default=None)
    p.add_argument("--eval-tokens", type=int, default=2048, help="tokens of each held-out text (project PPL: 2048)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lm-weight", type=float, default=0.5,
                   help="LM-loss share of the objective (default 0.5: with pure KD the dense control, which is "
                        "its own teacher, would not move; with LM loss it adapts to the domain like the others)")
    p.add_argument("--eval-at", default=None, help="comma-separated steps at which to measure perplexity "
                                                   "(default: every --eval-every steps)")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--work", default="/tmp/heal/bench")
    p.add_argument("--heldout-seqs", type=int, default=8, help="held-out sequences for the KL figure")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = args.eval_text or ["britannica-eval", "hamlet"]
    train_texts = args.text or ["britannica-calib"]
    eval_at = sorted({int(s) for s in args.eval_at.split(",")}) if args.eval_at else None
    results_path = Path(args.results)
    if args.table:
        results = json.loads(results_path.read_text())
        print(table(results))
        plot(results)
        return 0
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
    from hf_symmetry.evaluation.perplexity import PPL, perplexity

    teacher_dir = resolve_model(args.teacher)
    tok = load_tokenizer(teacher_dir)
    ids = eval_ids(tok, texts, args.eval_tokens)
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"models": {}}
    for spec in args.model:
        name, folder = spec.split("=", 1)
        is_teacher = Path(resolve_model(folder)).resolve() == Path(teacher_dir).resolve()
        if "teacher" not in results and not is_teacher:
            teacher = load_model(teacher_dir)
            results["teacher"] = {t: perplexity(teacher, i, progress=False).perplexity for t, i in ids.items()}
            del teacher
        out = Path(args.work) / name
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_name(out.name + ".heal-run"), ignore_errors=True)
        options = HealOptions(tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                              grad_accum=args.grad_accum, lora_rank=args.lora_rank, lr=args.lr, lm_weight=args.lm_weight,
                              validation_fraction=0.05)
        curve: list[dict] = []
        clock = Clock()
        cb = make_callback(ids, eval_at, args.eval_every, args.batch_size * args.seq_len, curve, clock)
        print(f"{name}: healing {folder} ({options.steps()} steps of {args.batch_size}x{args.seq_len})", flush=True)
        t0, c0 = time.perf_counter(), time.process_time()
        r = heal_checkpoint(folder, out, args.teacher, train_texts, options, progress=False, device="cpu",
                            eval_texts=None, heldout_kl_sequences=args.heldout_seqs, callbacks=[cb])
        if is_teacher:
            results["teacher"] = {t: curve[0][t] for t in texts}
        params = sum(p.numel() for p in load_model(out).parameters())
        results["models"][name] = {
            "source": Path(folder).name, "model_type": r.model_type, "curve": curve, "parameters": params,
            "learning_rate": options.learning_rate, "train_tokens": r.train_tokens, "steps": r.steps,
            "train_cpu_seconds": clock.cpu, "train_wall_seconds": clock.wall,
            "tokens_per_cpu_second": r.train_tokens / clock.cpu, "tokens_per_wall_second": r.train_tokens / clock.wall,
            "eval_cpu_seconds": clock.eval_cpu, "process_cpu_seconds": time.process_time() - c0,
            "wall_seconds": time.perf_counter() - t0,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "load_average": os.getloadavg(),
            "heldout_kl_before": r.heldout_kl_before, "heldout_kl_after": r.heldout_kl_after,
            "trainable_params": r.trainable_params}
        results["settings"] = {**{k: v for k, v in vars(args).items() if k not in ("model", "lr", "merge", "table")},
                               "text": train_texts, "eval_texts": texts, "window": PPL.window, "stride": PPL.stride}
        results["machine"] = {**machine(), "threads": args.threads}
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        m = results["models"][name]
        print(f"{name}: {m['tokens_per_cpu_second']:.1f} tokens/CPU-s, {m['tokens_per_wall_second']:.1f} tokens/s wall;"
              f" KL {r.heldout_kl_before:.4f} -> {r.heldout_kl_after:.4f}", flush=True)
    if results_path.resolve() == RESULTS.resolve():
        plot(results)
    return 0


def ratios(results: dict, name: str, control: str = "dense") -> dict:
    """Perplexity ratio to the fine-tuned control at each shared evaluation point, per text."""
    texts = results["settings"]["eval_texts"]
    ctrl = {row["tokens"]: row for row in results["models"][control]["curve"]}
    out = {}
    for text in texts:
        out[text] = [(row["tokens"], row[text] / ctrl[row["tokens"]][text])
                     for row in results["models"][name]["curve"] if row["tokens"] in ctrl]
    return out


def log_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(ratio) against log(tokens) over the points after step 0."""
    xs = [math.log(t) for t, _ in points if t > 0]
    ys = [math.log(r) for t, r in points if t > 0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def tokens_to_goal(points: list[tuple[int, float]], goal: float) -> float | None:
    """Tokens at which the ratio would reach ``goal`` if it kept following the power law fitted to the
    points after step 0 (:func:`log_slope`), from the last point on; ``None`` if it is not falling."""
    t_last, r_last = points[-1]
    if r_last <= goal:
        return float(t_last)
    slope = log_slope(points)
    if slope >= 0:
        return None
    return t_last * (goal / r_last) ** (1 / slope)


def table(results: dict) -> str:
    texts = results["settings"]["eval_texts"]
    head = ("| model | parameters | lr | tokens/CPU-s | " + " | ".join(f"{t} before → after" for t in texts)
            + " | " + " | ".join(f"× fine-tuned dense ({t})" for t in texts) + " |")
    lines = [head, "|" + "---|" * (4 + 2 * len(texts))]
    for name, m in results["models"].items():
        first, last = m["curve"][0], m["curve"][-1]
        cells = [name, f"{m['parameters'] / 1e6:.1f} M", f"{m['learning_rate']:g}", f"{m['tokens_per_cpu_second']:.0f}"]
        cells += [f"{first[t]:.1f} → {last[t]:.1f}" for t in texts]
        if "dense" in results["models"] and name != "dense":
            rs = ratios(results, name)
            cells += [f"{rs[t][0][1]:.2f} → {rs[t][-1][1]:.2f}" for t in texts]
        else:
            cells += ["1"] * len(texts)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Ratio change per doubling of the tokens (power law fitted to the points after step 0), and the "
                 "tokens at which the goal would be reached if that rate held:")
    for name in results["models"]:
        if name == "dense" or "dense" not in results["models"]:
            continue
        goal = GOALS["tpa"] if name.startswith("tpa") else GOALS["compressed"]
        rs = ratios(results, name)
        parts = []
        for t in texts:
            pts = rs[t]
            per_doubling = 2 ** log_slope(pts)
            need = tokens_to_goal(pts, goal)
            parts.append(f"{t}: ×{per_doubling:.3f} per doubling, goal {goal}× at "
                         + ("never at this rate" if need is None else
                            "no usable trend (> 1e9 tokens)" if need > 1e9 else f"≈{need:.1e} tokens"))
        lines.append(f"- {name}: " + "; ".join(parts))
    return "\n".join(lines)


LABELS = {"dense": "dense (fine-tuned control)", "slice25": "SliceGPT 25 %", "tpa22": "TPA k/v rank 2",
          "lowrank_seq": "low rank 25 %, --sequential", "farr08": "FaRR 0.8 of V/O"}


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = results["settings"]["eval_texts"]
    fig, axes = plt.subplots(1, len(texts) + 1, figsize=(5.2 * (len(texts) + 1), 4.6))
    colors = {name: f"C{i}" for i, name in enumerate(n for n in results["models"] if n != "dense")}
    colors["dense"] = "k"

    def label(name, m):
        return LABELS.get(name, name) + (f" (lr {m['learning_rate']:g})" if m["learning_rate"] != 1e-3 else "")

    for ax, text in zip(axes, texts):
        for name, m in results["models"].items():
            xs = [row["tokens"] for row in m["curve"]]
            ax.plot(xs, [row[text] for row in m["curve"]], marker="o", color=colors[name], label=label(name, m))
        if "teacher" in results:
            ax.axhline(results["teacher"][text], color="k", ls="--", lw=1, label="dense SmolLM2 (teacher)")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("perplexity (2048 tokens, window 512, stride 256)")
        ax.set_title(f"held-out: {text}")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    if "dense" in results["models"]:
        for name in results["models"]:
            if name == "dense":
                continue
            rs = ratios(results, name)
            for text, ls in zip(texts, ("-", "--", ":")):
                ax.plot([t for t, _ in rs[text]], [r for _, r in rs[text]], ls=ls, marker="o", color=colors[name],
                        label=f"{LABELS.get(name, name)}: {text}")
        for goal, what in ((GOALS["compressed"], "goal, compressed"), (GOALS["tpa"], "goal, TPA")):
            ax.axhline(goal, color="gray", lw=1, ls="-." if goal == GOALS["tpa"] else "--")
            ax.text(0, goal * 1.02, f"{goal}× ({what})", fontsize=7, color="gray")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("perplexity ÷ fine-tuned dense at the same tokens")
        ax.set_title("ratio to the fine-tuned dense model")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5)
    mach = results.get("machine", {})
    fig.suptitle(f"hf-symmetry heal on SmolLM2-135M (distillation + LM, LoRA 16, CPU, {mach.get('date', '')})")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
