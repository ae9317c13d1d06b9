"""Micro-benchmark of the structured linears (``hf_symmetry.modeling.structured_linear``) against a dense
``F.linear`` of the same shape, at SmolLM2-135M's shapes with every structure keeping ``--keep`` of the parameters
(0.75: ``compress --ratio 0.25``; the sizes ``compress`` plans, from ``solvers.structures``' ``sized``), the token
embedding / tied head ``49152x576`` included (the compressed outputs structure it too; up to 512 tokens: a prefill
computes the head on its last token).

Per structure, shape, token count and thread count: dense and structured milliseconds, measured in
interleaved rounds (dense, structured, dense, ...), and the median over rounds of the per-round ratio
dense / structured (> 1: the structure is faster). Float32, random factors, inference mode. ``kron (old)``
is the Kronecker forward before issue 47 (a permuted copy between its two matmuls), ``gs (bmm)`` GS's one
token through its batched matmuls (its path before issue 47's one-token path), ``gs (batched)`` several tokens
through them (``GSLinear._batched``: the path before the accumulated one, and the one with several threads), for
comparison (``--structures`` picks the cases).

``--cold`` times each side over enough copies of the module to exceed the last-level cache (96 MB of dense
weights), so that every call reads its weights from memory, as decoding a whole model does; without it the
weights stay in cache and the figure is the per-call cost (eager only).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_structured_linear.py \
        --out benchmarks/results/structured_linear.json
    ... --threads 1 2 --tokens 1 8 512 4096 --rounds 15 [--keep 0.5] [--structures gs "gs (batched)"]
        [--compile | --cold]

The machine is shared: read the ratios (interleaved, medians), not the absolute times; the load average
at the start and end is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import platform
import shlex
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_symmetry.modeling.structured_linear import GSLinear, KroneckerLinear, structured_linear
from hf_symmetry.solvers import structures as st

#: SmolLM2-135M's matrices ``(name, out, in, role)``: a reader of the residual stream, a writer, the embedding
SHAPES = [("q/o 576x576", 576, 576, "reader"), ("k/v 192x576", 192, 576, "reader")]
SHAPES += [("gate/up 1536x576", 1536, 576, "reader"), ("down 576x1536", 576, 1536, "writer")]
SHAPES += [("embed/head 49152x576", 49152, 576, "embedding")]
COLD_BYTES = 96e6


def specs(out: int, inp: int, role: str, keep: float) -> dict[str, dict]:
    """The config entry ``compress`` plans for each structure at this shape (readers' Kronecker ``A`` is
    ``1 x q``, writers' ``q x 1``; an embedding's GS has one row block)."""
    q = st.Kron.plan_factor(576, keep, None)
    kron = (
        st.Kron.sized((inp, out), keep, factor=q).transpose()
        if role == "writer"
        else st.Kron.sized((out, inp), keep, factor=q)
    )
    return {
        "lowrank": st.LowRank.sized((out, inp), keep).entry(),
        "kron": kron.entry(),
        "gs": st.GS.sized((out, inp), keep, embedding=role == "embedding").entry(),
    }


def bmm_gs_forward(self: GSLinear, x: torch.Tensor) -> torch.Tensor:
    """GSLinear's batched-matmul path for any token count (one token's before issue 47's one-token path)."""
    kl, kr, b = self.kl, self.kr, self.rank
    xs = x.reshape(-1, kr, self.in_features // kr).transpose(0, 1)
    N = xs.shape[1]
    h = torch.bmm(xs, self.gs_right.mT).view(kr, N, kl, b).transpose(0, 2).reshape(kl, N, kr * b)
    return torch.bmm(h, self.gs_left.mT).transpose(0, 1).reshape(*x.shape[:-1], self.out_features)


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


#: the comparison forwards, by case name: (the structure whose module they run, the forward, the token counts
#: it runs at)
OLD = {
    "kron (old)": ("kron", old_kron_matmul, lambda n: True),
    "gs (bmm)": ("gs", bmm_gs_forward, lambda n: n == 1),  # GS's own path for several tokens is below
    "gs (batched)": ("gs", GSLinear._batched, lambda n: n > 1),  # one token: GS's one-token path
}
#: the largest token count timed at the embedding / head shape
EMBED_TOKENS = 512


def _sides(out: int, inp: int, name: str, spec: dict, copies: int, compile_: bool):
    """(dense, structured) callables; with several copies each call runs through all of them."""
    dense = [torch.nn.Linear(inp, out, bias=False).eval() for _ in range(copies)]
    modules = [_module(out, inp, spec) for _ in range(copies)]
    fns = [(lambda x, m=m: OLD[name][1](m, x)) if name in OLD else m for m in modules]
    if compile_:
        torch._dynamo.config.recompile_limit = 64  # one compilation per module and token count: none falls back
        return torch.compile(dense[0], dynamic=False), torch.compile(fns[0], dynamic=False)
    if copies == 1:
        return dense[0], fns[0]
    return (lambda x: [d(x) for d in dense]), (lambda x: [f(x) for f in fns])


def _timed(name: str, role: str, n_tokens: int) -> bool:
    """Whether a case runs at this token count (comparison forwards where they apply, the head to 512 tokens)."""
    return (name not in OLD or OLD[name][2](n_tokens)) and (role != "embedding" or n_tokens <= EMBED_TOKENS)


def run(threads: list[int], tokens: list[int], rounds: int, keep: float, cases_wanted, compile_: bool, cold: bool):
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for shape, out, inp, role in SHAPES:
            copies = max(1, math.ceil(COLD_BYTES / (out * inp * 4))) if cold else 1
            cases = dict(specs(out, inp, role, keep))
            cases.update({name: cases[kind] for name, (kind, _, _) in OLD.items()})
            for name, spec in cases.items():
                if cases_wanted and name not in cases_wanted:
                    continue
                fd, fn = _sides(out, inp, name, spec, copies, compile_)
                for n_tokens in tokens:
                    if not _timed(name, role, n_tokens):
                        continue
                    x = torch.randn(n_tokens, inp)
                    with torch.inference_mode():
                        row = measure(fd, fn, x, rounds)
                    row["dense_ms"], row["structured_ms"] = (
                        round(row[k] / copies, 4) for k in ("dense_ms", "structured_ms")
                    )
                    row.update(threads=n_threads, shape=shape, structure=name, spec=spec, tokens=n_tokens)
                    row.update(compiled=compile_, copies=copies, keep=keep)
                    rows.append(row)
                    print(
                        f"{n_threads}t {shape:20s} {name:11s} N={n_tokens:4d}: dense {row['dense_ms']:.3f} ms, "
                        f"structured {row['structured_ms']:.3f} ms, ratio {row['ratio']:.2f}",
                        flush=True,
                    )
    return rows


def ratio_table(rows: list[dict], keep: float) -> dict:
    """BENCHMARKS.md's table: one row per thread count, shape and case, the dense/structured ratio at each token
    count (the times are in ``rows``)."""
    tokens = sorted({r["tokens"] for r in rows})
    ratios: dict[tuple, dict] = {}
    for r in rows:
        ratios.setdefault((r["threads"], r["shape"], r["structure"]), {})[r["tokens"]] = r["ratio"]
    return {
        "name": "ratios",
        "caption": f"Dense / structured time (> 1: the structure is faster), {keep:.0%} of the parameters kept, "
        "median over interleaved rounds; milliseconds in the results file.",
        "columns": ["threads", "shape", "structure", *(f"{n} tokens" for n in tokens)],
        "rows": [[*key, *(by_n.get(n, "") for n in tokens)] for key, by_n in ratios.items()],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512, 4096])
    p.add_argument("--keep", type=float, default=0.75, help="fraction of each matrix's parameters kept")
    p.add_argument("--structures", nargs="+", help="the cases to time (default: all)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--compile", action="store_true", help="time torch.compile'd modules (both sides)")
    p.add_argument("--cold", action="store_true", help="weights read from memory: copies beyond the cache (eager)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    if args.cold and args.compile:
        p.error("--cold times eager modules only")
    rows = run(args.threads, args.tokens, args.rounds, args.keep, args.structures, args.compile, args.cold)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_structured_linear.py "
        + shlex.join(sys.argv[1:]),
        "torch": torch.__version__,
        "load_average_start": load_start,
        "load_average_end": (load_end := Path("/proc/loadavg").read_text().split()[:3]),
        "load": f"load average (1, 5, 15 min) {', '.join(load_start)} at the start, {', '.join(load_end)} at the end",
        "dtype": "float32",
        "keep": args.keep,
        "weights": "from memory (--cold)" if args.cold else "in cache",
        "rows": rows,
        "tables": [ratio_table(rows, args.keep)],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
