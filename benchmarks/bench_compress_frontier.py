"""Compression at equal total parameters on SmolLM2-135M-Instruct: SliceGPT variants, the
ProcrustesGPT paper's configuration, low rank, and uniform against sensitivity-allocated sizes.

Rows (each in a fresh process, so each peak RSS is its own; calibration on ``britannica-calib``):

- dense;
- SliceGPT: one global PCA, one PCA per segment (one pass of the original), one PCA per segment
  sequential (each on the stream of the model whose earlier segments are already sliced);
- the ``procrustesgpt-llama`` preset (embedding/head and V dense, q/k/o/gate/up/down at 75 %), and
  SliceGPT (global PCA) at the preset's total parameter count;
- low rank (stage W weighting), uniform and ``--allocation sensitivity``; optionally GS (stage F/W);
- SliceGPT with per-segment widths (``--allocation sensitivity``), GS and Kronecker with stage W to
  convergence (:data:`CONVERGED`), uniform and allocated, and the preset with GS.

``--segments`` instead scores two residual segments for every method at the same total
(:func:`segment_objectives`; ``compress_frontier_segments.json``).

Perplexity: the project's definition (window 512, stride 256) on the first ``--eval-tokens`` tokens of
two held-out texts, ``britannica-eval`` and ``hamlet``. Results: ``benchmarks/results/compress_frontier.json``
(rerun to resume; ``--force`` redoes rows).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compress_frontier.py [--only 'NAME;...']
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
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "compress_frontier.json"
TEXTS = ("britannica-eval", "hamlet")


#: stage W to convergence (benchmarks/bench_stage_w_reference.py's "ours_converged" settings)
CONVERGED = dict(stage="w", w_iters=50, stop_tol=1e-3, extrapolate=True, als_iters=3, wopp_iters=30, f_iters=10)


def rows(ratio: float) -> list[dict]:
    lr = dict(structure="lowrank", stage="w")
    out = [
        dict(name="dense"),
        dict(name="SliceGPT global PCA", options=dict(structure="slice", q_mode="global", ratio=ratio)),
        dict(name="SliceGPT per-segment PCA, one pass", options=dict(structure="slice", q_mode="segment", ratio=ratio)),
        dict(
            name="SliceGPT per-segment PCA, sequential",
            options=dict(structure="slice", q_mode="segment", sequential=True, ratio=ratio),
        ),
        dict(name="low rank, uniform", options=dict(**lr, ratio=ratio)),
        dict(name="low rank, sensitivity allocation", options=dict(**lr, ratio=ratio, allocation="sensitivity")),
        dict(name="preset procrustesgpt-llama (low rank)", preset="procrustesgpt-llama", options=dict(**lr)),
        dict(
            name="preset procrustesgpt-llama (low rank), sensitivity allocation",
            preset="procrustesgpt-llama",
            options=dict(**lr, allocation="sensitivity"),
        ),
        dict(
            name="SliceGPT global PCA at the preset's size",
            options=dict(structure="slice", q_mode="global"),
            match="preset procrustesgpt-llama (low rank)",
        ),
        dict(name="low rank, sequential, uniform", options=dict(**lr, ratio=ratio, sequential=True)),
        dict(name="gs stage F, uniform", options=dict(structure="gs", stage="f", ratio=ratio)),
        dict(
            name="gs stage F, sensitivity allocation",
            options=dict(structure="gs", stage="f", ratio=ratio, allocation="sensitivity"),
        ),
        dict(
            name="SliceGPT global PCA, sensitivity widths",
            options=dict(structure="slice", q_mode="global", ratio=ratio, allocation="sensitivity"),
        ),
        dict(
            name="SliceGPT global PCA, sensitivity widths, at the preset's size",
            options=dict(structure="slice", q_mode="global", allocation="sensitivity"),
            match="preset procrustesgpt-llama (low rank)",
        ),
        dict(name="gs stage W converged, uniform", options=dict(structure="gs", ratio=ratio, **CONVERGED)),
        dict(name="kron stage W converged, uniform", options=dict(structure="kron", ratio=ratio, **CONVERGED)),
        dict(
            name="gs stage W converged, sensitivity allocation",
            options=dict(structure="gs", ratio=ratio, allocation="sensitivity", **CONVERGED),
        ),
        dict(
            name="kron stage W converged, sensitivity allocation",
            options=dict(structure="kron", ratio=ratio, allocation="sensitivity", **CONVERGED),
        ),
        dict(
            name="preset procrustesgpt-llama (gs, stage W converged)",
            preset="procrustesgpt-llama",
            options=dict(structure="gs", **CONVERGED),
        ),
        dict(
            name="SliceGPT global PCA at the preset's gs size",
            options=dict(structure="slice", q_mode="global"),
            match="preset procrustesgpt-llama (gs, stage W converged)",
        ),
    ]
    return out


def run_row(row: dict, args, results: dict) -> dict:
    """In this (fresh) process: compress, then perplexity on both texts."""
    import torch

    torch.set_num_threads(1)
    from hf_symmetry.assets import smollm2_dir, text_path
    from hf_symmetry.checkpoint_io import CheckpointReader
    from hf_symmetry.conversion import compress as C
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer
    from hf_symmetry.evaluation.perplexity import PPL, perplexity
    from hf_symmetry.text import read_text, tokenize_text

    src = smollm2_dir()
    tok = load_tokenizer(src)
    evals = {t: tokenize_text(tok, read_text(text_path(t)), max_tokens=args.eval_tokens) for t in TEXTS}

    def ppl(model):
        return {
            t: perplexity(model, ids, PPL.window, PPL.stride, progress=False).perplexity for t, ids in evals.items()
        }

    t0 = time.perf_counter()
    if row["name"] == "dense":
        model = load_model(src)
        return {
            "perplexity": ppl(model),
            "params": sum(p.numel() for p in model.parameters()),
            "seconds": time.perf_counter() - t0,
        }
    reader = CheckpointReader(src)
    opts = {
        "f_iters": args.f_iters,
        "ratio_slack": 0.05,
        **row.get("options", {}),
    }
    if "match" in row:  # SliceGPT at another row's total: the ratio that gives that total
        target = results["rows"][row["match"]]["params"]
        probe = C.CompressOptions(**opts, ratio=0.25)
        plan, _ = C.plan_for(reader, reader.config, probe)
        acc = plan.accounting
        opts["ratio"] = (acc.dense_model_params - target) / acc.dense_params_of_compressed_matrices
    options = C.CompressOptions.preset(row["preset"], **opts) if "preset" in row else C.CompressOptions(**opts)
    calibration = replace(C.CALIBRATION, tokens=args.calib_tokens, seq_len=512)
    calib_ids = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=calibration.tokens)
    state, cfg, report = C.compress_tensors(
        C.CompressRun(reader, reader.config, options, calib_ids=calib_ids, progress=False, calibration=calibration)
    )
    model, counted = C.build_model(state, cfg)
    state_norms = {k: float(v.double().pow(2).sum()) for k, v in state.items() if k.endswith(".weight")}
    del state
    acc = report.accounting
    out = {
        "options": {k: v for k, v in options.applicable(calibration).items()},
        "label": options.label,
        "perplexity": ppl(model),
        "params": counted,
        "ratio_over_model": acc.ratio_over_model,
        "ratio_over_compressed": acc.ratio_over_compressed,
        "seconds": time.perf_counter() - t0,
        "stage_seconds": report.seconds,
    }
    if acc.allocation_report is not None:
        out["allocation"] = {k: v["keep"] for k, v in acc.allocation_report["groups"].items()}
        if "widths" in acc.allocation_report:
            out["widths"] = acc.allocation_report["widths"]
            out["uniform_width"] = acc.allocation_report["uniform_width"]
    # what each solve reached: objective per solved problem (first/last/steps) and relative errors
    out["objective"] = report.objective
    rel = report.relative_errors or slice_relative_errors(reader, state_norms, cfg)
    out["relative_errors"] = rel
    by_kind: dict[str, list[float]] = {}
    for name, e in rel.items():
        by_kind.setdefault(name.rsplit(".", 1)[-1], []).append(e)
    out["mean_relative_error"] = {k: sum(v) / len(v) for k, v in by_kind.items()}
    if acc.target_params is not None:
        out["target_params"] = acc.target_params
    return out


def slice_relative_errors(reader, state_norms: dict, cfg: dict) -> dict:
    """SliceGPT's counterpart of the structured rows' relative errors: ``‖M − M P‖ / ‖M‖`` for every
    sliced matrix (norms folded; the rotation keeps norms, so it is ``√(1 − ‖M Q_w‖² / ‖M‖²)``)."""
    from hf_symmetry.conversion import compress as C
    from hf_symmetry.conversion.compress.folded import read_folded
    from hf_symmetry.conversion.compress.options import LAYER_MODULES

    adapter = C.check_family(reader.config, reader.keys())
    layers, globals_, _ = read_folded(reader, adapter, reader.keys(), adapter.tied_embeddings)
    out = {}
    for i, layer in enumerate(layers):
        for canon, (path, _) in LAYER_MODULES.items():
            full = float(layer[f"{canon}.weight"].pow(2).sum())
            kept = state_norms.get(f"model.layers.{i}.{path}.weight")
            if kept is not None:
                out[f"layers.{i}.{path.split('.')[1]}"] = max(0.0, 1 - kept / full) ** 0.5
    kept = state_norms.get("model.embed_tokens.matrix.weight")
    if kept is not None:
        out["embed"] = max(0.0, 1 - kept / float(globals_["embed.weight"].pow(2).sum())) ** 0.5
    return out


def segment_objectives(args) -> dict:
    """Why the structured rows lose, measured on two residual segments of SmolLM2 (ffn5: writer o of
    layer 5, readers gate/up; attn5: writer down of layer 4, readers q/k/v of layer 5), with the
    covariances and the scoring of ``bench_stage_w_reference.py`` (paper objective: squared
    calibration-weighted errors, readers scaled by λ; V counted only where it is compressed):

    - SliceGPT at the 24.4 % row's width, with its one global PCA (4096 calibration tokens);
    - Kronecker and GS at the sizes ``compress`` plans for the same total (per-segment Q: the
      structures must remove ~33 % to pay for the skip rotations), stage F (10 alternations) then
      stage W to convergence (:data:`CONVERGED`);
    - low rank (no rotation) with its weighted projection."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from bench_stage_w_reference import build_terms, score, segment_problems

    from hf_symmetry.assets import smollm2_dir, text_path
    from hf_symmetry.checkpoint_io import CheckpointReader
    from hf_symmetry.conversion import compress as C
    from hf_symmetry.conversion.compress.pca import pca
    from hf_symmetry.evaluation.compare import load_tokenizer
    from hf_symmetry.text import read_text, tokenize_text
    from hf_symmetry.solvers.segments import Alternation, solve_segment

    problems = segment_problems([("ffn", 5), ("attn", 5)], 16384)
    reader = CheckpointReader(smollm2_dir())
    ids = tokenize_text(
        load_tokenizer(smollm2_dir()), read_text(text_path("britannica-calib")), max_tokens=args.calib_tokens
    )
    stats = C.collect_statistics(
        C.CompressRun(
            reader,
            reader.config,
            calib_ids=ids,
            calibration=replace(C.CALIBRATION, tokens=ids.numel(), seq_len=512),
            progress=False,
        ),
        want_normed=False,
        want_stream=True,
    )
    Qg = pca(sum(Cm / Cm.trace() for Cm in stats.stream))
    width = C.plan_for(reader, reader.config, C.CompressOptions(structure="slice", ratio=args.ratio))[0].residual
    names = {
        ("ffn", "writer", "o"): "layers.5.o_proj",
        ("ffn", "reader", "gate"): "layers.5.gate_proj",
        ("ffn", "reader", "up"): "layers.5.up_proj",
        ("attn", "writer", "down"): "layers.4.down_proj",
        ("attn", "reader", "q"): "layers.5.q_proj",
        ("attn", "reader", "k"): "layers.5.k_proj",
        ("attn", "reader", "v"): "layers.5.v_proj",
    }
    out = {"slicegpt_width": width, "segments": {}}
    for (kind, layer), p in problems.items():
        seg = f"{kind}{layer}"
        res = {}
        d = p["reader_cov"].shape[0]
        # SliceGPT: M Q with the columns past the width dropped (V sliced too, scored separately)
        approx = {}
        rel = {}
        for key, M in p.items():
            role, _, name = key.partition(".")
            if role not in ("writer", "reader"):
                continue
            MQ = M @ Qg
            A = MQ.clone()
            A[:, width:] = 0
            rel[name] = float(torch.linalg.matrix_norm(MQ - A) / torch.linalg.matrix_norm(M))
            if name != "v":
                approx[name] = A
        res["SliceGPT global PCA"] = {**score(p, Qg, approx), "relative_errors": rel}
        for structure in ("kron", "gs", "lowrank"):
            options = C.CompressOptions(
                structure=structure, ratio=args.ratio, **{k: v for k, v in CONVERGED.items() if k != "f_iters"}
            )
            plan = C.plan_for(reader, reader.config, options)[0].by_name()

            def terms_for(stage):
                return build_terms(p, stage, lambda role, name, shape: plan[names[(kind, role, name)]].structure)

            c0 = time.process_time()
            eye = torch.eye(d, dtype=torch.float64)
            terms = terms_for("w")
            if structure == "lowrank":  # no rotation lowers a rank: the weighted projection alone
                r = solve_segment(terms, eye, Alternation(iters=0, als_iters=3, wopp_iters=30, dtype=torch.float32))
            else:
                QF = solve_segment(terms_for("f"), eye, Alternation(iters=10, tol=1e-3)).Q
                r = solve_segment(
                    terms,
                    QF,
                    Alternation(iters=50, als_iters=3, wopp_iters=30, dtype=torch.float32, tol=1e-3, extrapolate=True),
                )
            approx = {t.name: t.structure.dense(t.factors) for t in terms if not t.is_dense}
            rel = {
                t.name: float(torch.linalg.matrix_norm(t.M @ r.Q - approx[t.name]) / torch.linalg.matrix_norm(t.M))
                for t in terms
                if not t.is_dense
            }
            res[structure] = {
                **score(p, r.Q, approx),
                "relative_errors": rel,
                "structures": {t.name: t.structure.entry() for t in terms},
                "cpu_seconds": time.process_time() - c0,
                "alternations": r.alternations,
                "converged": r.converged,
            }
            print(seg, structure, {k: v for k, v in res[structure].items() if k not in ("structures",)}, flush=True)
        out["segments"][seg] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--f-iters", type=int, default=4)
    ap.add_argument("--only", help="semicolon-separated substrings of row names")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    ap.add_argument(
        "--segments",
        action="store_true",
        help="instead of the rows: the objective values on two segments (segment_objectives)",
    )
    args = ap.parse_args()
    if args.segments:
        out = segment_objectives(args)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out.update(
            cpu_seconds=usage.ru_utime + usage.ru_stime,
            peak_rss_gb=usage.ru_maxrss / 2**20,
            calib_tokens=args.calib_tokens,
            ratio=args.ratio,
            date=time.strftime("%Y-%m-%d", time.gmtime()),
        )
        path = args.results.with_name(args.results.stem + "_segments.json")
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: v for k, v in out.items() if k != "segments"}))
        return
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results.setdefault("rows", {})
    table = rows(args.ratio)
    if args.row:
        row = next(r for r in table if r["name"] == args.row)
        out = run_row(row, args, results)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["peak_rss_gb"] = usage.ru_maxrss / 2**20
        out["cpu_seconds"] = usage.ru_utime + usage.ru_stime  # one thread: ≈ wall time on a quiet core
        print("ROW " + json.dumps(out), flush=True)
        return
    for row in table:
        name = row["name"]
        if args.only and not any(s in name for s in args.only.split(";")):
            continue
        if name in results["rows"] and not args.force:
            continue
        cmd = [
            sys.executable,
            __file__,
            "--row",
            name,
            "--ratio",
            str(args.ratio),
            "--calib-tokens",
            str(args.calib_tokens),
            "--eval-tokens",
            str(args.eval_tokens),
            "--f-iters",
            str(args.f_iters),
            "--results",
            str(args.results),
        ]
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
        print(
            f"{name}: {out['params']:,} params, {pp}, {out['wall_seconds']:.0f} s, "
            f"peak RSS {out['peak_rss_gb']:.2f} GB",
            flush=True,
        )
        results["machine"] = {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
            "note": "2-core CPU VM shared with other jobs; one thread per row",
        }
        results["settings"] = {
            "ratio": args.ratio,
            "calib_text": "britannica-calib",
            "calib_tokens": args.calib_tokens,
            "eval_texts": list(TEXTS),
            "eval_tokens": args.eval_tokens,
            "perplexity_window": 512,
            "perplexity_stride": 256,
            "f_iters": args.f_iters,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
