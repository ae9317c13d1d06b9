"""The tables of benchmarks/results/tpa_decode.json (written by bench_tpa_decode.py from its runs)."""

from __future__ import annotations

LABELS = {
    "source": "source (SDPA)",
    "source-hqq4": "source + QuantizedCache HQQ 4-bit",
    "source-hqq2": "source + QuantizedCache HQQ 2-bit",
    "tpa-exact": "TPA exact",
    "tpa-r2": "TPA k/v rank 2",
    "tpa-r1": "TPA k/v rank 1",
    "tpa-exact-q4": "TPA exact + 4-bit factor cache",
    "tpa-r2-q4": "TPA k/v rank 2 + 4-bit factor cache",
    "tpa-r2-q2": "TPA k/v rank 2 + 2-bit factor cache",
    "tpa-r2-healed": "TPA k/v rank 2, healed (2^15 tokens)",
    "tpa-r2-healed-q4": "TPA k/v rank 2, healed (2^15 tokens) + 4-bit factor cache",
}
ORDER = list(LABELS)


def _f(value, digits=1):
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _route(record):
    route = record.get("route") or {}
    return "; ".join(f"{phase}: {', '.join(route[phase])}" for phase in ("prefill", "decode") if route.get(phase))


def tables(runs: list[dict]) -> list[dict]:
    ok = [r for r in runs if "error" not in r]
    by = {(r["config"], r["mode"], r.get("context"), r.get("batch")): r for r in ok}
    order = {c: i for i, c in enumerate(ORDER)}
    eager = sorted(
        (r for r in ok if r["mode"] == "eager"), key=lambda r: (r["context"], r["batch"], order[r["config"]])
    )
    # one row per L x batch x configuration: its eager run, or its live run where only that was measured
    primary: dict[tuple, dict] = {}
    for r in ok:
        if r["mode"] in ("eager", "live"):
            k = (r["context"], r["batch"], r["config"])
            if r["mode"] == "eager" or k not in primary:
                primary[k] = r
    rows = []
    for _, r in sorted(primary.items(), key=lambda item: (item[0][0], item[0][1], order[item[0][2]])):
        if r["mode"] == "live":  # (no plain run: its resident-set columns are the live run's own)
            r = {**r, "decode_peak_mb": None}
        src = by.get(("source", "eager", r["context"], r["batch"]))
        comp = by.get((r["config"], "compiled", r["context"], r["batch"]))
        live = by.get((r["config"], "live", r["context"], r["batch"]))
        live_src = by.get(("source", "live", r["context"], r["batch"]))
        measured = r["decode_peak_mb"] is not None and src and src["decode_peak_mb"] > 0
        ratio = r["decode_peak_mb"] / src["decode_peak_mb"] if measured else None
        live_ratio = live["decode_peak_mb"] / live_src["decode_peak_mb"] if live and live_src else None
        rows.append(
            [
                f"{r['context']} × {r['batch']}",
                LABELS[r["config"]],
                _f(r["cache_mb"]),
                _f(r["formula_mb"]),
                _f(r["decode_peak_mb"], 0),
                _f(ratio, 2),
                f"{live['decode_peak_mb']:.0f} ({live_ratio:.2f})" if live and live_ratio else "–",
                _f(r["prefill_s"]),
                _f(r["decode_ms"], 0),
                _f(comp["decode_ms"], 0) if comp else "–",
            ]
        )
    decode = {
        "name": "decode",
        "caption": "Eager `generate` (32 new tokens): cache MB held after generate (measured, and by the formula), "
        "peak decode MB above the level before generate and its ratio to the source's in the same row group, "
        "the same with glibc's mmap threshold at 64 KiB (freed tensors leave the resident set at once: the peak of "
        "live memory) where measured, prefill seconds, decode ms/token of this one run (the side-by-side table "
        "compares speeds under equal load); compiled ms/token from the static-cache run where there is one.",
        "columns": [
            "L × batch",
            "configuration",
            "cache MB",
            "formula MB",
            "peak decode MB",
            "× source",
            "live peak MB (× source)",
            "prefill s",
            "eager ms/token",
            "compiled ms/token",
        ],
        "rows": rows,
    }
    compiled = sorted((r for r in ok if r["mode"] == "compiled"), key=lambda r: (r["context"], order[r["config"]]))
    comp_rows = []
    for r in compiled:
        dyn = by.get((r["config"], "eager", r["context"], r["batch"]))
        comp_rows.append(
            [
                f"{r['context']} × {r['batch']}",
                LABELS[r["config"]],
                _f(dyn["decode_ms"], 0) if dyn else "–",
                _f(r["static_eager_ms"], 0),
                _f(r["decode_ms"], 0),
                _f(r["compile_s"], 0),
                _f(r["cache_mb"]),
                r.get("cache_layer", ""),
            ]
        )
    comp_table = {
        "name": "compiled",
        "caption": "Compiled decoding: `torch.compile(model.forward, fullgraph=True)` steps with a static cache "
        "(preallocated for L + 43 tokens), against eager decoding with the dynamic cache (`generate`) and "
        "with the same static cache; ms/token; compile s = the two warm-up steps.",
        "columns": [
            "L × batch",
            "configuration",
            "eager (dynamic) ms",
            "eager (static) ms",
            "compiled ms",
            "compile s",
            "static cache MB",
            "cache layer",
        ],
        "rows": comp_rows,
    }
    quality = []
    for config in ORDER:
        p = by.get((config, "ppl", None, None))
        sizes = [r for r in eager if r["config"] == config]
        per_token = None
        if sizes:
            big = max(sizes, key=lambda r: (r["context"], r["batch"]))
            per_token = 1e6 * big["cache_mb"] / big["cache_tokens"] / big["batch"] / 1024
        if p or sizes:
            quality.append(
                [
                    LABELS[config],
                    _f(per_token, 2),
                    _f(p.get("ppl_model") if p else None, 2),
                    _f(p.get("ppl_cache") if p else None, 2),
                    _route(max(sizes, key=lambda r: r["context"])) if sizes else "",
                ]
            )
    qual = {
        "name": "quality",
        "caption": "Bytes per token (KiB, all 30 layers, measured at the largest run: residual window included), "
        "held-out perplexity on hamlet (the model: 2048 tokens, window 512, stride 256, no cache; through the "
        "cache: 512-token prefill then 256 tokens one at a time through the configured cache), and the attention "
        "route taken (layer 0).",
        "columns": ["configuration", "KiB/token", "perplexity (model)", "perplexity (through cache)", "route"],
        "rows": quality,
    }
    lat_rows = []
    for r in sorted((r for r in ok if r["mode"] == "latency"), key=lambda r: (r["context"], r["batch"])):
        for config in ORDER:
            m = r["latency"].get(config)
            if not m:
                continue

            def cell(variant, m=m):
                v = m.get(variant)
                return f"{v['best_ms']:.0f} ({v['median_ms']:.0f})" if v else "–"

            lat_rows.append(
                [
                    f"{r['context']} × {r['batch']}",
                    LABELS[config],
                    cell("eager"),
                    cell("static eager"),
                    cell("compiled"),
                    _f(m.get("compile_s"), 0),
                ]
            )
    latency = {
        "name": "latency",
        "caption": "Decode ms/token side by side (one process, every configuration prefilled, then interleaved "
        "rounds of 4 steps each: best round (median round)): eager with the dynamic (or quantized) cache, eager "
        "with a static cache, and `torch.compile(model.forward, fullgraph=True)` with the static cache.",
        "columns": ["L × batch", "configuration", "eager", "static eager", "compiled", "compile s"],
        "rows": lat_rows,
    }
    return [decode, latency, comp_table, qual]
