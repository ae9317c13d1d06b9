"""The tables of each benchmark, drawn from its results file (see benchmarks/report.py).

A renderer takes the file's data and every results file by stem, and returns its tables by name; the
section's prose in ``benchmarks/sections/`` places them with ``{{name}}``. Files without a renderer here
are drawn by report.py's generic renderer.
"""

from __future__ import annotations

from report_compress import (
    RSS_FILES,
    calibration_rss,
    compress,
    compress_frontier,
    compress_frontier_segments,
    compress_r10,
    opt_vs_llama,
    stage_w_reference,
)
from report_tables import exp, fmt, md_table, sig


def rotate(data, results):
    rows = []
    for r in data["rows"]:
        rot, plain = r["rotate"], r["transformers_load_save"]
        rows.append(
            [
                r["checkpoint"],
                f"{r['checkpoint_mb']:.0f} MB",
                f"{rot['seconds']:.1f} s / {rot['peak_rss_mb']:.0f} MiB",
                f"{plain['seconds']:.1f} s / {plain['peak_rss_mb']:.0f} MiB",
                f"{r['time_ratio']:.2f}",
                f"**{100 * r['rotate_rss_fraction_of_checkpoint']:.1f} %**",
            ]
        )
    base = data["import_baseline"]
    return {
        "rotate": md_table(
            [
                "checkpoint",
                "size",
                "rotate: time / peak RSS",
                "transformers load + save: time / peak RSS",
                "time ratio",
                "rotate RSS / checkpoint",
            ],
            rows,
        ),
        "import": f"{base['peak_rss_mb']:.0f} MiB",
    }


def match_merge(data, results):
    ind = data["independent"]
    rows = []
    for name, ppl in ind["perplexity"].items():
        key = name.split(", ", 1)[1] if name.startswith("average, ") else None
        dist = ind["distance"].get(key) if key else None
        moved = f"{dist['relative_before']:.3f} → {dist['relative_after']:.3f}" if dist else ""
        rows.append([name, f"{ppl:.1f}", moved])
    fine = data["finetune"]["perplexity"]
    frows = [[name, f"{v['britannica']:.3f}", f"{v['hamlet']:.3f}"] for name, v in fine.items()]
    t = data["time"]
    trows = [
        [job, f"{s:.1f}", fmt(t["ratio_match_to_mergekit"].get(job), 2) if job in t["ratio_match_to_mergekit"] else "1"]
        for job, s in t["best_seconds"].items()
    ]
    return {
        "independent": md_table(["model", "perplexity", "relative distance ‖B − A‖/‖A‖ before → after"], rows),
        "finetune": md_table(["model", "britannica (perplexity)", "hamlet (perplexity)"], frows),
        "time": md_table(["job", "seconds (best of 2)", "× mergekit"], trows),
    }


def tpa(data, results):
    kv = []
    mha = data["kv_cache"][next(iter(data["kv_cache"]))]["bytes_per_token"]
    for name, v in data["kv_cache"].items():
        tot = v["total_bytes"]
        kv.append(
            [
                name,
                f"{v['bytes_per_token']:.0f}",
                f"{tot['1k'] / 2**20:.1f} MiB",
                f"{tot['8k'] / 2**20:.1f} MiB",
                f"{tot['32k'] / 2**20:.1f} MiB",
                f"{v['bytes_per_token'] / mha:.3f}",
            ]
        )
    contexts = list(data["decode_latency"])
    names = list(data["decode_latency"][contexts[0]])
    lat = [
        [name]
        + [
            f"{data['decode_latency'][c][name]['ms_per_token']:.2f} ({data['decode_latency'][c][name]['vs_mha']:.2f}×)"
            for c in contexts
        ]
        for name in names
    ]
    curve = data["smollm2_rank_curve"]
    src = curve["rows"][0]["cache_elements_per_token"]
    ranks = []
    for r in curve["rows"]:
        k, v = r.get("mean_k_activation_rel_err"), r.get("mean_v_activation_rel_err")
        err = "" if k is None else f"{fmt(round(k, 3))} / {fmt(round(v, 3))}"
        ranks.append(
            [
                r["k_rank"],
                r["v_rank"],
                r["variant"],
                r["cache_elements_per_token"],
                f"{r['cache_elements_per_token'] / src:.2f}",
                f"{r['perplexity']:.2f}",
                err,
            ]
        )
    return {
        "kv_cache": md_table(
            ["model", "bytes/token (all layers)", "1k tokens (measured)", "8k tokens", "32k tokens", "vs MHA"], kv
        ),
        "decode": md_table(["model"] + [f"context {c}" for c in contexts], lat),
        "smollm2": md_table(
            ["R_K", "R_V", "variant", "cache elements/token", "vs source", "perplexity", "rel. activation error K / V"],
            ranks,
        ),
    }


def _farr_rows(points, digits):
    rows = []
    for p in points:
        ranks = p.get("ranks", {})
        dims = " / ".join(f"{min(v)}–{max(v)}" if min(v) != max(v) else f"{v[0]}" for v in ranks.values())
        cells = [
            fmt(p.get(k), digits) if isinstance(p.get(k), float) and p.get(k) != 1.0 else fmt(p.get(k))
            for k in ("farr", "farr-cal", "trunc-V", "trunc-O")
        ]
        rows.append(
            [
                p["point"],
                dims,
                f"{100 * p['kept_fraction']:.1f} %",
                f"{p['removed']:,} ({p['removed_pct_model']:.2f} %)",
                *cells,
            ]
        )
    return rows


def farr(data, results):
    cols = [
        "point",
        "head dims per layer",
        "params kept",
        "params removed (% of model)",
        "FaRR",
        "FaRR calibrated",
        "truncate W_V (W_K)",
        "truncate W_O (W_Q)",
    ]
    return {
        "smollm2": md_table(cols, _farr_rows(data["smollm2"]["vo"], 2)),
        "minilm_vo": md_table(cols, _farr_rows(data["minilm"]["vo"], 4)),
        "minilm_qkvo": md_table(cols, _farr_rows(data["minilm"]["qk+vo"], 4)),
        "original": f"{data['smollm2']['original']:.2f}",
    }


def publish(data, results):
    card, pre, push, down = data["card"], data["prepush_check"], data["push"], data["download"]
    ex = card["exactness"]
    rows = [
        [
            "card written by `rotate`",
            (
                f"max \\|Δlogit\\| {ex['max_abs_dlogit']:.3e} over {ex['tokens']} tokens; perplexity "
                f"{ex['perplexity_converted']:.4f} (original {ex['perplexity_original']:.4f}); "
                f"{card['size']['parameters']:,} parameters"
            ),
        ],
        [
            "pre-push load check (a Python without hf_symmetry)",
            f"max \\|Δ\\| vs hf_symmetry's load {pre['max_abs_diff']}; {pre['seconds']:.0f} s",
        ],
        [
            "push (one commit)",
            (
                f"{len(push['files'])} files, {push['bytes'] / 1e6:.1f} MB, {push['seconds']:.0f} s, "
                f"{push['commits']} commit"
            ),
        ],
        [
            "`from_pretrained` from the fake Hub, no hf_symmetry",
            (
                f"max \\|Δlogit\\| vs original {down['max_abs_dlogit_vs_original']:.3e}; vs the local folder "
                f"{down['max_abs_dlogit_vs_local_folder']}; {down['seconds_incl_load_and_forward']:.0f} s"
            ),
        ],
    ]
    sm = data["lm_eval_smoke"]
    lm = [
        [name, f"{sm[name]['acc']:.4f}", f"{sm[name]['acc_norm']:.4f}", f"{sm[name]['seconds']:.0f}"]
        for name in ("original", "rotated")
    ]
    return {
        "steps": md_table(["step", "figure"], rows),
        "lm_eval": md_table(["model", "acc", "acc_norm", "seconds"], lm),
    }


def families_exactness(data, results):
    rows = [
        [r["model_type"], ", ".join(r["applied"]), r["output_model_type"], exp(r["max_abs_dlogit_float64"])]
        for r in data["tiny"]
    ]
    real = [
        [
            r["model"],
            ", ".join(r["applied"]),
            r["tokens"],
            exp(r["max_abs_dlogit_float32"]),
            f"{r['logit_scale']:.1f}",
            f"{100 * r['argmax_agreement']:.0f} %",
        ]
        for r in data["real"]
    ]
    return {
        "tiny": md_table(["family", "applied", "output", "max \\|Δlogit\\| (float64)"], rows),
        "real": md_table(
            ["model", "applied", "tokens", "max \\|Δlogit\\| (float32)", "logit scale", "greedy agreement"], real
        ),
    }


def t6_training(data, results):
    names = {"t6": "T6 (TPA)", "mha": "Llama MHA", "gqa": "Llama GQA", "mla": "MLA"}
    mha = data["summary"]["mha"]["training_tokens_per_second"]
    rows = []
    for key, s in data["summary"].items():
        loss = " / ".join(f"{x:.3f}" for x in s["final_eval_loss"])
        ppl = " / ".join(f"{x:.0f}" for x in s["final_eval_perplexity"])
        rows.append(
            [
                names.get(key, key),
                s["heads"],
                f"{s['kv_cache_bytes_per_token_bf16']:,} B",
                loss,
                ppl,
                f"{s['training_tokens_per_second']:.0f} ({s['training_tokens_per_second'] / mha:.2f}× MHA)",
            ]
        )
    routes = [
        [name, f"{r['multiply_adds_fwd_per_sequence'] / 1e6:.1f} M", f"{r['seconds']:.2f}"]
        for name, r in data["attention_layer"]["routes"].items()
        if isinstance(r, dict)
    ]
    return {
        "main": md_table(
            [
                "model",
                "heads",
                "KV cache per token (bf16)",
                "final val. loss seed 0 / 1",
                "val. perplexity seed 0 / 1",
                "training tokens / CPU-second",
            ],
            rows,
        ),
        "routes": md_table(["route", "forward multiply-adds / sequence", "CPU seconds"], routes),
    }


def _none(data, results):
    return {}


def _ratio_at(curve, text, tokens, dense_curve):
    point = next((p for p in dense_curve if p["tokens"] == tokens), None)
    mine = next((p for p in curve if p["tokens"] == tokens), None)
    return None if point is None or mine is None else mine[text] / point[text]


HEAL_NAMES = {
    "dense": "dense (control)",
    "slice25": "SliceGPT 25 %",
    "tpa22": "TPA k/v rank 2",
    "lowrank_seq": "low rank 25 %, `--sequential`",
    "farr08": "FaRR 0.8 of V/O",
}


def heal(data, results):
    dense = data["models"]["dense"]["curve"]
    rows = []
    for key, m in data["models"].items():
        curve = [p for p in m["curve"] if p["step"] == 0 or p["tokens"]]
        texts = [t for t in curve[0] if t not in ("step", "tokens")]
        cells = [" → ".join(f"{p[t]:.1f}" for p in curve) for t in texts]
        last = curve[-1]["tokens"]
        ratios = " / ".join(fmt(_ratio_at(curve, t, last, dense), 2) for t in texts)
        rows.append(
            [
                HEAL_NAMES.get(key, key),
                f"{m['parameters'] / 1e6:.1f} M",
                f"{m['learning_rate']:g}",
                f"{m['train_tokens']:,}",
                *cells,
                ratios,
                f"{m['heldout_kl_before']:.3f} → {m['heldout_kl_after']:.3f}",
                f"{m['tokens_per_cpu_second']:.0f}",
            ]
        )
    texts = [t for t in data["models"]["dense"]["curve"][0] if t not in ("step", "tokens")]
    points = " → ".join(f"{p['tokens'] // 1024} K" if p["tokens"] else "before" for p in dense)
    return {
        "main": md_table(
            ["student", "parameters", "lr", "training tokens"]
            + [f"{t}: {points}" for t in texts]
            + [f"× fine-tuned dense after ({' / '.join(texts)})", "held-out KL to teacher", "tokens per CPU-s"],
            rows,
        )
    }


def heal_recipes(data, results):
    """A `bench_heal.py` results file (runs by `model/recipe`), on any device."""
    runs = data["runs"]
    dense = next((r for r in runs.values() if r["model"] == "dense"), None)
    texts = [t for t in next(iter(runs.values()))["curve"][0] if t not in ("step", "tokens")]
    rows = []
    for r in runs.values():
        first, last = r["curve"][0], r["curve"][-1]
        cells = [f"{first[t]:.1f} → {last[t]:.1f}" for t in texts]
        ratio = (
            "—" if dense is None or r is dense else " / ".join(f"{last[t] / dense['curve'][-1][t]:.2f}" for t in texts)
        )
        rows.append(
            [HEAL_NAMES.get(r["model"], r["model"]), r["recipe"], *cells, ratio, f"{r['tokens_per_wall_second']:,.0f}"]
        )
    return {
        "main": md_table(
            ["student", "recipe"]
            + [f"{t} before → after" for t in texts]
            + [f"× dense ({' / '.join(texts)})", "tokens/s"],
            rows,
        )
    }


QUANT_NAMES = {
    "original": "original",
    "hadamard": "plain Hadamard residual rotation",
    "for-quantization": "`--for-quantization --residual hadamard --scales none` (QuaRot-style)",
    "for-quantization-learned-Q4_0": "`--for-quantization --learn Q4_0`",
    "for-quantization-no-residual": "no residual rotation (V/O + balancing only)",
    "for-quantization-hold-out": "`--for-quantization --hold-out` (the massive channels)",
    "scales": "`--for-quantization` (the default preset: activation-aware scales, searched per column)",
    "scales-sorted": "`--for-quantization --sort-channels`",
    "scales-pow2": "the same with `--pow2-scales`",
    "scales-vo": "the same with `--vo-hadamard`",
    "hadamard-scales": "`--for-quantization --residual hadamard` with scales",
}


def _quant_name(name: str) -> str:
    base, _, rest = name.partition(" (")  # "scales (calibration 16384)"
    return QUANT_NAMES.get(base, f"`{base}`") + (f" ({rest}" if rest else "")


def quant_rotation(data, results):
    """One table per model (a top-level entry with ``variants``), and the goals."""
    out = {}
    for model, block in data.items():
        if not isinstance(block, dict) or not isinstance(block.get("variants"), dict):
            continue
        variants = block["variants"]
        schemes = []
        for v in variants.values():
            schemes += [k for k, x in v.items() if isinstance(x, dict) and k not in schemes]
        rows = [
            [_quant_name(name), sig(v.get("float"), 4)]
            + [sig(v[q]["perplexity"], 4) if q in v else "—" for q in schemes]
            for name, v in variants.items()
        ]
        out[model] = md_table(["variant", "float"] + schemes, rows)
    goals = data.get("goals", {})
    rows = []
    for model, goal in goals.items():
        if isinstance(goal, dict):
            rows += [[model, key, fmt(value)] for key, value in goal.items()]
        else:
            rows.append([model, "", fmt(goal)])
    if rows:
        out["goals"] = md_table(["model", "goal", "value"], rows)
    return out


def compat(data, results):
    return {"main": data["table"].strip(), "range": " to ".join(data["supported_range"])}


def gguf_llamacpp(data, results):
    """Per exported variant and pre-tokenizer name: identical token sequences and greedy texts in llama.cpp."""
    rows = []
    for variant, block in data["variants"].items():
        for pre, tok in block["tokenization"].items():
            gen = [g[pre] for g in block.get("generation", []) if pre in g]
            rows.append(
                [
                    variant,
                    f"`{pre}`",
                    f"{tok['identical']}/{tok['sequences']}",
                    fmt(tok["tokens_llama_cpp"], sep=True),
                    fmt(tok["tokens_hf"], sep=True),
                    f"{sum(g['same_prompt_ids'] for g in gen)}/{len(gen)}",
                    f"{sum(g['same_text'] for g in gen)}/{len(gen)}",
                ]
            )
    columns = [
        "variant",
        "tokenizer.ggml.pre",
        "identical token sequences",
        "tokens (llama.cpp)",
        "tokens (transformers)",
        "prompt ids equal",
        f"greedy {data.get('new_tokens', '')} tokens equal",
    ]
    return {"main": md_table(columns, rows)}


RENDERERS = {
    "rotate": rotate,
    "match_merge": match_merge,
    "tpa": tpa,
    "compress": compress,
    "compress_f10": _none,
    "compress_damping": _none,
    "compress_r10": compress_r10,
    "compress_frontier": compress_frontier,
    "compress_frontier_segments": compress_frontier_segments,
    "farr": farr,
    "publish": publish,
    "families_exactness": families_exactness,
    "opt_vs_llama": opt_vs_llama,
    "stage_w_reference": stage_w_reference,
    "t6_training": t6_training,
    "heal": heal,
    "heal_gpu_h200": heal_recipes,
    "quant_rotation": quant_rotation,
    "quant_rotation_bnb": quant_rotation,
    "quant_rotation_control": quant_rotation,
    "compat": compat,
    "gguf_llamacpp": gguf_llamacpp,
    **{stem: (calibration_rss if stem == RSS_FILES[0] else _none) for stem in RSS_FILES},
}


def renderer_for(stem: str, data: object):
    """The renderer of a results file: by its stem, or by its shape for files a benchmark script writes under
    a new name (``bench_heal.py --results heal_*.json``)."""
    if stem in RENDERERS:
        return RENDERERS[stem]
    if stem.startswith("heal") and isinstance(data, dict) and isinstance(data.get("runs"), dict):
        return heal_recipes
    return None
