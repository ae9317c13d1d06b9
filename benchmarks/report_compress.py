"""The compression and calibration-memory tables (see report_sections.py)."""

from __future__ import annotations

import re

from report_tables import fmt, gb, md_table, sig


def _compress_rows(rows, dense):
    out = []
    for r in rows:
        if r["name"] == "dense":
            out.append(["dense", "—", f"{r['perplexity']:.2f}", "1.00", f"{r['params']:,}", "—", "—", "1.00"])
            continue
        q = {"segment": "per segment", "global": "global"}[r["q_mode"]] if r.get("stage") != "none" else "none (I)"
        if r["structure"] == "lowrank" or r["structure"] == "slice":
            q = {"segment": "per segment", "global": "global"}[r["q_mode"]] if r["structure"] == "slice" else "none (I)"
        solve = f"{r['solve_seconds']:.0f}"
        if r.get("stage_f_seconds") and r.get("stage") == "w":
            solve += f" (+{r['stage_f_seconds']:.0f})"
        iters = (
            f", {r['f_iters']} F alternations"
            if r.get("f_iters") and r["structure"] != "lowrank" and r.get("stage") != "none"
            else ""
        )
        out.append(
            [
                r["name"] + iters,
                q,
                sig(r["perplexity"]),
                sig(r["perplexity"] / dense, 3),
                f"{r['params']:,}",
                f"{100 * r['ratio_structures_only']:.1f} %",
                solve,
                f"{r['forward_vs_dense']:.2f}",
            ]
        )
    return out


COMPRESS_COLUMNS = [
    "method",
    "Q",
    "perplexity",
    "× dense",
    "parameters",
    "structures alone remove",
    "solve s",
    "prefill × dense",
]


def compress(data, results):
    dense = data["rows"]["dense"]["perplexity"]
    rows = list(data["rows"].values())
    extra = results.get("compress_f10")
    if isinstance(extra, dict):
        rows += [r for r in extra["rows"].values() if r["name"] != "dense"]
    timings: dict[tuple, dict] = {}
    for t in data["layer_timings"]:
        spec = ", ".join(f"{k}={v}" for k, v in t["spec"].items() if k != "type")
        key = (f"{t['structure']} `{spec}`", f"{t['matrix']} {list(t['shape'])}", f"{t['params_ratio']:.2f}")
        timings.setdefault(key, {})[t["tokens"]] = t
    tokens = sorted({n for v in timings.values() for n in v})
    trows = [
        list(key)
        + [
            f"{v[n]['dense_ms']:.2f} / {v[n]['structured_ms']:.2f} ({v[n]['structured_ms'] / v[n]['dense_ms']:.2f}×)"
            if n in v
            else "—"
            for n in tokens
        ]
        for key, v in timings.items()
    ]
    damping = [
        ["one pass", "0.01 (default)", sig(data["rows"]["lowrank: stage W"]["perplexity"])],
        ["sequential", "0.01 (default)", sig(data["rows"]["lowrank: stage W, sequential"]["perplexity"])],
    ]
    for r in results.get("compress_damping", []) or []:
        damping.append(["sequential" if r["sequential"] else "one pass", fmt(r["damping"]), sig(r["ppl"])])
    damping.sort(key=lambda r: (r[0], r[1]))
    return {
        "main": md_table(COMPRESS_COLUMNS, _compress_rows(rows, dense)),
        "layers": md_table(
            ["structure", "matrix [out, in]", "params kept"] + [f"{n} tokens: dense / structured ms" for n in tokens],
            trows,
        ),
        "damping": md_table(["low rank stage W", "damping δ", "perplexity"], damping),
    }


def compress_r10(data, results):
    dense = data["rows"]["dense"]["perplexity"]
    return {"main": md_table(COMPRESS_COLUMNS, _compress_rows(list(data["rows"].values()), dense))}


def compress_frontier(data, results):
    rows = []
    total = data["rows"]["dense"]["params"]
    for name, r in data["rows"].items():
        removed = "" if name == "dense" else f"{100 * (1 - r['params'] / total):.1f} %"
        ppl = r["perplexity"]
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f} M",
                removed,
                f"{ppl['britannica-eval']:.2f}",
                f"{ppl['hamlet']:.2f}",
                fmt(r.get("cpu_seconds"), 0),
                f"{r['peak_rss_gb']:.2f} GB",
            ]
        )
    return {
        "main": md_table(
            ["row", "parameters", "removed from the model", "britannica-eval", "hamlet", "CPU s", "peak RSS"], rows
        )
    }


def compress_frontier_segments(data, results):
    rows = []
    for seg, methods in data["segments"].items():
        for method, r in methods.items():
            errs = r.get("relative_errors", {})
            mean = sum(errs.values()) / len(errs) if errs else None
            rows.append(
                [
                    seg,
                    method,
                    f"{r['paper_objective']:.2f}",
                    f"{r['relative']:.3f}",
                    fmt(mean, 3),
                    fmt(r.get("alternations")),
                    fmt(r.get("cpu_seconds"), 0),
                ]
            )
    return {
        "main": md_table(
            [
                "segment",
                "method",
                "paper objective",
                "relative",
                "mean relative Frobenius error",
                "alternations",
                "CPU s",
            ],
            rows,
        )
    }


def opt_vs_llama(data, results):
    m = data["models"]
    rows = []
    for o, ll in zip(m["opt"]["sliced"], m["llama"]["sliced"]):
        rows.append(
            [
                f"SliceGPT {o['ratio']} (width {o['residual_width']} / {ll['residual_width']})",
                f"{o['sliced_params'] / 1e6:.2f} M",
                f"{o['perplexity_sliced']:.2f}",
                f"{o['perplexity_ratio']:.4f}",
                f"{ll['sliced_params'] / 1e6:.2f} M",
                f"{ll['perplexity_sliced']:.2f}",
                f"{ll['perplexity_ratio']:.4f}",
            ]
        )
    for o, ll in zip(m["opt"]["structured"], m["llama"]["structured"]):
        rows.append(
            [
                f"{o['structure']} {o['ratio']} (achieved {o['ratio_over_compressed']:.3f}"
                f" / {ll['ratio_over_compressed']:.3f})",
                f"{o['params'] / 1e6:.2f} M",
                f"{o['perplexity']:.2f}",
                f"{o['perplexity_ratio']:.4f}",
                f"{ll['params'] / 1e6:.2f} M",
                f"{ll['perplexity']:.2f}",
                f"{ll['perplexity_ratio']:.4f}",
            ]
        )
    head = [
        "method",
        "OPT params",
        f"OPT perplexity (dense {m['opt']['perplexity_dense']:.2f})",
        "× dense",
        "Llama params",
        f"Llama perplexity (dense {m['llama']['perplexity_dense']:.2f})",
        "× dense",
    ]
    return {"main": md_table(head, rows)}


def stage_w_reference(data, results):
    labels = {
        "start": "start (stage F rotation, weighted projection)",
        "ours_one_alternation": "ours, one alternation",
        "ours_converged": "ours, to convergence",
        "reference_500": "reference, 500 Cayley-CG steps",
    }
    rows = []
    for seg, solvers in data["segments"].items():
        for key, r in solvers.items():
            label = labels.get(key, key)
            if (r.get("alternations") or 0) > 1:
                label += f" ({r['alternations']} alternations)"
            rows.append(
                [seg, label, f"{r['paper_objective']:.2f}", f"{r['reference_loss']:.2f}", fmt(r.get("cpu_seconds"), 1)]
            )
    return {"main": md_table(["segment", "solver", "paper objective", "reference's own loss", "CPU s"], rows)}


RSS_FILES = [
    "calibration_rss",
    "calibration_rss_compress",
    "calibration_rss_regmean",
    "calibration_rss_tpa_farr",
    "calibration_rss_lowrank",
]
RSS_JOBS = {
    "to-tpa": "`to-tpa --k-rank 2 --v-rank 2 --calib`",
    "farr": "`farr --params-fraction 0.8 --calibrate`",
    "regmean": "`merge --method regmean A A`",
    "slice": "`compress --structure slice`",
    "lowrank-seq": "`compress --structure lowrank --sequential`",
    "lowrank": "`compress --structure lowrank` (one pass)",
    "kron-global-f": "`compress --structure kron --stage f --q-mode global --f-iters 2`",
    "plain": "plain `from_pretrained` + forward",
}


def calibration_rss(data, results):
    """The latest run of each job on each checkpoint (files in RSS_FILES order, runs in file order)."""
    latest: dict[tuple, dict] = {}
    for stem in RSS_FILES:
        for run in (results.get(stem) or {}).get("runs", []):
            if run.get("label") == "before" or not run.get("peak_rss_bytes"):
                continue
            key = (run["job"], run["shape"], run["layers"], run["tokens"])
            latest.pop(key, None)
            latest[key] = run
    order = list(RSS_JOBS)
    runs = sorted(
        latest.values(), key=lambda r: (order.index(r["job"]) if r["job"] in order else 99, r["checkpoint_bytes"])
    )
    rows = []
    for r in runs:
        shape = "Llama-3-8B shapes, bf16" if r["shape"] == "llama3-8b" else "width 1536"
        commit = r["label"] if re.fullmatch(r"[0-9a-f]{7}", r.get("label", "")) else "—"
        layers = f"{r['layers']} layer" + ("s" if r["layers"] != 1 else "")
        rows.append(
            [
                f"{r['checkpoint_bytes'] / 1e9:.2f} GB ({layers}, {shape})",
                RSS_JOBS.get(r["job"], r["job"]),
                r["tokens"],
                gb(r["peak_rss_bytes"]),
                f"**{r['rss_over_checkpoint']:.3f}**",
                f"{r['cpu_seconds']:.0f}",
                fmt(r.get("cpu_over_plain"), 2),
                commit,
            ]
        )
    return {
        "main": md_table(
            ["checkpoint", "job", "calibration tokens", "peak RSS", "RSS / checkpoint", "CPU s", "CPU / plain", "code"],
            rows,
        )
    }
