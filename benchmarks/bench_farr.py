"""FaRR benchmark: quality against attention parameters removed, on SmolLM2-135M (perplexity) and
all-MiniLM-L6-v2 (cosine of the last hidden states to the original's).

At each parameter count (set by FaRR's own plan at τ ∈ {0.99, 0.999, 0.9999}, and by budgets)
four ways of shrinking the same head dims are compared, all with exactly the same architecture
and parameter count:

* ``farr``       data-free FaRR: truncated SVD of the fused maps, balanced √Σ split (the seed);
* ``farr-cal``   FaRR in the activation-aware metric (fused maps weighted by the attention inputs'
                 second moments on 2048 tokens of britannica-calib; same budget);
* ``trunc-V``    keep the top singular directions of W_V (and W_K with QK) alone, then project W_O (W_Q);
* ``trunc-O``    keep the top singular directions of W_O (and W_Q with QK) alone, then project W_V (W_K).

Also writes the `spectra` heatmaps of both models to docs/img/ and a summary plot.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_farr.py   (writes benchmarks/results/farr.json; torch uses
OMP_NUM_THREADS threads, 2 when unset; finished points are cached in benchmarks/_cache/farr_points.json, delete it
for a fresh run)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from hf_symmetry.assets import minilm_dir, smollm2_dir, text_path  # noqa: E402
from hf_symmetry.conversion.farr import (
    FarrOptions,
    attention_input_moments,
    build_farr_model,  # noqa: E402
    farr_state_dict,
    spectra_report,
)
from hf_symmetry.conversion.stream import DictSource  # noqa: E402
from hf_symmetry.evaluation.compare import load_model, load_tokenizer  # noqa: E402
from hf_symmetry.evaluation.perplexity import perplexity  # noqa: E402
from hf_symmetry.text import read_text, tokenize_text  # noqa: E402
from hf_symmetry.evaluation.spectra_plots import plot_rank_heatmaps  # noqa: E402

RESULTS = HERE / "results"
POINTS_CACHE = HERE / "_cache" / "farr_points.json"  # finished points, so an interrupted run resumes
IMG = ROOT / "docs" / "img"
TAUS = (0.99, 0.999, 0.9999)
EVAL_TOKENS, WINDOW = 2048, 512
CALIB_TOKENS = 2048
METHODS = {"farr": "fused", "trunc-V": "input", "trunc-O": "output"}


def _ids(tokenizer, name: str, tokens: int) -> torch.Tensor:
    return tokenize_text(tokenizer, read_text(text_path(name))[: tokens * 16], max_tokens=tokens)


def _convert(model, options: FarrOptions, moments=None):
    sd, cfg, report = farr_state_dict(model.state_dict(), model.config, options, moments=moments)
    return build_farr_model(sd, cfg, torch.float32), report


def _points(model, paths: dict, budgets: tuple[float, ...]):
    """(label, FaRR options) per point: the τ plans first, then budgets; each fixes a parameter count."""
    for tau in TAUS:
        yield f"τ={tau:g}", FarrOptions(tau=tau, **paths)
    for frac in budgets:
        yield f"budget {frac:g}", FarrOptions(params_fraction=frac, **paths)


def _cached_points() -> dict:
    return json.loads(POINTS_CACHE.read_text()) if POINTS_CACHE.is_file() else {}


def _remember(key: str, row: dict) -> None:
    cache = _cached_points()
    cache[key] = row
    POINTS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    POINTS_CACHE.write_text(json.dumps(cache, indent=1))


def _run_model(model, quality, paths: dict, budgets, moments, original: float, tag: str) -> list[dict]:
    rows = []
    for label, options in _points(model, paths, budgets):
        key = f"{tag}|{label}"
        if key in _cached_points():
            rows.append(_cached_points()[key])
            continue
        row = {"point": label}
        reduced, rep = _convert(model, options)
        row.update(
            kept_fraction=rep.touchable_kept_fraction,
            removed=rep.params_before - rep.params_after,
            removed_pct_model=100 * (rep.params_before - rep.params_after) / rep.params_before,
            ranks=rep.ranks,
        )
        if all(r == rep.head_dim for ranks in rep.ranks.values() for r in ranks):
            # nothing truncated: every method is the original up to float round-off
            rows.append({**row, **{m: original for m in ("farr", "farr-cal", *list(METHODS)[1:])}, "full_rank": True})
            _remember(key, rows[-1])
            print(json.dumps({"point": label, "full_rank": True}), flush=True)
            continue
        row["farr"] = quality(reduced)
        for name, basis in list(METHODS.items())[1:]:
            same = FarrOptions(tau=options.tau, params_fraction=options.params_fraction, basis=basis, **paths)
            row[name] = quality(_convert(model, same)[0])  # same ranks as farr: same parameter count
        cal_options = FarrOptions(params_fraction=min(1.0, rep.touchable_kept_fraction + 1e-12), **paths)
        cal, cal_rep = _convert(model, cal_options, moments)
        row["farr-cal"] = quality(cal)
        row["farr-cal_kept_fraction"] = cal_rep.touchable_kept_fraction
        rows.append(row)
        _remember(key, row)
        print(
            json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "ranks"}),
            flush=True,
        )
    return rows


def bench_smollm2() -> dict:
    src = smollm2_dir()
    model, tok = load_model(src), load_tokenizer(src)
    ids = _ids(tok, "britannica-eval", EVAL_TOKENS)
    moments = attention_input_moments(model, _ids(tok, "britannica-calib", CALIB_TOKENS))

    def quality(m) -> float:
        return perplexity(m, ids, window=WINDOW, stride=WINDOW, progress=False).perplexity

    base = quality(model)
    print(f"SmolLM2 perplexity {base:.4f}", flush=True)
    rows = _run_model(model, quality, {"vo": True, "qk": False}, (0.95, 0.9, 0.8), moments, base, "smollm2|vo")
    return {
        "model": str(src),
        "metric": f"perplexity, {ids.numel()} tokens of britannica-eval, windows of {WINDOW}",
        "original": base,
        "params": sum(p.numel() for p in model.parameters()),
        "vo": rows,
    }


def bench_minilm() -> dict:
    src = minilm_dir()
    model, tok = load_model(src), load_tokenizer(src)
    text = read_text(text_path("britannica-eval"))
    batch = tok(
        [text[i * 2000 : (i + 1) * 2000] for i in range(8)],
        return_tensors="pt",
        truncation=True,
        max_length=256,
        padding=True,
    )
    moments = attention_input_moments(model, _ids(tok, "britannica-calib", CALIB_TOKENS), window=256)
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()

    @torch.no_grad()
    def quality(m) -> float:
        out = m(**batch).last_hidden_state
        return torch.nn.functional.cosine_similarity(out[mask], ref[mask], dim=-1).mean().item()

    result = {
        "model": str(src),
        "metric": f"mean cosine of last hidden states to the original over {int(mask.sum())} "
        "tokens (8 windows of britannica-eval)",
        "params": sum(p.numel() for p in model.parameters()),
    }
    for key, paths in (("vo", {"vo": True, "qk": False}), ("qk+vo", {"vo": True, "qk": True})):
        print(f"MiniLM {key}", flush=True)
        result[key] = _run_model(model, quality, paths, (0.9, 0.75, 0.5), moments, 1.0, f"minilm|{key}")
    return result


def heatmaps() -> dict:
    IMG.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, src in (("smollm2", smollm2_dir()), ("minilm", minilm_dir())):
        model = load_model(src)
        report = spectra_report(
            DictSource(model.state_dict()), model.config.to_dict(), [0.99, 0.999], name=name, progress=False
        )
        path = IMG / f"farr_spectra_{name}.png"
        plot_rank_heatmaps(
            report,
            path,
            title=f"Effective rank of fused attention maps: {name} (rows: heads / KV groups, columns: layers)",
        )
        out[name] = {"png": str(path.relative_to(ROOT)), "summary": report["summary"]}
    return out


def summary_plot(results: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("SmolLM2-135M, V/O", results["smollm2"], "vo", "perplexity"),
        ("MiniLM-L6, V/O", results["minilm"], "vo", "cosine to original"),
        ("MiniLM-L6, Q/K + V/O", results["minilm"], "qk+vo", "cosine to original"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (title, res, key, ylabel) in zip(axes, panels):
        rows = sorted(res[key], key=lambda r: r["removed"])
        x = [r["removed"] / 1e6 for r in rows]
        for name, style in (("farr", "o-"), ("farr-cal", "s-"), ("trunc-V", "v--"), ("trunc-O", "^--")):
            ax.plot(x, [r[name] for r in rows], style, label=name, ms=4)
        ax.axhline(res.get("original", 1.0), color="gray", lw=0.8, ls=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("parameters removed (M)")
        ax.set_ylabel(ylabel)
        if ylabel == "perplexity":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = IMG / "farr_benchmark.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path.relative_to(ROOT))


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    start = time.perf_counter()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "")
    results = {
        "machine": {
            "cpu": model_name,
            "cores": 2,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
        },
        "heatmaps": heatmaps(),
        "smollm2": bench_smollm2(),
        "minilm": bench_minilm(),
    }
    results["plot"] = summary_plot(results)
    results["seconds"] = time.perf_counter() - start
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "farr.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {RESULTS / 'farr.json'} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
