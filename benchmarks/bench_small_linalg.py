"""Time the solver's small dense factorisations (float64 symmetric eigendecomposition and SVD) on the CPU
(one thread, as the solver runs them) and, where CUDA is available, on the GPU: the measurements behind
``hf_symmetry.solvers.linalg.HOST_LINALG_MAX`` (which orders are decomposed on the host when their
matrix lives on an accelerator). Also a batch of 16 problems of each order in one batched call against
16 separate calls.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_small_linalg.py --out benchmarks/results/small_linalg.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from hf_symmetry.solvers.linalg import limit_threads, svd, symmetric_eigh

ORDERS = (32, 64, 128, 256, 576, 1024, 1536)


def _time(fn, repeat: int, sync=lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def run(device: str) -> list[dict]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in ORDERS:
        A = torch.randn(n, n, generator=gen, dtype=torch.float64)
        S = (A @ A.T).to(device)
        A = A.to(device)
        batch = torch.stack([S] * 16)
        repeat = 5 if n >= 1024 else 20
        with limit_threads(1):
            row = {
                "device": device,
                "n": n,
                "eigh_s": _time(lambda: symmetric_eigh(S), repeat, sync),
                "svd_s": _time(lambda: svd(A), repeat, sync),
            }
            if n <= 256:
                row["eigh_16_separate_s"] = _time(lambda: [torch.linalg.eigh(B) for B in batch], repeat, sync)
                row["eigh_16_batched_s"] = _time(lambda: torch.linalg.eigh(batch), repeat, sync)
        rows.append(row)
        print(json.dumps(row))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args(argv)
    rows = run("cpu")
    if torch.cuda.is_available():
        rows += run("cuda:0")
    result = {
        "title": "small float64 factorisations: CPU (one thread) and, where present, CUDA",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads "
        f"available, CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}",
        "date": datetime.date.today().isoformat(),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_small_linalg.py --out FILE",
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
