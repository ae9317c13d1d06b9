"""Benchmark: one distillation step of ``hf-symmetry heal`` with the logits in chunks or all at once (issue 28).

The student (default: SmolLM2 SliceGPT 25 % from ``bench_heal.py``'s work folder, LoRA 16 as heal applies it)
and the dense SmolLM2 teacher run ``--steps`` forward+backward passes of
:class:`hf_symmetry.training.distill.DistillationLoss` on ``--batch`` × ``--seq-len`` tokens of the training
plays, once per setting of ``--chunks`` (``0``: the unchunked path), each setting in a fresh process so that
its peak resident memory is its own. Reported per setting: training tokens per wall and per CPU second
(after one warm-up step), peak RSS, peak CUDA memory on a GPU, and the loss (equal across settings).

    python benchmarks/bench_heal_loss.py --device cpu --batch 8 --seq-len 512 --chunks 0,2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def one(args) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_heal import training_plays

    from hf_symmetry.assets import resolve_model
    from hf_symmetry.devices import parse_device
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer
    from hf_symmetry.training.data import build_datasets
    from hf_symmetry.training.distill import DistillationLoss
    from hf_symmetry.training.peft_targets import apply_lora, lora_plan

    torch.manual_seed(0)
    dev = parse_device(args.device).device
    student_dir, teacher_dir = resolve_model(args.student), resolve_model("smollm2")
    tok = load_tokenizer(teacher_dir)
    data = build_datasets(tok, training_plays(), args.seq_len, 0.05, max_train_tokens=args.batch * args.seq_len * 2)
    ids = data.train.sequences[: args.batch].to(dev)
    student = load_model(student_dir, dtype=torch.float32)
    model = apply_lora(student, lora_plan(student, 16)).to(dev).train()
    teacher = load_model(teacher_dir, dtype=torch.float32).to(dev)
    loss_fn = DistillationLoss(teacher, 1.0, args.lm_weight, chunk_tokens=args.chunk or None)
    cuda = dev.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    losses, walls, cpus = [], [], []
    for step in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.reset_peak_memory_stats()
        w0, c0 = time.perf_counter(), time.process_time()
        with amp:
            loss, _ = loss_fn(model, {"input_ids": ids})
        loss.backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:  # step 0: warm-up (and the one-off plain-head check)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        losses.append(float(loss))
    n = args.batch * args.seq_len * args.steps
    out = {
        "chunk_tokens": args.chunk,
        "tokens_per_step": args.batch * args.seq_len,
        "steps": args.steps,
        "tokens_per_wall_second": n / sum(walls),
        "tokens_per_cpu_second": n / sum(cpus),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": losses[-1],
        "device": str(dev),
        "threads": torch.get_num_threads(),
    }
    if cuda:
        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default="/tmp/heal/bench/conv/slice25", help="student folder (bench_heal.py's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--lm-weight", type=float, default=0.5)
    p.add_argument("--chunks", default="0,2048", help="chunk sizes to compare (0: unchunked)")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)  # one setting, in this process
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.chunk is not None:
        print(json.dumps(one(args)))
        return 0
    rows = []
    for c in [int(x) for x in args.chunks.split(",")]:
        cmd = [sys.executable, __file__, "--chunk", str(c)] + [a for a in (argv or sys.argv[1:])]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": " ".join(["python", "benchmarks/bench_heal_loss.py"] + (argv or sys.argv[1:])),
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
