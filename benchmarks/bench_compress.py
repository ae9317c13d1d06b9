"""Structured compression benchmark (ProcrustesGPT) on SmolLM2-135M-Instruct.

At one parameter budget (``--ratio``, default 0.25: the fraction of the compressed matrices' parameters
removed, skip/head matrices paid for, so every row has about the same total parameter count) it compares
held-out perplexity of: the dense model, SliceGPT (per-segment PCA with skip matrices, and one global PCA),
and for Kronecker, GS and low rank: plain projection without rotation, stage F and stage W, with one
rotation per residual segment (the paper) and with one global rotation, and stage W per segment with
sequential calibration (each segment weighted by the statistics of the model whose earlier segments are
already compressed, ``CompressOptions.sequential``). Calibration text
(``britannica-calib``) and evaluation text (``britannica-eval``) are disjoint halves of one article.

Also, side by side in the same run: forward time of each structured layer against the dense layer it
replaces (``tokens x d`` prefill batches) and of each whole compressed model against the dense one.

Calibration statistics and stage F rotations are cached under ``benchmarks/_cache/compress/``, finished
rows in ``benchmarks/results/compress.json`` (rerun to resume; ``--force`` to redo; ``--quick`` runs keep
theirs in ``benchmarks/_cache/compress/quick.json`` so they never stand in for full rows). A stage W row
starts from its stage F row's cached rotations: its ``solve_seconds`` is stage W alone, ``stage_f_seconds``
the stage F row's.

Run: .venv/bin/python benchmarks/bench_compress.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_symmetry.assets import smollm2_dir, text_path
from hf_symmetry.conversion import compress as C
from hf_symmetry.evaluation.compare import load_model, load_tokenizer
from hf_symmetry.evaluation.perplexity import perplexity
from hf_symmetry.text import read_text, tokenize_text
from hf_symmetry.modeling.modeling_compressed_llama import structured_linear
from hf_symmetry.solvers.linalg import limit_threads

HERE = Path(__file__).resolve().parent
CACHE = HERE / "_cache" / "compress"
RESULTS = HERE / "results" / "compress.json"


# ----------------------------------------------------------------------------- caches
def cached_stats(source, config, calib_ids, seq_len) -> C.CalibrationStats:
    path = CACHE / f"stats_{calib_ids.numel()}_{seq_len}.safetensors"
    if path.is_file():
        t = load_file(str(path))
        n = sum(1 for k in t if k.startswith("normed."))
        L = sum(1 for k in t if k.startswith("attn_out."))
        return C.CalibrationStats(
            int(t["tokens"].item()),
            t["token_counts"],
            [t[f"normed.{k}"] for k in range(n)],
            [t[f"stream.{k}"] for k in range(n)],
            [t[f"attn_out.{i}"] for i in range(L)],
            [t[f"mlp_hidden.{i}"] for i in range(L)],
        )
    stats = C.collect_statistics(
        C.CompressRun(
            source,
            config,
            calib_ids=calib_ids,
            calibration=replace(C.CALIBRATION, tokens=calib_ids.numel(), seq_len=seq_len),
        ),
        want_normed=True,
        want_stream=True,
    )
    tensors = {"tokens": torch.tensor([stats.tokens]), "token_counts": stats.token_counts}
    for name in ("normed", "stream", "attn_out", "mlp_hidden"):
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in enumerate(getattr(stats, name))})
    CACHE.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return stats


def q_cache(key: str) -> Path:
    return CACHE / f"rotations_{key}.safetensors"


def load_rotations(key: str):
    path = q_cache(key)
    if not path.is_file():
        return None
    t = load_file(str(path))
    return [t[f"q{k}"] for k in range(len(t))]


def save_rotations(key: str, Qs) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    save_file({f"q{k}": Q.contiguous() for k, Q in enumerate(Qs)}, str(q_cache(key)))


# ----------------------------------------------------------------------------- timing
def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def model_forward_ms(model, ids, repeats) -> float:
    return 1000 * median_time(lambda: model(input_ids=ids[None], use_cache=False), repeats)


@torch.no_grad()
def paired_forward_ms(model, dense, ids, repeats) -> tuple[float, float]:
    """Median prefill times of ``model`` and ``dense``, timed alternately so that both see the same
    machine load (the machine is shared)."""
    a, b = [], []
    for m in (model, dense):
        m(input_ids=ids[None], use_cache=False)
    for _ in range(repeats):
        for m, times in ((model, a), (dense, b)):
            t = time.perf_counter()
            m(input_ids=ids[None], use_cache=False)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(a), 1000 * statistics.median(b)


@torch.no_grad()
def layer_timings(plans: dict, tokens: tuple[int, ...], repeats: int) -> list[dict]:
    """Each structured layer (random factors of the planned shapes) against the dense layer it replaces."""
    rows = []
    for structure, plan in plans.items():
        ms = plan.by_name()
        for name in ("layers.0.q_proj", "layers.0.gate_proj", "layers.0.down_proj", "embed"):
            m = ms[name]
            spec = m.module_structure.entry()
            out_f, in_f = m.module_structure.shape
            layer = structured_linear(in_f, out_f, spec)
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.05)
            dense = torch.nn.Linear(in_f, out_f, bias=False)
            for T in tokens:
                x = torch.randn(T, in_f)
                t_dense = median_time(lambda: dense(x), repeats)
                t_struct = median_time(lambda: layer(x), repeats)
                rows.append(
                    {
                        "structure": structure,
                        "matrix": "lm_head (tied embedding)" if name == "embed" else name,
                        "shape": [out_f, in_f],
                        "spec": spec,
                        "tokens": T,
                        "params_ratio": m.structure.params() / (out_f * in_f),
                        "dense_ms": 1000 * t_dense,
                        "structured_ms": 1000 * t_struct,
                        "speedup": t_dense / t_struct,
                    }
                )
    return rows


# ----------------------------------------------------------------------------- rows
def row_configs(f: int) -> list[dict]:
    """Cheap rows first, then the iterative ones (segment Q before global Q), so that a run cut short
    still has every method."""
    rows = [
        dict(name="SliceGPT (per-segment PCA)", structure="slice", q_mode="segment"),
        dict(name="SliceGPT (global PCA)", structure="slice", q_mode="global"),
    ]
    for structure in ("kron", "gs", "lowrank"):
        rows.append(
            dict(name=f"{structure}: projection, no rotation", structure=structure, stage="none", q_mode="global")
        )
    for stage in ("f", "w"):
        rows.append(
            dict(name=f"lowrank: stage {stage.upper()}", structure="lowrank", stage=stage, q_mode="global", f_iters=f)
        )
    for q_mode in ("segment", "global"):
        for structure in ("kron", "gs"):
            for stage in ("f", "w"):
                rows.append(
                    dict(
                        name=f"{structure}: stage {stage.upper()}, {q_mode} Q",
                        structure=structure,
                        stage=stage,
                        q_mode=q_mode,
                        f_iters=f,
                    )
                )
    for structure in ("gs", "kron"):  # stage W calibrated on the partly compressed model (sequential)
        rows.append(
            dict(
                name=f"{structure}: stage W, segment Q, sequential",
                structure=structure,
                stage="w",
                q_mode="segment",
                f_iters=f,
                sequential=True,
            )
        )
    rows.append(
        dict(
            name="lowrank: stage W, sequential",
            structure="lowrank",
            stage="w",
            q_mode="global",
            f_iters=f,
            sequential=True,
        )
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="4 stage-F iterations instead of 10, fewer timing repeats")
    ap.add_argument("--f-iters", type=int, help="stage F iterations (default: 10, 4 with --quick)")
    ap.add_argument("--force", action="store_true", help="recompute finished rows")
    ap.add_argument("--only", help="comma-separated substrings: run only matching rows (no layer timings)")
    ap.add_argument("--results", type=Path, help=f"results file (default: {RESULTS.relative_to(HERE.parent)})")
    args = ap.parse_args()
    torch.manual_seed(0)

    args.path = args.results if args.results is not None else CACHE / "quick.json" if args.quick else RESULTS
    results = json.loads(args.path.read_text()) if args.path.is_file() and not args.force else {}
    results.setdefault("rows", {})
    src_dir = smollm2_dir()
    model = load_model(src_dir)
    tok = load_tokenizer(src_dir)
    calib_ids = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=args.calib_tokens)
    eval_ids = tokenize_text(tok, read_text(text_path("britannica-eval")), max_tokens=args.eval_tokens)
    source = C.DictSource({k: v.detach() for k, v in model.state_dict().items()})
    config = model.config.to_dict()
    repeats = 3 if args.quick else 5
    prefill = eval_ids[:512]

    def ppl(m) -> float:
        return perplexity(m, eval_ids, window=512, stride=512, progress=False).perplexity

    if "dense" not in results["rows"] or args.force:
        results["rows"]["dense"] = {
            "name": "dense",
            "perplexity": ppl(model),
            "params": sum(p.numel() for p in model.parameters()),
            "forward_ms": model_forward_ms(model, prefill, repeats),
        }
    dense_ppl = results["rows"]["dense"]["perplexity"]
    dense_ms = results["rows"]["dense"]["forward_ms"]
    print(f"dense: perplexity {dense_ppl:.3f}, prefill {dense_ms:.0f} ms", flush=True)

    adapter = C.check_family(config, source.keys())
    stats = cached_stats(source, config, calib_ids, 512)
    layers, globals_, gamma = C.read_folded(
        source, adapter, source.keys(), C.plan_for(source, config, C.CompressOptions(stage="none"))[0].tied
    )
    if not args.only and ("layer_timings" not in results or args.force):  # first: a cut run still has them
        plans = {
            structure: C.plan_for(
                source, config, C.CompressOptions(structure=structure, stage="none", ratio=args.ratio)
            )[0]
            for structure in ("kron", "gs", "lowrank")
        }
        results["layer_timings"] = layer_timings(plans, (512, 2048), repeats)
        write(results, args)
    for r in results.get("layer_timings", []):
        print(
            f"{r['structure']:8s} {r['matrix']:24s} {r['tokens']:5d} tokens: dense {r['dense_ms']:.2f} ms, "
            f"structured {r['structured_ms']:.2f} ms (x{r['speedup']:.2f} faster, {r['params_ratio']:.2f} params)"
        )
    f_iters = args.f_iters if args.f_iters is not None else (4 if args.quick else 10)
    for cfg in row_configs(f_iters):
        name = cfg["name"]
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        options = C.CompressOptions(**{k: v for k, v in cfg.items() if k != "name"}, ratio=args.ratio)
        plan, _ = C.plan_for(source, config, options)
        if name in results["rows"] and not args.force:
            continue
        t0 = time.perf_counter()
        key = f"{options.structure}_{options.q_mode}_f{options.f_iters}_c{calib_ids.numel()}_{options.solver_dtype}"
        key += "" if args.ratio == 0.25 else f"_r{args.ratio:g}"  # the rotations depend on the structures
        rotations, solve_options = None, options
        if options.stage == "w" and options.structure != "lowrank":
            rotations = load_rotations(key)  # start from the cached stage F solution
            if rotations is not None:
                solve_options = C.CompressOptions(**{**cfg_without_name(cfg), "f_iters": 0}, ratio=args.ratio)
        # sequential calibration: the first calib_tokens ids in batches of calib_seq_len (512)
        run = C.CompressRun(source, config, solve_options, calib_ids, plan=plan, stats=stats, rotations=rotations)
        with limit_threads(1):
            res = C.solve.solve(run, layers, globals_)
        if options.stage == "f" and options.structure != "lowrank":
            save_rotations(key, res.Qs if options.q_mode == "segment" else res.Qs[:1])
        seconds = time.perf_counter() - t0
        state = C.Assembler(plan, layers, globals_, gamma, torch.float32).finish(res, progress=False)
        compressed, counted = C.build_model(state, C.compressed_config(config, plan, options, model.config))
        acc = plan.accounting
        row = {
            "name": name,
            **cfg_without_name(cfg),
            "perplexity": ppl(compressed),
            "params": counted,
            "ratio_over_compressed": acc.ratio_over_compressed,
            "ratio_over_model": acc.ratio_over_model,
            "ratio_structures_only": acc.ratio_per_matrix_mean,
            "skip_params": acc.skip_params,
            "head_mix_params": acc.head_mix_params,
            "residual_width": plan.residual,
            "solve_seconds": seconds,
            "mean_relative_error": (statistics.mean(res.relative_errors.values()) if res.relative_errors else None),
            "structures": {m.name: m.module_structure.entry() for m in plan.matrices if m.layer in (None, 0)},
        }
        if rotations is not None:
            f_row = results["rows"].get(name.replace("stage W", "stage F").replace(", sequential", ""), {})
            row["stage_f_seconds"] = f_row.get("solve_seconds")
        row["perplexity_vs_dense"] = row["perplexity"] / dense_ppl
        row["forward_ms"], row["dense_forward_ms"] = paired_forward_ms(compressed, model, prefill, repeats)
        row["forward_vs_dense"] = row["forward_ms"] / row["dense_forward_ms"]
        results["rows"][name] = row
        print(
            f"{name}: ppl {row['perplexity']:.3f} (x{row['perplexity_vs_dense']:.2f}), params {counted:,} "
            f"({row['ratio_over_compressed']:.3f} of compressed removed), solve {seconds:.0f} s, prefill "
            f"{row['forward_ms']:.0f} ms (x{row['forward_vs_dense']:.2f})",
            flush=True,
        )
        write(results, args)
        del compressed, state, res


def cfg_without_name(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "name"}


def write(results: dict, args) -> None:
    results["machine"] = {
        "cpu": _lscpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }
    results["settings"] = {
        "ratio": args.ratio,
        "calib_text": "britannica-calib",
        "calib_tokens": args.calib_tokens,
        "eval_text": "britannica-eval",
        "eval_tokens": args.eval_tokens,
        "perplexity_window": 512,
        "perplexity_stride": 512,
        "quick": args.quick,
        "f_iters": args.f_iters if args.f_iters is not None else (4 if args.quick else 10),
    }
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(json.dumps(results, indent=2) + "\n")


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor()


if __name__ == "__main__":
    main()
