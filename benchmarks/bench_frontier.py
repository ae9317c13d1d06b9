"""The frontier (issue 47): held-out perplexity of SmolLM2-135M-Instruct against bytes, for the source, the
source quantized as users do, each lossy conversion at two sizes, and the conversions followed by the same
quantizers, so that a user with a byte budget can read off which pipeline to choose.

Bytes = weights as stored + the KV cache of 2048 tokens at batch 1:

* weights: every tensor of the checkpoint once (a tied head counted once) at 16 bits (bfloat16: what users
  deploy), or at 32 bits for the float32 source; a quantized tensor at its quantizer's bits per weight (scales
  and zero points included, ``weight_quant.bits_per_weight``). Quantized are the decoder layers' ``nn.Linear``
  weights (what bitsandbytes' ``load_in_4bit`` and HQQ replace); embeddings, head and norms stay 16-bit. A
  weight whose input dimension is not a whole number of the quantizer's groups (FaRR's per-layer head dims,
  SliceGPT's residual width) is zero-padded to the next group and counted at the padded size.
* KV cache: layers x (key + value widths) x 2048 x bytes per element (16-bit; 32-bit for the float32 source),
  the widths read from the config: ``kv_heads x head_dim`` for keys and values (FaRR: each layer's value head
  dim; TPA: its ``(R_K + R_V) x head_dim`` factor cache, the non-contextual A is a weight). llama.cpp's GGUF rows
  add the same 16-bit cache to the file's size (llama.cpp's default cache type is f16).

Perplexity: the project's definition (window 512, stride 256, the first 2048 tokens of Hamlet and
britannica-eval), the quantized weights dequantized back into the float32 model (weight_quant). Conversions
are written once by the CLI under benchmarks/_out/frontier (:data:`CONVERSIONS`, ``--no-verify``), each
quantized point evaluated in a fresh process.

Rows measured elsewhere are reused where they are the same measurement and say where they come from:
GGUF Q4_K_M / Q3_K_M without an importance matrix on Hamlet (quant_kquants.json: llama-quantize's file read
back through transformers, the project's definition); with an importance matrix only llama.cpp's own
``llama-perplexity`` exists (quant_llamacpp.json, chunks of 512, its own definition): those rows carry the
source's project perplexity times their ratio to the F32 GGUF on llama.cpp's definition, marked as scaled;
healed conversions (heal.json: 16,384 tokens, the default recipe then, measured with the earlier tokenizer).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_frontier.py [--texts hamlet britannica-eval]
[--only NAME,...]; reruns resume (``--force`` redoes points); ``--plot`` only redraws the plot and tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "frontier.json"
PLOT = ROOT / "docs" / "img" / "frontier.png"
WORK = HERE / "_out" / "frontier"
TEXTS = ("hamlet", "britannica-eval")
CONTEXT = 2048
CALIB = ["--calib", "britannica-calib"]
STAGE_F = ["--stage", "f", "--f-iters", "4"]  # stage w is the quality default, too slow for this CPU session

#: folder name -> the ``hf-symmetry`` arguments that write it ({out}: the folder, {NAME}: another folder)
CONVERSIONS = {
    "rotq": ["rotate", "default", "{out}", "--for-quantization", "--scales", "bnb-nf4"],
    "slice25": ["compress", "default", "{out}", "--structure", "slice", "--ratio", "0.25", *CALIB],
    "slice50": ["compress", "default", "{out}", "--structure", "slice", "--ratio", "0.5", *CALIB],
    "slice25u": ["compress", "default", "{out}", "--structure", "slice", "--untie", "--ratio", "0.25", *CALIB],
    "slice25u-rotq": ["rotate", "{slice25u}", "{out}", "--for-quantization", "--scales", "bnb-nf4"],
    "lowrank50": ["compress", "default", "{out}", "--structure", "lowrank", "--ratio", "0.5", *STAGE_F, *CALIB],
    "gs25": ["compress", "default", "{out}", "--structure", "gs", "--ratio", "0.25", *STAGE_F, *CALIB],
    "gs50": ["compress", "default", "{out}", "--structure", "gs", "--ratio", "0.5", *STAGE_F, *CALIB],
    "kron25": ["compress", "default", "{out}", "--structure", "kron", "--ratio", "0.25", *STAGE_F, *CALIB],
    "kron50": ["compress", "default", "{out}", "--structure", "kron", "--ratio", "0.5", *STAGE_F, *CALIB],
    "tpa2": ["to-tpa", "default", "{out}", "--k-rank", "2", "--v-rank", "2", *CALIB],
    "tpa1": ["to-tpa", "default", "{out}", "--k-rank", "1", "--v-rank", "1", *CALIB],
    "farr75": ["farr", "default", "{out}", "--params-fraction", "0.75", "--vo", "--calibrate", "britannica-calib"],
    "farr50": ["farr", "default", "{out}", "--params-fraction", "0.5", "--vo", "--calibrate", "britannica-calib"],
}
EXTRA = {"compress": ["--calib-tokens", "4096"]}  # compress_frontier.json's calibration size

#: the pipelines a user would name, in words, for each conversion folder
LABELS = {
    "source": "source",
    "rotq": "rotate --for-quantization (scales for NF4)",
    "slice25": "compress slice 25 %",
    "slice50": "compress slice 50 %",
    "slice25u": "compress slice 25 % --untie (stock)",
    "slice25u-rotq": "compress slice 25 % --untie, rotate --for-quantization",
    "lowrank50": "compress lowrank 50 % (stage f)",
    "gs25": "compress gs 25 % (stage f)",
    "gs50": "compress gs 50 % (stage f)",
    "kron25": "compress kron 25 % (stage f)",
    "kron50": "compress kron 50 % (stage f)",
    "tpa2": "to-tpa k/v rank 2",
    "tpa1": "to-tpa k/v rank 1",
    "farr75": "farr --vo 75 %",
    "farr50": "farr --vo 50 %",
}
QUANT_LABELS = {
    "bfloat16": "",
    "float32": " (float32)",
    "bnb-nf4": " + NF4",
    "hqq4g64": " + HQQ 4-bit",
    "hqq3g64": " + HQQ 3-bit",
    "hqq4g64-rtn": " + HQQ 4-bit RTN",
    "hqq3g64-rtn": " + HQQ 3-bit RTN",
}

#: (folder, storage) in the order they are measured: the cheap ones first
POINTS = [
    ("source", "float32"),
    ("source", "bfloat16"),
    ("source", "bnb-nf4"),
    ("source", "hqq4g64-rtn"),
    ("source", "hqq3g64-rtn"),
    ("rotq", "bnb-nf4"),
    ("slice25", "bfloat16"),
    ("slice25", "bnb-nf4"),
    ("slice50", "bfloat16"),
    ("slice50", "bnb-nf4"),
    ("tpa2", "bfloat16"),
    ("tpa2", "bnb-nf4"),
    ("tpa1", "bfloat16"),
    ("farr75", "bfloat16"),
    ("farr75", "bnb-nf4"),
    ("farr50", "bfloat16"),
    ("farr50", "bnb-nf4"),
    ("slice25u", "bnb-nf4"),
    ("slice25u-rotq", "bnb-nf4"),
    ("rotq", "hqq3g64-rtn"),
    ("gs25", "bfloat16"),
    ("gs50", "bfloat16"),
    ("kron25", "bfloat16"),
    ("kron50", "bfloat16"),
    ("lowrank50", "bfloat16"),
    ("source", "hqq4g64"),
    ("source", "hqq3g64"),
]


def point_name(folder: str, storage: str) -> str:
    return LABELS[folder] + QUANT_LABELS[storage]


def convert(folder: str) -> Path:
    """The conversion's folder, written by the CLI when it is not there yet."""
    out = WORK / folder
    if (out / "config.json").is_file():
        return out
    args = [a.format(out=out, **{k: WORK / k for k in CONVERSIONS}) for a in CONVERSIONS[folder]]
    for dep in CONVERSIONS:
        if str(WORK / dep) in args[1:2]:
            convert(dep)
    cmd = [str(ROOT / ".venv" / "bin" / "hf-symmetry"), *args, *EXTRA.get(args[0], []), "--no-verify", "--quiet"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return out


def kv_elements(folder: Path) -> int:
    """Cached elements per token, all layers, from the folder's config.json: ``kv_heads x (qk + v head dims)``
    per layer (FaRR: each layer's own dims); TPA: its factor cache ``(R_K + R_V)(d_h [+ h with contextual A])``."""
    c = json.loads((Path(folder) / "config.json").read_text())
    layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    if "k_rank" in c:
        return layers * (c["k_rank"] + c["v_rank"]) * (head_dim + (heads if c.get("contextual_a") else 0))
    qk = c.get("qk_head_dims") or [head_dim] * layers
    v = c.get("v_head_dims") or [head_dim] * layers
    kv_heads = c.get("num_key_value_heads") or heads
    return sum(kv_heads * (a + b) for a, b in zip(qk, v))


def storage_bytes(model, quantized: dict, element_bytes: int) -> int:
    """Every stored tensor once: the quantized ones at their padded size and bits per weight, the rest at
    ``element_bytes`` (integers at their own size)."""
    seen, total = set(), 0.0
    for t in model.state_dict(keep_vars=True).values():
        key = t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        if key in quantized:
            total += quantized[key]
        elif t.is_floating_point():
            total += t.numel() * element_bytes
        else:
            total += t.numel() * t.element_size()
    return int(round(total))


def quantize_(model, name: str) -> tuple[dict, dict]:
    """Every ``nn.Linear`` (and the compressed family's ``DenseLinear``) weight inside the decoder layers
    quantized and dequantized in place (zero-padded to whole groups); returns {data_ptr: stored bytes} and
    a description of what was quantized."""
    import torch

    from hf_symmetry.evaluation.weight_quant import quantizer

    q = quantizer(name)
    stored, count, padded, numel, structured = {}, 0, 0, 0, 0
    for path, m in model.named_modules():
        # the compressed family's dense matrices are its own DenseLinear (F.linear on [out, in]), not nn.Linear
        dense = type(m).__name__ == "DenseLinear"
        if not (isinstance(m, torch.nn.Linear) or dense) or ".layers." not in f".{path}.":
            continue
        structured += dense
        W = m.weight.data
        pad = -W.shape[1] % q.group
        Wq = q.roundtrip(torch.nn.functional.pad(W, (0, pad)))[:, : W.shape[1]]
        m.weight.data.copy_(Wq.to(W.dtype))
        stored[W.data_ptr()] = W.shape[0] * (W.shape[1] + pad) * q.bits_per_weight / 8
        count, padded, numel = count + 1, padded + bool(pad), numel + W.numel()
    if not count:
        raise ValueError(f"{type(model).__name__}: no nn.Linear in the decoder layers")
    total = sum(p.numel() for p in model.parameters())
    what = {"linears": count, "dense_linear": structured, "padded": padded, "quantized_params": numel, "params": total}
    return stored, what


def measure(folder: str, storage: str, texts: list[str], tokens: int) -> dict:
    """In this process: the point's model, its bytes and its perplexities."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from hf_symmetry.assets import text_path
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer
    from hf_symmetry.evaluation.perplexity import PPL, perplexity
    from hf_symmetry.text import read_text, tokenize_text

    path = folder_path(folder)
    model = load_model(path, trust_remote_code=True)
    t0 = time.perf_counter()
    stored, what = ({}, {"params": sum(p.numel() for p in model.parameters())})
    if storage not in ("float32", "bfloat16"):
        stored, what = quantize_(model, storage)
    element = 4 if storage == "float32" else 2
    if element == 2:  # what is not quantized is stored in bfloat16
        for p in model.parameters():
            if p.data_ptr() not in stored:
                p.data.copy_(p.data.to(torch.bfloat16).float())
    quantize_seconds = time.perf_counter() - t0
    kv = kv_elements(path)
    out = {
        "folder": folder,
        "storage": storage,
        "weight_bytes": storage_bytes(model, stored, element),
        "kv_bytes": kv * CONTEXT * element,
        "kv_elements_per_token": kv,
        "quantize_seconds": round(quantize_seconds, 1),
        **what,
        "perplexity": {},
    }
    tok = load_tokenizer(path)
    for text in texts:
        ids = tokenize_text(tok, read_text(text_path(text)), max_tokens=tokens)
        out["perplexity"][text] = perplexity(model, ids, PPL.window, PPL.stride, progress=False).perplexity
    return out


def reused_points(results: dict) -> dict:
    """Rows measured by other benchmarks (same model, texts, token count and definition, or flagged)."""
    R = HERE / "results"
    kq = json.loads((R / "quant_kquants.json").read_text())["variants"]["original"]
    lc = json.loads((R / "quant_llamacpp.json").read_text())["models"]["smollm2"]["variants"]["original"]
    source_kv = 30 * 2 * 3 * 64 * CONTEXT * 2
    src = results["points"].get(point_name("source", "float32"), {}).get("perplexity", {})
    out = {}
    for qt in ("Q4_K_M", "Q3_K_M"):
        out[f"GGUF {qt}"] = {
            "weight_bytes": kq[qt]["bytes"],
            "kv_bytes": source_kv,
            "perplexity": {"hamlet": kq[qt]["perplexity"]},
            "from": "quant_kquants.json (llama-quantize, read back through transformers), 2026-11-26",
        }
        im = lc["types"].get(qt, {}).get("imatrix")
        if im and src:
            out[f"GGUF {qt} imatrix"] = {
                "weight_bytes": im["bytes"],
                "kv_bytes": source_kv,
                "perplexity": {t: src[t] * im["ppl"][t]["ppl"] / lc["f32"][t]["ppl"] for t in src if t in im["ppl"]},
                "scaled": True,
                "from": "quant_llamacpp.json (llama-perplexity, ratio to the F32 GGUF x the source's), 2026-11-27",
            }
    lr = json.loads((R / "compress_frontier.json").read_text())["rows"]["low rank, uniform"]
    out["compress lowrank 25 % (stage w, one alternation)"] = {
        "weight_bytes": 2 * lr["params"],
        "kv_bytes": source_kv,
        "perplexity": lr["perplexity"],
        "earlier_tokenizer": True,
        "from": "compress_frontier.json (4096 calibration tokens), 2026-11-23",
    }
    healed = [r for r in json.loads((R / "heal_cpu_2p15.json").read_text())["rows"] if r["recipe"] == "kd+samples"]
    slice_healed = next(r for r in healed if r["model"] == "slice25" and r["tokens"] == 32768)
    quality = next(t for t in json.loads((R / "tpa_decode.json").read_text())["tables"] if t["name"] == "quality")
    tpa_healed = next(r for r in quality["rows"] if r[0] == "TPA k/v rank 2, healed (2^15 tokens)")
    for base, ppl, src in (
        ("slice25", {t: slice_healed["ppl"][t] for t in TEXTS}, "heal_cpu_2p15.json, 2026-11-26"),
        ("tpa2", {"hamlet": float(tpa_healed[2])}, "tpa_decode.json (quality), 2026-11-27"),
    ):
        ref = results["points"].get(point_name(base, "bfloat16"))
        if ref:
            out[f"{LABELS[base]}, healed (32,768 tokens)"] = {
                "weight_bytes": ref["weight_bytes"],  # the LoRA merged: the conversion's own tensors
                "kv_bytes": ref["kv_bytes"],
                "perplexity": ppl,
                "earlier_tokenizer": base == "slice25",
                "from": f"{src}: heal's default recipe (KD on teacher samples, LoRA 16)",
            }
    return out


def all_points(results: dict) -> dict:
    """Measured and reused points, by name."""
    return {**results["points"], **reused_points(results)}


def frontier(points: dict, text: str) -> list[str]:
    """The names on the Pareto frontier of ``text``'s perplexity against total bytes."""
    have = sorted(
        (p["weight_bytes"] + p["kv_bytes"], p["perplexity"][text], n)
        for n, p in points.items()
        if text in p["perplexity"]
    )
    best, out = float("inf"), []
    for _, ppl, name in have:
        if ppl < best:
            best, out = ppl, [*out, name]
    return out


def best_at(points: dict, text: str, budget: float) -> str | None:
    """The lowest perplexity at most ``budget`` bytes."""
    fit = [(p["perplexity"][text], n) for n, p in points.items() if text in p["perplexity"] and total(p) <= budget]
    return min(fit)[1] if fit else None


def total(p: dict) -> int:
    return p["weight_bytes"] + p["kv_bytes"]


def tables(results: dict) -> list[dict]:
    """The section's tables: every point, and the best pipeline at 25, 35 and 50 % of the bfloat16 source."""
    points = all_points(results)
    ref = total(points[point_name("source", "bfloat16")])
    on = {t: set(frontier(points, t)) for t in TEXTS}

    def ppl(name, p, t):
        v = p["perplexity"].get(t)
        if v is None:
            return ""
        mark = "~" if p.get("scaled") else ""
        mark += "†" if p.get("earlier_tokenizer") and t == "britannica-eval" else ""
        return f"{mark}**{v:.1f}**" if name in on[t] else f"{mark}{v:.1f}"

    rows = []
    for name, p in sorted(points.items(), key=lambda kv: total(kv[1])):
        rows.append(
            [
                name,
                f"{p['weight_bytes'] / 1e6:.1f}",
                f"{p['kv_bytes'] / 1e6:.1f}",
                f"{total(p) / 1e6:.1f}",
                f"{100 * total(p) / ref:.0f} %",
                ppl(name, p, "hamlet"),
                ppl(name, p, "britannica-eval"),
                p.get("from", "measured here"),
            ]
        )
    budget_rows = []
    own = {n: p for n, p in points.items() if not p.get("scaled")}  # the project's definition only
    for frac in (0.25, 0.35, 0.5):
        for t in TEXTS:
            row = [f"{100 * frac:.0f} % ({frac * ref / 1e6:.1f} MB)", t]
            for pool in (points, own):
                name = best_at(pool, t, frac * ref)
                p = pool.get(name)
                mark = "~" if p and p.get("scaled") else ""
                row.append(f"{name} ({total(p) / 1e6:.1f} MB): {mark}{p['perplexity'][t]:.1f}" if p else "nothing fits")
            budget_rows.append(row)
    cols = ["pipeline", "weights MB", "KV 2k MB", "total MB", "of bf16 source", "Hamlet", "britannica-eval", "from"]
    return [
        {"name": "points", "columns": cols, "rows": rows},
        {
            "name": "budgets",
            "columns": ["budget", "text", "best pipeline measured", "best on the project's definition (no ~ row)"],
            "rows": budget_rows,
        },
    ]


#: the plot's colour of each family of pipelines (by how their names start; the rest: the source)
FAMILIES = {
    "GGUF": "tab:green",
    "rotate": "tab:olive",
    "compress": "tab:red",
    "farr": "tab:purple",
    "to-tpa": "tab:orange",
    "source": "tab:blue",
}


def plot(results: dict, path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = all_points(results)
    ref = total(points[point_name("source", "bfloat16")])
    fig, axes = plt.subplots(1, 2, figsize=(16, 7), sharey=False)
    for ax, text in zip(axes, TEXTS):
        names = [n for n, p in points.items() if text in p["perplexity"]]
        for n in names:
            p = points[n]
            marker = "x" if p.get("scaled") else ("s" if "healed" in n else ("^" if "+" in n or "GGUF" in n else "o"))
            family = next(f for f in FAMILIES if n.startswith(f) or f == "source")
            ax.scatter(total(p) / 1e6, p["perplexity"][text], marker=marker, s=30, color=FAMILIES[family])
            ax.annotate(
                n, (total(p) / 1e6, p["perplexity"][text]), fontsize=5.5, xytext=(3, 2), textcoords="offset points"
            )
        for family, colour in FAMILIES.items():
            ax.scatter([], [], color=colour, label=family)
        line = frontier(points, text)
        ax.step(
            [total(points[n]) / 1e6 for n in line],
            [points[n]["perplexity"][text] for n in line],
            "k-",
            where="post",
            lw=0.8,
            label="Pareto frontier",
        )
        for frac in (0.25, 0.35, 0.5, 1.0):
            ax.axvline(frac * ref / 1e6, color="grey", lw=0.5, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="bytes: weights + KV cache at 2048 tokens (MB)", ylabel="perplexity")
        ax.set_title(f"SmolLM2-135M-Instruct, {text} (2048 tokens)", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(
        "dotted: 25, 35, 50, 100 % of the bfloat16 source; triangles: quantized; x: scaled from llama.cpp's own "
        "perplexity; squares: healed",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(path: Path) -> dict:
    results = json.loads(path.read_text()) if path.is_file() else {}
    results.setdefault("points", {})
    return results


def merged(results: dict) -> dict:
    """``results`` with the points of the parts (frontier_*.json, runs alongside) it does not hold."""
    out = {**results, "points": dict(results["points"])}
    for part in sorted(RESULTS.parent.glob(RESULTS.stem + "_*.json")):
        for name, p in load(part)["points"].items():
            out["points"].setdefault(name, p)
    for p in out["points"].values():  # the cache from the config (FaRR's was first read from layer 0 alone)
        p["kv_elements_per_token"] = kv_elements(folder_path(p["folder"]))
        p["kv_bytes"] = p["kv_elements_per_token"] * CONTEXT * (4 if p["storage"] == "float32" else 2)
    return out


def folder_path(folder: str) -> Path:
    from hf_symmetry.assets import resolve_model  # the benchmark's imports stay light for --help

    return Path(resolve_model("default")) if folder == "source" else WORK / folder


def finish(results: dict, path: Path = RESULTS) -> None:
    """Write ``results`` to ``path``; the main file also gets the tables and the plot (parts merged in)."""
    if path == RESULTS and point_name("source", "bfloat16") in results["points"]:
        results["tables"] = tables(merged(results))
        plot(merged(results))
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", nargs="+", default=list(TEXTS))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--only", help="comma-separated folders (source, rotq, slice25, ...)")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--part", help="a run alongside another: write frontier_PART.json (--merge folds it in)")
    ap.add_argument("--merge", action="store_true", help="fold the parts into frontier.json, then tables and plot")
    ap.add_argument("--plot", action="store_true", help="only redraw the plot and the tables")
    ap.add_argument("--point", nargs=2, help=argparse.SUPPRESS)  # internal: one point in this process
    args = ap.parse_args()
    if args.point:
        print("POINT " + json.dumps(measure(*args.point, args.texts, args.tokens)), flush=True)
        return
    path = RESULTS.with_name(f"{RESULTS.stem}_{args.part}.json") if args.part else RESULTS
    results = load(path)
    if args.merge:
        results = merged(results)
        for part in RESULTS.parent.glob(RESULTS.stem + "_*.json"):
            part.unlink()
    elif not args.plot:
        run_points(results, args, path)
    finish(results, path)


def run_points(results: dict, args, path: Path) -> None:
    only = set(args.only.split(",")) if args.only else None
    for folder, storage in POINTS:
        name = point_name(folder, storage)
        have = results["points"].get(name, {}).get("perplexity", {})
        texts = [t for t in args.texts if args.force or t not in have]
        if (only and folder not in only) or not texts:
            continue
        if folder != "source":
            try:
                convert(folder)
            except subprocess.CalledProcessError as e:
                print(f"{name}: conversion failed ({e})", flush=True)
                continue
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--point", folder, storage, "--tokens", str(args.tokens), "--texts", *texts]
        res = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("POINT ")), None)
        if line is None:
            print(f"{name}: failed\n{res.stderr[-2000:]}", flush=True)
            continue
        out = json.loads(line[6:])
        out["perplexity"] = {**have, **out["perplexity"]}
        out["wall_seconds"] = round(time.perf_counter() - t, 1)
        results["points"][name] = out
        results["machine"] = (
            f"{platform.machine()}, {os.cpu_count()} shared CPU cores, torch threads "
            f"{os.environ.get('OMP_NUM_THREADS', '1')}, load average {os.getloadavg()[0]:.1f}"
        )
        results["date"] = time.strftime("%Y-%m-%d", time.gmtime())
        results["command"] = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_frontier.py"
        pp = ", ".join(f"{k} {v:.2f}" for k, v in out["perplexity"].items())
        print(
            f"{name}: {(out['weight_bytes'] + out['kv_bytes']) / 1e6:.1f} MB, {pp}, {out['wall_seconds']} s", flush=True
        )
        finish(results, path)


if __name__ == "__main__":
    main()
