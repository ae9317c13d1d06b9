"""Deploying an output: its weight bytes, memory and inference speed against its source (issue 47).

Every output family hf_symmetry writes, built from SmolLM2-135M-Instruct (the embedded default model) through
the command line and loaded as a user loads it (``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)``, the folder's own remote code; the child imports no hf_symmetry): ``compress``
low rank, Kronecker, group-sparse and SliceGPT at ``--ratio`` 0.25 and 0.5 (``--stage none``: the solver stage
changes the weights, not their shapes, so not the speed), ``farr`` (V/O, half their parameters), ``to-tpa``
exact and at k/v rank 2 (calibrated), each also with its 4-bit quantized factor cache, ``rotate`` (a stock
Llama, embeddings untied), and the source with transformers' 4-bit HQQ cache.

Each measurement is one fresh process (memory per model): ``OMP_NUM_THREADS`` threads, a prompt of L tokens of
hamlet at batch B; glibc's mmap threshold at 64 KiB so that freed tensors leave the resident set (its peak is
live memory). Modes:

* ``eager``: ``generate`` of 16 greedy tokens (forced length) after a warm-up ``generate``; prefill tokens/s
  (B·L over the time to the first token) and decode ms/token from a stopping-criteria clock, resident set
  after loading and its peak above that level during ``generate`` (CUDA: the allocator's peak);
* ``compiled``: a ``StaticCache``, eager prefill, then ``torch.compile(model.forward, fullgraph=True)`` decode
  steps (2 warm-up, 16 timed), as bench_compiled_decode.py (quantized caches are not compileable: no row).

A cell (mode, threads, L, B) runs the source and every configuration in turn, ``--rounds`` times (interleaved
rounds: the shared machine's changing load falls on all alike); a speed-up is the median over rounds of
source time / configuration time in the same round (above 1: faster than the source). Load average is recorded
with every record.

    python benchmarks/bench_deploy.py                                   # the goal cell: eager, 1 thread, 512 x 1
    python benchmarks/bench_deploy.py --modes compiled --only source lowrank-0.25
    python benchmarks/bench_deploy.py --threads 2 --contexts 2048 --batches 8 --rounds 3
    python benchmarks/bench_deploy.py --device cuda --dtype bfloat16    # on a GPU

Folders are built once under ``--work`` and rebuilt when their remote code differs from the package's
(``hf_symmetry/modeling/``). Results accumulate in benchmarks/results/deploy.json (a rerun skips what it holds;
``--force`` measures again) with the tables BENCHMARKS.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from child import Clock, Memory, machine, rss, run_child, trim  # benchmarks/ is on the path: the script runs there

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "deploy.json"
NEW_TOKENS, WARM = 16, 2
QCACHE = {"backend": "hqq", "q_group_size": 64, "residual_length": 128}
COMPRESS = ["compress", "default", "{out}", "--stage", "none"]
CALIB = ["--calib", "britannica-calib"]
#: name -> (label, folder, CLI arguments that build it (None: the source), quantized cache nbits)
CONFIGS = {
    "source": ("SmolLM2-135M-Instruct (source)", "source", None, None),
    "source-q4": ("source, HQQ 4-bit cache", "source", None, 4),
    **{
        f"{s}-{r}": (
            f"compress {s} {r}",
            f"{s}-{r}",
            COMPRESS + ["--structure", s, "--ratio", r] + (CALIB if s == "slice" else []),
            None,
        )
        for s in ("lowrank", "kron", "gs", "slice")
        for r in ("0.25", "0.5")
    },
    "farr": ("farr V/O ½ parameters", "farr", ["farr", "default", "{out}", "--params-fraction", "0.5", "--vo"], None),
    "tpa-exact": ("to-tpa exact", "tpa-exact", ["to-tpa", "default", "{out}"], None),
    "tpa-exact-q4": ("to-tpa exact, 4-bit factor cache", "tpa-exact", None, 4),
    "tpa-r2": (
        "to-tpa k/v rank 2",
        "tpa-r2",
        ["to-tpa", "default", "{out}", "--k-rank", "2", "--v-rank", "2", *CALIB],
        None,
    ),
    "tpa-r2-q4": ("to-tpa k/v rank 2, 4-bit factor cache", "tpa-r2", None, 4),
    "rotated": ("rotate (stock Llama, untied)", "rotated", ["rotate", "default", "{out}"], None),
}
BUILDERS = {folder: argv for _, folder, argv, _ in CONFIGS.values() if argv is not None}


# ----------------------------------------------------------------------------------------------
# Parent: folders, the grid, the tables
# ----------------------------------------------------------------------------------------------
def stale(folder: Path) -> bool:
    """Whether ``folder`` is missing or carries remote code that differs from the package's current files."""
    if not (folder / "config.json").is_file():
        return True
    modeling = ROOT / "hf_symmetry" / "modeling"
    return any(
        (modeling / f.name).is_file() and f.read_bytes() != (modeling / f.name).read_bytes()
        for f in folder.glob("*.py")
    )


def build_folders(work: Path, configs: list[str]) -> dict[str, str]:
    """Every folder ``configs`` need, built with ``hf-symmetry`` (``--no-verify``) where missing or stale."""
    from hf_symmetry.assets import smollm2_dir

    folders = {"source": str(smollm2_dir())}
    for folder in {CONFIGS[c][1] for c in configs} - {"source"}:
        out = work / folder
        if stale(out):
            argv = [a.replace("{out}", str(out)) for a in BUILDERS[folder]]
            print("building", folder, "...", flush=True)
            cmd = [sys.executable, "-m", "hf_symmetry.cli", *argv, "--no-verify", "--quiet", "--overwrite"]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        folders[folder] = str(out)
    return folders


def weight_bytes(folder: str) -> int:
    """Bytes of the folder's weights (its safetensors; a conversion's layer map is not a weight)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors") if f.name != "layer_map.safetensors")


def cell_of(record: dict) -> tuple:
    return record["mode"], record["threads"], record["context"], record["batch"], record["device"], record["dtype"]


def key(record: dict) -> tuple:
    return (record["config"], *cell_of(record), record["run"], record["round"])


def cell_label(cell: tuple) -> str:
    mode, threads, context, batch, device, dtype = cell
    where = "" if (device, dtype) == ("cpu", "float32") else f" {device} {dtype}"
    return f"{mode}, {threads} thr, {context}×{batch}{where}"


def speedups(runs: list[dict], config: str, cell: tuple) -> tuple[float | None, float | None]:
    """Median over rounds of source time / ``config``'s time in the same round (same run): prefill, decode. The
    time is the computing thread's CPU time where both records have it (one-thread cells since 2026-11-29
    09:45 UTC: what a loaded shared machine's scheduler gives other processes is not counted), else wall time."""
    by = {(r["config"], r["run"], r["round"]): r for r in runs if cell_of(r) == cell and "error" not in r}
    pre, dec = [], []
    for (name, run, rnd), rec in by.items():
        src = by.get(("source", run, rnd))
        if name != config or src is None:
            continue
        for ratios, wall, cpu in ((pre, "prefill_s", "prefill_cpu_s"), (dec, "decode_ms", "decode_cpu_ms")):
            field = cpu if rec.get(cpu) and src.get(cpu) else wall  # CPU time where both have it (one thread)
            if rec.get(field) and src.get(field):
                ratios.append(src[field] / rec[field])
    return (statistics.median(pre) if pre else None), (statistics.median(dec) if dec else None)


def _median(records: list[dict], field: str) -> float | None:
    values = [r[field] for r in records if r.get(field) is not None]
    return statistics.median(values) if values else None


def _pair(pre: float | None, dec: float | None) -> str:
    """A cell of speed-ups: prefill / decode."""
    return f"{pre:.2f} / {dec:.2f}" if pre and dec else (f"– / {dec:.2f}" if dec else "–")


def _x(value, ref) -> str:
    return f"{value / ref:.2f}" if value is not None and ref else "–"


def tables(runs: list[dict]) -> list[dict]:
    cells = sorted({cell_of(r) for r in runs}, key=lambda c: (c[4], c[5], c[0] != "eager", c[1], c[2], c[3]))
    configs = [c for c in CONFIGS if any(r["config"] == c for r in runs)]
    size = {c: _median([r for r in runs if r["config"] == c], "weight_bytes") for c in configs}
    load = {c: _median([r for r in runs if r["config"] == c and r["mode"] == "eager"], "load_mb") for c in configs}
    goal = [c for c in cells if c[1:4] == (1, 512, 1)]  # the shape: one thread, 512 tokens, batch 1
    shapes = [c for c in cells if c not in goal]
    main_rows, shape_rows = [], []
    for c in configs:
        row = [CONFIGS[c][0], f"{size[c] / 1e6:.0f}" if size[c] else "–", _x(size[c], size["source"])]
        row += [f"{load[c]:.0f}" if load[c] else "–", _x(load[c], load.get("source"))]
        main_rows.append(row + [_pair(*speedups(runs, c, cell)) for cell in goal])
        shape_row = [_pair(*speedups(runs, c, cell)) for cell in shapes]
        if c != "source" and any(x != "–" for x in shape_row):
            shape_rows.append([CONFIGS[c][0], *shape_row])
    detail_rows = []
    for cell in cells:
        for c in configs:
            recs = [r for r in runs if r["config"] == c and cell_of(r) == cell]
            if not recs:
                continue
            ok = [r for r in recs if "error" not in r]
            tok_s = _median(ok, "prefill_tok_s")
            peak, dec, comp = _median(ok, "decode_peak_mb"), _median(ok, "decode_ms"), _median(ok, "compile_s")
            dec_cpu = _median(ok, "decode_cpu_ms")
            loads = [r["load_avg"] for r in recs if r.get("load_avg") is not None]
            note = "" if ok else "failed: " + recs[-1]["error"].strip().splitlines()[-1][:120].replace("|", "\\|")
            detail_rows.append(
                [
                    cell_label(cell),
                    CONFIGS[c][0],
                    f"{tok_s:.0f}" if tok_s else "–",
                    f"{dec:.1f}" if dec else "–",
                    f"{dec_cpu:.1f}" if dec_cpu else "–",
                    f"{peak:.0f}" if peak is not None else "–",
                    f"{comp:.0f}" if comp else "–",
                    f"{min(loads):.1f}–{max(loads):.1f}" if loads else "–",
                    str(len(ok)),
                    note,
                ]
            )
    return [
        {
            "name": "main",
            "caption": "Against the source, measured in the same run: weights = bytes of the safetensors (MB, × "
            "source); RSS after load = the process's resident set with the model loaded (the process's own ~0.5 "
            "GB included; eager cells); then per cell (mode, threads, context × batch) the speed-up prefill / decode = "
            "median over interleaved rounds of source time / this model's time (above 1: faster than the source; "
            "the computing thread's CPU time where recorded, else wall time); compiled cells: decode compiled, "
            "prefill eager into the static cache.",
            "columns": ["output", "weights MB", "× source", "RSS after load MB", "× source"]
            + [cell_label(c) for c in goal],
            "rows": main_rows,
        },
        {
            "name": "shapes",
            "caption": "The other cells (context × batch, threads): speed-up prefill / decode over the source, "
            "median over interleaved rounds of the same run (above 1: faster than the source; – not measured).",
            "columns": ["output"] + [cell_label(c) for c in shapes],
            "rows": shape_rows,
        },
        {
            "name": "detail",
            "caption": "Medians over rounds: prefill tokens/s (B·L / time to the first token; compiled cells: eager "
            "prefill into the static cache), decode ms/token (wall; CPU: the computing thread's CPU time, one-thread "
            "cells measured since it was recorded), decode peak = resident set above the loaded level "
            "during generation (MB), compile s = the two warm-up steps; load = the machine's 1-minute load average "
            "over the rounds (2 cores).",
            "columns": [
                "cell",
                "output",
                "prefill tok/s",
                "decode ms/token",
                "decode CPU ms/token",
                "decode peak MB",
                "compile s",
                "load",
                "rounds",
                "note",
            ],
            "rows": detail_rows,
        },
    ]


def command(data: dict, argv) -> str:
    """The invocations that produced the file's records, this one added (``;``-separated)."""
    this = "python benchmarks/bench_deploy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    done = [c for c in data.get("command", "").split("; ") if c]
    return "; ".join(done + ([this.strip()] if this.strip() not in done else []))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="configurations")
    p.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"])
    p.add_argument("--threads", nargs="+", type=int, default=[1])
    p.add_argument("--contexts", nargs="+", type=int, default=[512])
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--force", action="store_true", help="measure again what the results file holds")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "hf_symmetry_bench" / "deploy"))
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child process")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def todo(runs: dict, configs: list[str], cell: tuple, force: bool) -> list[str]:
    """The configurations of ``cell`` to measure: those without a record (all with ``--force``; never a
    quantized cache compiled), and the source first whenever another one is measured (ratios come from the
    same rounds)."""
    done = {r["config"] for r in runs.values() if cell_of(r) == cell and "error" not in r}
    wanted = [c for c in configs if (force or c not in done) and not (cell[0] == "compiled" and CONFIGS[c][3])]
    return (["source"] if wanted else []) + [c for c in wanted if c != "source"]


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    from hf_symmetry.assets import text_path

    configs = ["source"] + [c for c in args.only if c != "source"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folders = build_folders(work, configs)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    runs = {key(r): r for r in data.get("runs", [])}
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    cells = [
        (m, t, L, B, args.device, args.dtype)
        for m in args.modes
        for t in args.threads
        for L in args.contexts
        for B in args.batches
    ]
    for cell in cells:
        names = todo(runs, configs, cell, args.force)
        for name in names:  # a configuration measured again replaces its records of this cell
            runs = {k: r for k, r in runs.items() if not (r["config"] == name != "source" and cell_of(r) == cell)}
        for rnd in range(args.rounds if names else 0):
            for name in names:
                job = dict(zip(("mode", "threads", "context", "batch", "device", "dtype"), cell))
                job.update(config=name, run=run_id, round=rnd)
                folder = folders[CONFIGS[name][1]]
                print(f"{name} {cell_label(cell)} round {rnd} ...", flush=True)
                job.update(folder=folder, nbits=CONFIGS[name][3], text=str(text_path("hamlet")))
                env = {"OMP_NUM_THREADS": str(cell[1]), "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
                record = run_child(__file__, job, args.timeout, env=env)
                for k in ("folder", "text"):
                    record.pop(k)
                record.update(weight_bytes=weight_bytes(folder), load_avg=round(os.getloadavg()[0], 1))
                runs[key(record)] = record
                print("  ", {k: v for k, v in record.items() if k not in job}, flush=True)
                save(out, data, runs, args, argv)
    return 0


def save(out: Path, data: dict, runs: dict, args, argv) -> None:
    paired = {(cell_of(r), r["run"]) for r in runs.values() if r["config"] != "source"}
    runs = {k: r for k, r in runs.items() if r["config"] != "source" or (cell_of(r), r["run"]) in paired}
    data.update(
        machine=machine(args.device),
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        command=command(data, argv),
        runs=sorted(
            runs.values(), key=lambda r: (*[str(x) for x in cell_of(r)], r["round"], list(CONFIGS).index(r["config"]))
        ),
    )
    data["machine"].pop("threads", None)  # (per record)
    data["tables"] = tables(data["runs"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------
# Child: one configuration in a fresh process
# ----------------------------------------------------------------------------------------------
def child(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    device = torch.device(job["device"])
    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    folder = job["folder"]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    out = {"load_s": round(time.perf_counter() - t, 2), "class": type(model).__name__}
    L, B = job["context"], job["batch"]
    ids = tok(Path(job["text"]).read_text(encoding="utf-8"), add_special_tokens=False, return_tensors="pt").input_ids[0]
    ids = torch.cat([ids] * -(-(L * B) // ids.numel()))[: L * B].view(B, L).to(device)
    with torch.no_grad():
        model(ids[:1, :16])  # touch every weight (memory-mapped safetensors) before the baseline
    trim()
    out["load_mb"] = round(rss() / 1e6, 1)
    mem = Memory(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        out.update((eager if job["mode"] == "eager" else compiled)(model, tok, ids, job, mem, sync))
    mem.stop()
    out["prefill_tok_s"] = round(L * B / out["prefill_s"], 1)
    return out


def eager(model, tok, ids, job, mem, sync) -> dict:
    import torch
    from transformers import StoppingCriteriaList

    extra = {} if job["nbits"] is None else {"cache_implementation": "quantized"}
    if job["nbits"] is not None:
        extra["cache_config"] = {**QCACHE, "nbits": job["nbits"]}

    def generate(prompt, n, criteria=None):
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
            return_dict_in_generate=True,
            stopping_criteria=criteria,
            **extra,
        )

    generate(ids[:, :32], WARM)  # warm-up: first-call allocations and kernel choices
    base = mem.start()
    clock = Clock(mem, sync)
    clock.start()
    gen = generate(ids, NEW_TOKENS, StoppingCriteriaList([clock]))
    one_thread = job["threads"] == 1 and job["device"] == "cpu"  # all the work on this thread: its CPU time
    return {
        "cache_layer": type(gen.past_key_values.layers[0]).__name__,
        "prefill_s": round(clock.prefill_s(), 4),
        "decode_ms": round(clock.decode_ms(), 3),
        **({"prefill_cpu_s": round(clock.prefill_s(cpu=True), 4)} if one_thread else {}),
        **({"decode_cpu_ms": round(clock.decode_ms(cpu=True), 3)} if one_thread else {}),
        "prefill_peak_mb": round(clock.prefill_peak(base) / 1e6, 1),
        "decode_peak_mb": round((mem.read() - base) / 1e6, 1),
    }


def compiled(model, tok, ids, job, mem, sync) -> dict:
    import inspect

    import torch
    from transformers import StaticCache

    B, L = ids.shape
    field = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = StaticCache(config=model.config, max_cache_len=L + WARM + NEW_TOKENS + 1)
    t0 = time.perf_counter()
    logits = model(ids, logits_to_keep=1, **{field: cache}).logits
    sync()
    out = {"prefill_s": round(time.perf_counter() - t0, 4)}
    base = mem.start()  # the decode peak: above the level after prefill (the static cache allocated)
    state = [logits[:, -1:].argmax(-1), L]

    def run(step, n):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            position = torch.full((B, 1), state[1], device=ids.device)
            logits = step(input_ids=state[0], position_ids=position, logits_to_keep=1, **{field: cache}).logits
            state[0], state[1] = logits[:, -1:].argmax(-1), state[1] + 1
        sync()
        return time.perf_counter() - t

    step = torch.compile(model.forward, fullgraph=True)
    out["compile_s"] = round(run(step, WARM), 1)
    out["decode_ms"] = round(1000 * run(step, NEW_TOKENS) / NEW_TOKENS, 3)
    out["decode_peak_mb"] = round((mem.read() - base) / 1e6, 1)
    return out


if __name__ == "__main__":
    sys.exit(main())
