"""Compression at equal total parameters on SmolLM2-135M-Instruct: SliceGPT variants, the
ProcrustesGPT paper's configuration, low rank, and uniform against sensitivity-allocated sizes.

Rows (each in a fresh process, so each peak RSS is its own; calibration on ``britannica-calib``):

- dense;
- SliceGPT: one global PCA, one PCA per segment (one pass of the original), one PCA per segment
  sequential (each on the stream of the model whose earlier segments are already sliced);
- the ``procrustesgpt-llama`` preset (embedding/head and V dense, q/k/o/gate/up/down at 75 %), and
  SliceGPT (global PCA) at the preset's total parameter count;
- low rank (stage W weighting), uniform and ``--allocation sensitivity``; optionally GS (stage F/W).

Perplexity: the project's definition (window 512, stride 256) on the first ``--eval-tokens`` tokens of
two held-out texts, ``britannica-eval`` and ``hamlet``. Results: ``benchmarks/results/compress_frontier.json``
(rerun to resume; ``--force`` redoes rows).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compress_frontier.py [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "compress_frontier.json"
TEXTS = ("britannica-eval", "hamlet")


def rows(ratio: float) -> list[dict]:
    lr = dict(structure="lowrank", stage="w")
    out = [
        dict(name="dense"),
        dict(name="SliceGPT global PCA", options=dict(structure="slice", q_mode="global", ratio=ratio)),
        dict(name="SliceGPT per-segment PCA, one pass", options=dict(structure="slice", q_mode="segment", ratio=ratio)),
        dict(name="SliceGPT per-segment PCA, sequential",
             options=dict(structure="slice", q_mode="segment", sequential=True, ratio=ratio)),
        dict(name="low rank, uniform", options=dict(**lr, ratio=ratio)),
        dict(name="low rank, sensitivity allocation", options=dict(**lr, ratio=ratio, allocation="sensitivity")),
        dict(name="preset procrustesgpt-llama (low rank)", preset="procrustesgpt-llama", options=dict(**lr)),
        dict(name="preset procrustesgpt-llama (low rank), sensitivity allocation", preset="procrustesgpt-llama",
             options=dict(**lr, allocation="sensitivity")),
        dict(name="SliceGPT global PCA at the preset's size", options=dict(structure="slice", q_mode="global"),
             match="preset procrustesgpt-llama (low rank)"),
        dict(name="low rank, sequential, uniform", options=dict(**lr, ratio=ratio, sequential=True)),
        dict(name="gs stage F, uniform", options=dict(structure="gs", stage="f", ratio=ratio)),
        dict(name="gs stage F, sensitivity allocation", options=dict(structure="gs", stage="f", ratio=ratio,
                                                                   allocation="sensitivity")),
    ]
    return out


def run_row(row: dict, args, results: dict) -> dict:
    """In this (fresh) process: compress, then perplexity on both texts."""
    import torch

    torch.set_num_threads(1)
    from hf_symmetry.assets import smollm2_dir, text_path
    from hf_symmetry.checkpoint import CheckpointReader
    from hf_symmetry.conversion import compress as C
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer
    from hf_symmetry.evaluation.perplexity import PPL, perplexity, read_text, tokenize_text

    src = smollm2_dir()
    tok = load_tokenizer(src)
    evals = {t: tokenize_text(tok, read_text(text_path(t)), max_tokens=args.eval_tokens) for t in TEXTS}

    def ppl(model):
        return {t: perplexity(model, ids, PPL.window, PPL.stride, progress=False).perplexity for t, ids in evals.items()}

    t0 = time.perf_counter()
    if row["name"] == "dense":
        model = load_model(src)
        return {"perplexity": ppl(model), "params": sum(p.numel() for p in model.parameters()),
                "seconds": time.perf_counter() - t0}
    reader = CheckpointReader(src)
    opts = dict(row.get("options", {}), calib_tokens=args.calib_tokens, calib_seq_len=512, f_iters=args.f_iters,
                tolerance=0.05)
    if "match" in row:            # SliceGPT at another row's total: the ratio that gives that total
        target = results["rows"][row["match"]]["params"]
        probe = C.CompressOptions(**opts, ratio=0.25)
        plan, _ = C.plan_for(reader, reader.config, probe)
        acc = plan.accounting
        opts["ratio"] = (acc["dense_model_params"] - target) / acc["dense_params_of_compressed_matrices"]
    options = C.CompressOptions.preset(row["preset"], **opts) if "preset" in row else C.CompressOptions(**opts)
    calib_ids = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=args.calib_tokens)
    state, cfg, report = C.compress_tensors(reader, reader.config, options, calib_ids=calib_ids, progress=False)
    model, counted = C.build_model(state, cfg)
    del state
    acc = report.accounting
    out = {"options": {k: v for k, v in options.applicable().items()}, "label": options.label,
           "perplexity": ppl(model), "params": counted, "ratio_over_model": acc["ratio_over_model"],
           "ratio_over_compressed": acc["ratio_over_compressed"], "seconds": time.perf_counter() - t0,
           "stage_seconds": report.seconds}
    if "allocation_report" in acc:
        out["allocation"] = {k: v["keep"] for k, v in acc["allocation_report"]["groups"].items()}
    if "target_params" in acc:
        out["target_params"] = acc["target_params"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--f-iters", type=int, default=4)
    ap.add_argument("--only", help="comma-separated substrings of row names")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--row", help=argparse.SUPPRESS)           # internal: run one row in this process
    args = ap.parse_args()
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results.setdefault("rows", {})
    table = rows(args.ratio)
    if args.row:
        row = next(r for r in table if r["name"] == args.row)
        out = run_row(row, args, results)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["peak_rss_gb"] = usage.ru_maxrss / 2**20
        out["cpu_seconds"] = usage.ru_utime + usage.ru_stime       # one thread: ≈ wall time on a quiet core
        print("ROW " + json.dumps(out), flush=True)
        return
    for row in table:
        name = row["name"]
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        if name in results["rows"] and not args.force:
            continue
        cmd = [sys.executable, __file__, "--row", name, "--ratio", str(args.ratio), "--calib-tokens",
               str(args.calib_tokens), "--eval-tokens", str(args.eval_tokens), "--f-iters", str(args.f_iters),
               "--results", str(args.results)]
        t = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line is None:
            print(f"{name}: failed\n{res.stderr[-2000:]}", flush=True)
            continue
        out = json.loads(line[4:])
        out["wall_seconds"] = time.perf_counter() - t
        results["rows"][name] = out
        pp = ", ".join(f"{k} {v:.2f}" for k, v in out["perplexity"].items())
        print(f"{name}: {out['params']:,} params, {pp}, {out['wall_seconds']:.0f} s, "
              f"peak RSS {out['peak_rss_gb']:.2f} GB", flush=True)
        results["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "python": platform.python_version(), "load_average": os.getloadavg(),
                              "note": "2-core CPU VM shared with other jobs; one thread per row"}
        results["settings"] = {"ratio": args.ratio, "calib_text": "britannica-calib",
                               "calib_tokens": args.calib_tokens, "eval_texts": list(TEXTS),
                               "eval_tokens": args.eval_tokens, "perplexity_window": 512, "perplexity_stride": 256,
                               "f_iters": args.f_iters,
                               "date": time.strftime("%Y-%m-%d", time.gmtime())}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
