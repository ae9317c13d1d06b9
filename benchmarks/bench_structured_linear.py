"""Micro-benchmark of the structured linears (``hf_symmetry.modeling.structured_linear``) against a dense
``F.linear`` of the same shape, at SmolLM2-135M's shapes with every structure keeping 75% of the parameters
(``compress --ratio 0.25``: the sizes ``compress`` plans, from ``solvers.structures``' ``sized``).

Per structure, shape, token count and thread count: dense and structured milliseconds, measured in
interleaved rounds (dense, structured, dense, ...), and the median over rounds of the per-round ratio
dense / structured (> 1: the structure is faster). Float32, random factors, inference mode. ``kron (old)``
is the Kronecker forward before issue 47 (a permuted copy between its two matmuls), for comparison.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_structured_linear.py \
        --out benchmarks/results/structured_linear.json
    ... --threads 1 2 --tokens 1 8 256 512 --rounds 15 [--compile]

The machine is shared: read the ratios (interleaved, medians), not the absolute times; the load average
at the start and end is recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_symmetry.modeling.structured_linear import KroneckerLinear, structured_linear
from hf_symmetry.solvers import structures as st

#: SmolLM2-135M's decoder matrices ``(name, out, in, writer)``
SHAPES = [("q/o 576x576", 576, 576, False), ("k/v 192x576", 192, 576, False), ("gate/up 1536x576", 1536, 576, False)]
SHAPES += [("down 576x1536", 576, 1536, True)]
KEEP = 0.75


def specs(out: int, inp: int, writer: bool) -> dict[str, dict]:
    """The config entry ``compress`` plans for each structure at this shape (readers' Kronecker ``A`` is
    ``1 x q``, writers' ``q x 1``)."""
    q = st.Kron.plan_factor(576, KEEP, None)
    kron = (
        st.Kron.sized((inp, out), KEEP, factor=q).transpose() if writer else st.Kron.sized((out, inp), KEEP, factor=q)
    )
    return {
        "lowrank": st.LowRank.sized((out, inp), KEEP).entry(),
        "kron": kron.entry(),
        "gs": st.GS.sized((out, inp), KEEP).entry(),
    }


def old_kron_matmul(self: KroneckerLinear, x: torch.Tensor) -> torch.Tensor:
    """KroneckerLinear._matmul before issue 47 (both orders permute a copy between the matmuls)."""
    (m1, n1), (m2, n2), r, N = self.a_shape, self.b_shape, self.rank, x.shape[0]
    if self.a_first:
        u = F.linear(x.view(N, n1, n2).transpose(1, 2), self.kron_a.reshape(m1 * r, n1))
        u = u.view(N, n2, m1, r).permute(0, 2, 3, 1).reshape(N * m1, r * n2)
        return F.linear(u, self.kron_b.reshape(m2, r * n2)).view(N, m1 * m2)
    t = F.linear(x.view(N, n1, n2), self.kron_b.reshape(m2 * r, n2))
    t = t.view(N, n1, m2, r).permute(0, 2, 3, 1).reshape(N * m2, r * n1)
    y = F.linear(t, self.kron_a.reshape(m1, r * n1)).view(N, m2, m1)
    return y.transpose(1, 2).reshape(N, m1 * m2)


def _module(out: int, inp: int, spec: dict) -> torch.nn.Module:
    module = structured_linear(inp, out, spec)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.eval()


def _time(fn, x, inner: int) -> float:
    t = time.perf_counter()
    for _ in range(inner):
        fn(x)
    return (time.perf_counter() - t) / inner * 1e3


def measure(fn_dense, fn, x, rounds: int) -> dict:
    """Interleaved rounds; each round times both, about 20 ms each."""
    fn_dense(x), fn(x)  # warm-up (and compilation)
    once = max(_time(fn_dense, x, 1), 1e-3)
    inner = max(1, int(20 / once))
    dense, structured = [], []
    for _ in range(rounds):
        dense.append(_time(fn_dense, x, inner))
        structured.append(_time(fn, x, inner))
    return {
        "dense_ms": round(statistics.median(dense), 4),
        "structured_ms": round(statistics.median(structured), 4),
        "ratio": round(statistics.median(d / s for d, s in zip(dense, structured)), 3),
    }


def run(threads: list[int], tokens: list[int], rounds: int, compile_: bool) -> list[dict]:
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for shape, out, inp, writer in SHAPES:
            dense = torch.nn.Linear(inp, out, bias=False).eval()
            cases = dict(specs(out, inp, writer))
            cases["kron (old)"] = cases["kron"]
            for name, spec in cases.items():
                module = _module(out, inp, spec)
                fn = module if name != "kron (old)" else (lambda x, m=module: old_kron_matmul(m, x))
                fd = dense
                if compile_:
                    fn, fd = torch.compile(fn, dynamic=False), torch.compile(dense, dynamic=False)
                for n_tokens in tokens:
                    x = torch.randn(n_tokens, inp)
                    with torch.inference_mode():
                        row = measure(fd, fn, x, rounds)
                    row.update(threads=n_threads, shape=shape, structure=name, spec=spec, tokens=n_tokens)
                    row["compiled"] = compile_
                    rows.append(row)
                    print(
                        f"{n_threads}t {shape:18s} {name:11s} N={n_tokens:4d}: dense {row['dense_ms']:.3f} ms, "
                        f"structured {row['structured_ms']:.3f} ms, ratio {row['ratio']:.2f}",
                        flush=True,
                    )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 256, 512])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--compile", action="store_true", help="time torch.compile'd modules (both sides)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    rows = run(args.threads, args.tokens, args.rounds, args.compile)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
        "command": " ".join(
            ["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_structured_linear.py", *sys.argv[1:]]
        ),
        "torch": torch.__version__,
        "load_average_start": load_start,
        "load_average_end": Path("/proc/loadavg").read_text().split()[:3],
        "dtype": "float32",
        "keep": KEEP,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
