"""What the benchmarks that run each configuration in a fresh process share (``bench_tpa_decode.py``,
``bench_compiled_decode.py``, ``bench_deploy.py``): the machine they ran on, the parent's side of a child run,
and the child's measuring instruments (the resident-set sampler, the per-token clock of ``generate``).

A benchmark script calls itself with ``--child JSON`` (one job); the child prints its record as the last
line of stdout that starts with ``{``. :func:`run_child` returns the job merged with that record and the
wall time, or with ``error`` (the end of stderr, or the timeout) when the child failed."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import transformers
from transformers import StoppingCriteria

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def machine(device: str = "cpu") -> dict:
    """CPU model, cores, torch and transformers versions, the device and the torch thread count
    (``OMP_NUM_THREADS``), and the GPU's name on CUDA."""
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


# ----------------------------------------------------------------------------------------------
# The child's instruments
# ----------------------------------------------------------------------------------------------
def trim() -> None:
    """Hand the C heap's free memory back to the system (glibc), so that the baseline holds no free memory left
    over from loading (it would hide what ``generate`` allocates): measurement hygiene, not part of any model."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss() -> int:
    """This process's resident set, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Memory:
    """Peak memory above a baseline: resident set sampled by a thread (CPU) or CUDA's allocator peak."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak = 0
        self.running = not self.cuda
        if self.running:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.0005)

    def now(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else rss()

    def start(self) -> int:
        """Reset the peak; return the current level."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.peak = self.now()
        return self.peak

    def read(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return max(self.peak, rss())

    def stop(self):
        self.running = False


class Clock(StoppingCriteria):
    """A stopping criterion that never stops ``generate``: it stamps every generated token with the wall time,
    the calling thread's CPU time and ``memory``'s level (``sync`` first: a device's queued work), and restarts
    ``memory``'s peak after the first token (the decode peak starts there). ``start()`` just before ``generate``.

    With one torch thread on a CPU every operation runs on the calling thread, so its CPU time is the time the
    model computed, less what a shared machine's scheduler gave other processes (``cpu=True``)."""

    def __init__(self, memory: Memory, sync=lambda: None):
        self.memory, self.sync, self.stamps = memory, sync, []
        self.t0 = (time.perf_counter(), time.thread_time())

    def start(self) -> None:
        self.t0 = (time.perf_counter(), time.thread_time())

    def __call__(self, input_ids, scores, **kwargs):
        self.sync()
        self.stamps.append((time.perf_counter(), time.thread_time(), self.memory.read()))
        if len(self.stamps) == 1:
            self.memory.start()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def prefill_s(self, cpu: bool = False) -> float:
        """Seconds from ``start()`` to the first token."""
        return self.stamps[0][cpu] - self.t0[cpu]

    def decode_ms(self, cpu: bool = False) -> float:
        """Milliseconds per token after the first."""
        return 1000 * (self.stamps[-1][cpu] - self.stamps[0][cpu]) / (len(self.stamps) - 1)

    def prefill_peak(self, base: int) -> int:
        """Memory at the first token above ``base``."""
        return self.stamps[0][2] - base
