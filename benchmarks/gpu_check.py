"""The GPU check: the README's conversions and a short ``heal`` of SmolLM2, on CUDA and on the CPU with
the same flags, in one table (issue 28).

    HF_SYMMETRY_CACHE=/tmp/hfc python3 benchmarks/gpu_check.py --out results.json

For each job the same ``python -m hf_symmetry`` command runs twice, once with ``--device cpu`` and once
with ``--device cuda`` (``--cpu-device`` / ``--gpu-device`` change them; ``--gpu-device cpu`` smoke-tests
the script on a machine without a GPU), each in its own process, timed by the wall clock. The two output
folders are compared tensor by tensor (safetensors): the largest absolute difference and the largest
difference relative to the tensor's own largest magnitude, over all tensors the folders share.

Jobs (``--jobs``, comma-separated, default all):
  rotate   ``hf-symmetry rotate default OUT`` (the conversion is device-free; verification runs on the device)
  slice    ``hf-symmetry compress default OUT --structure slice --ratio 0.25``
  lowrank  ``hf-symmetry compress default OUT --structure lowrank --sequential``
  tpa      ``hf-symmetry to-tpa default OUT --k-rank 2 --v-rank 2``
  heal     ``hf-symmetry heal STUDENT OUT --teacher default`` (STUDENT: the CPU's slice output when that
           job ran, else SmolLM2 itself); CUDA trains with bf16 autocast, the CPU in float32, so its
           difference is a precision difference, not a defect

Nothing is downloaded: SmolLM2 and the texts come from the asset cache (``$HF_SYMMETRY_CACHE``,
:mod:`hf_symmetry.assets`), which must hold them already (or hold the registry packages they are
built from). The default budgets are small, so that both sides of every job fit in about five minutes
on one GPU machine; raise them with ``--calib-tokens``, ``--heal-tokens``, ``--verify-tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOBS = ("rotate", "slice", "lowrank", "tpa", "heal")


def job_args(job: str, out: Path, opts, student: str) -> list[str]:
    """The hf-symmetry arguments of ``job`` writing ``out`` (``--device`` is added per side)."""
    calib = ["--calib", opts.calib, "--calib-tokens", str(opts.calib_tokens)]
    verify = (
        ["--text", opts.text, "--tokens", str(opts.verify_tokens), "--ppl-tokens", str(opts.ppl_tokens)]
        if opts.verify_tokens
        else ["--no-verify"]
    )
    if job == "rotate":
        # the conversion streams on the host; with no verification the device would do nothing
        return [
            "rotate",
            "default",
            str(out),
            "--text",
            opts.text,
            "--tokens",
            str(max(opts.verify_tokens, 64)),
            "--ppl-tokens",
            str(opts.ppl_tokens),
        ]
    if job == "slice":
        return ["compress", "default", str(out), "--structure", "slice", "--ratio", "0.25", *calib, *verify]
    if job == "lowrank":
        return [
            "compress",
            "default",
            str(out),
            "--structure",
            "lowrank",
            "--sequential",
            "--ratio",
            "0.25",
            *calib,
            *opts.lowrank_args.split(),
            *verify,
        ]
    if job == "tpa":
        return ["to-tpa", "default", str(out), "--k-rank", "2", "--v-rank", "2", *calib, *verify]
    if job == "heal":
        return [
            "heal",
            student,
            str(out),
            "--teacher",
            "default",
            "--text",
            opts.calib,
            "--tokens",
            str(opts.heal_tokens),
            "--seq-len",
            str(opts.heal_seq_len),
            "--batch-size",
            str(opts.heal_batch),
            "--no-verify",
        ]
    raise ValueError(f"unknown job {job!r}: choose from {', '.join(JOBS)}")


def run_side(argv: list[str], device: str, log: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "hf_symmetry", *argv, "--device", device, "--overwrite", "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    wall = time.perf_counter() - t0
    log.write_text(" ".join(cmd) + "\n\n" + (out if isinstance(out, str) else out.decode(errors="replace")))
    tail = [line for line in str(out).strip().splitlines() if line.strip()][-1:] if rc else []
    return {"cmd": cmd, "rc": rc, "wall_s": round(wall, 2), "log": str(log), "error": tail[0] if tail else None}


def load_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def compare(a_dir: Path, b_dir: Path) -> dict:
    """Largest absolute and relative (to the tensor's max |value|) difference over shared tensors."""
    a, b = load_tensors(a_dir), load_tensors(b_dir)
    shared = sorted(set(a) & set(b))
    worst_abs, worst_rel, worst_key, shape_mismatch = 0.0, 0.0, None, []
    for k in shared:
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            shape_mismatch.append(k)
            continue
        if x.numel() == 0:
            continue
        d = (x - y).abs().max().item()
        rel = d / max(x.abs().max().item(), 1e-30)
        worst_abs = max(worst_abs, d)
        if rel > worst_rel:
            worst_rel, worst_key = rel, k
    return {
        "tensors_cpu": len(a),
        "tensors_gpu": len(b),
        "shared": len(shared),
        "max_abs_diff": worst_abs,
        "max_rel_diff": worst_rel,
        "worst_tensor": worst_key,
        "shape_mismatch": shape_mismatch[:5],
    }


def table(rows: list[dict], cpu: str, gpu: str) -> str:
    head = ("job", f"A {cpu} wall s", f"B {gpu} wall s", "A/B", "max |Δ|", "max |Δ|/max|x|", "tensors")
    lines = []
    for r in rows:
        c, g, d = r["cpu"], r["gpu"], r.get("diff") or {}
        fail = lambda s: f"rc {s['rc']}" if s["rc"] else f"{s['wall_s']:.1f}"  # noqa: E731
        ratio = f"{c['wall_s'] / g['wall_s']:.2f}" if not (c["rc"] or g["rc"]) and g["wall_s"] > 0 else "-"
        shared = (
            (
                f"{d['shared']}"
                + (
                    ""
                    if d["tensors_cpu"] == d["tensors_gpu"] == d["shared"]
                    else f" ({d['tensors_cpu']}/{d['tensors_gpu']})"
                )
            )
            if d
            else "-"
        )
        lines.append(
            (
                r["job"],
                fail(c),
                fail(g),
                ratio,
                f"{d['max_abs_diff']:.3g}" if d else "-",
                f"{d['max_rel_diff']:.3g}" if d else "-",
                shared,
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda row: "| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines)])


LINALG_SHAPES = ((64, 64), (192, 192), (576, 576), (1536, 576))


def time_linalg(devices: tuple[str, str], shapes=LINALG_SHAPES, batch: int = 1, repeat: int = 5) -> list[dict]:
    """Seconds (``a``: ``devices[0]``, ``b``: ``devices[1]``) per float64 ``eigh`` (of the Gram of each shape's
    columns), ``svd`` and ``qr`` of each shape
    (``batch`` > 1: one batched call over that many matrices) on both devices, median of ``repeat``: the
    small dense factorisations the compress solver makes by the thousand, to place by measurement."""
    import statistics

    import torch

    rows = []
    for m, n in shapes:
        g = torch.Generator().manual_seed(0)
        A = torch.randn(batch, m, n, generator=g, dtype=torch.float64)
        for kind, fn, make in (
            ("eigh", torch.linalg.eigh, lambda X: X.mT @ X),
            ("svd", lambda X: torch.linalg.svd(X, full_matrices=False), lambda X: X),
            ("qr", torch.linalg.qr, lambda X: X),
        ):
            row = {"kind": kind, "shape": f"{batch}x{m}x{n}" if batch > 1 else f"{m}x{n}"}
            for side, dev in zip(("a", "b"), devices):
                X = make(A.to(dev))
                fn(X)  # warm-up (library handles, kernels)
                times = []
                for _ in range(repeat):
                    if X.device.type == "cuda":
                        torch.cuda.synchronize(X.device)
                    t0 = time.perf_counter()
                    fn(X)
                    if X.device.type == "cuda":
                        torch.cuda.synchronize(X.device)
                    times.append(time.perf_counter() - t0)
                row[side] = statistics.median(times)
            rows.append(row)
    return rows


def linalg_table(rows: list[dict], devices: tuple[str, str]) -> str:
    a, b = devices
    out = [f"| factorisation (float64) | {a} ms | {b} ms | {a}/{b} |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['kind']} {r['shape']} | {1e3 * r['a']:.3f} | {1e3 * r['b']:.3f} | {r['a'] / r['b']:.2f} |")
    return "\n".join(out)


def environment(gpu: str) -> dict:
    import platform

    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if torch.cuda.is_available() and gpu.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(gpu) if ":" in gpu else None)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from {', '.join(JOBS)} (default: all)")
    p.add_argument("--cpu-device", default="cpu", help="the reference side's --device (default: cpu)")
    p.add_argument("--gpu-device", default="cuda", help="the other side's --device (default: cuda)")
    p.add_argument("--calib", default="britannica-calib", help="calibration (and heal training) text")
    p.add_argument("--text", default="britannica-eval", help="verification text (rotate; others with --verify-tokens)")
    p.add_argument(
        "--calib-tokens", type=int, default=2048, help="calibration tokens of compress/to-tpa (default 2048)"
    )
    p.add_argument("--lowrank-args", default="", help="extra flags of the lowrank job, e.g. '--w-iters 2'")
    p.add_argument(
        "--verify-tokens",
        type=int,
        default=0,
        help="logit tokens verified after compress/to-tpa (default 0: --no-verify; rotate always verifies, "
        "at least 64)",
    )
    p.add_argument("--ppl-tokens", type=int, default=0, help="perplexity tokens of the verification (default 0: skip)")
    p.add_argument("--heal-tokens", type=int, default=16384, help="heal's training tokens (default 16384)")
    p.add_argument("--heal-seq-len", type=int, default=256)
    p.add_argument("--heal-batch", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
    p.add_argument("--workdir", default=None, help="where outputs and logs go (default: a temporary folder, removed)")
    p.add_argument("--keep", action="store_true", help="keep the output folders")
    p.add_argument("--out", default=None, help="write the rows and the environment as JSON here")
    p.add_argument(
        "--linalg",
        action="store_true",
        help="also time float64 eigh/svd/qr of the solver's sizes on both devices (one call each, and "
        "batched by --linalg-batch), in a second table",
    )
    p.add_argument("--linalg-batch", type=int, default=9, help="batch of the batched timings (default 9: heads)")
    opts = p.parse_args(argv)
    jobs = [j.strip() for j in opts.jobs.split(",") if j.strip()]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        p.error(f"unknown job(s) {', '.join(bad)}: choose from {', '.join(JOBS)}")

    from hf_symmetry.assets import resolve_text, smollm2_dir  # nothing downloads: the cache must hold them

    model = smollm2_dir()
    for t in {opts.calib, opts.text}:
        resolve_text(t)
    own = opts.workdir is None
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"SmolLM2: {model}\nwork: {work}\njobs: {', '.join(jobs)}; {opts.cpu_device} vs {opts.gpu_device}", flush=True
    )
    rows = []
    student = "default"
    try:
        for job in jobs:
            row = {"job": job}
            for side, dev in (("cpu", opts.cpu_device), ("gpu", opts.gpu_device)):
                out = work / f"{job}-{side}"
                row[side] = run_side(job_args(job, out, opts, student), dev, work / f"{job}-{side}.log", opts.timeout)
                status = f"rc {row[side]['rc']}: {row[side]['error']}" if row[side]["rc"] else "ok"
                print(f"  {job} on {dev}: {row[side]['wall_s']:.1f} s, {status}", flush=True)
                if row[side]["rc"]:  # the log goes with a temporary work folder: show its end now
                    lines = [ln for ln in Path(row[side]["log"]).read_text(errors="replace").splitlines() if ln.strip()]
                    print("    " + "\n    ".join(lines[-15:]), flush=True)
            if not (row["cpu"]["rc"] or row["gpu"]["rc"]):
                row["diff"] = compare(work / f"{job}-cpu", work / f"{job}-gpu")
                if job == "slice":
                    student = str(work / "slice-cpu")
            rows.append(row)
        print()
        print(table(rows, opts.cpu_device, opts.gpu_device))
        linalg = None
        if opts.linalg:
            pair = (opts.cpu_device, opts.gpu_device)
            linalg = time_linalg(pair) + time_linalg(pair, batch=opts.linalg_batch)
            print()
            print(linalg_table(linalg, pair))
        if opts.out:
            Path(opts.out).write_text(
                json.dumps(
                    {
                        "environment": environment(opts.gpu_device),
                        "options": vars(opts),
                        "rows": rows,
                        "linalg": linalg,
                    },
                    indent=2,
                )
                + "\n"
            )
    finally:
        if own and not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif not opts.keep:
            for job in jobs:
                for side in ("cpu", "gpu"):
                    shutil.rmtree(work / f"{job}-{side}", ignore_errors=True)
    return 0 if all(not (r["cpu"]["rc"] or r["gpu"]["rc"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
