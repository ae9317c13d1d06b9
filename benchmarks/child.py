"""What the benchmarks that run each configuration in a fresh process share: the machine they ran on and
the parent's side of a child run (``bench_tpa_decode.py``, ``bench_compiled_decode.py``).

A benchmark script calls itself with ``--child JSON`` (one job); the child prints its record as the last
line of stdout that starts with ``{``. :func:`run_child` returns the job merged with that record and the
wall time, or with ``error`` (the end of stderr, or the timeout) when the child failed."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def machine(device: str = "cpu") -> dict:
    """CPU model, cores, torch and transformers versions, the device and the torch thread count
    (``OMP_NUM_THREADS``), and the GPU's name on CUDA."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    out = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def run_child(script: str, job: dict, timeout: int, env: dict | None = None) -> dict:
    """Run ``script --child JSON(job)`` in a fresh interpreter (the project and ``benchmarks/`` importable,
    ``env`` added to the environment) and return ``{**job, **record, "wall_s"}``, or ``{**job, "error",
    "wall_s"}`` when it failed or ran past ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), **(env or {})}
    t0 = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, script, "--child", json.dumps(job)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {**job, "error": f"timed out after {timeout} s", "wall_s": round(time.time() - t0, 1)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**job, "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": round(time.time() - t0, 1)}
    return {**job, **json.loads(lines[-1]), "wall_s": round(time.time() - t0, 1)}
