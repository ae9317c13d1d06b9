"""Tensor Product Attention benchmark (CPU).

1. KV-cache size: T6/TPA vs Llama MHA and GQA models with the same parameter count, measured from the
   tensors the caches actually hold after real prefills of 64 and 1024 tokens (bytes/token = the slope;
   8k/32k totals are that measured slope times the length plus the measured constant part, not
   allocations of 8k/32k tokens).
2. Decode latency per token (batch 1) at several context lengths, all models side by side in one run,
   interleaved round by round. The caches are filled with random tensors of the right shapes (the cost
   of a decode step does not depend on the cached values); TPA runs once with factor-space attention
   and once with materialised K/V.
3. SmolLM2-135M converted to TPA: perplexity on britannica-eval vs K/V rank (cache size), with the
   plain head-mode SVD and with the calibration refinement (britannica-calib).

Run: .venv/bin/python benchmarks/bench_tpa.py [--quick]   (writes benchmarks/results/tpa.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

D, H, DH, LAYERS, VOCAB = 512, 8, 64, 4, 8192
MHA_FFN = 1408


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------------
# Models of equal parameter count
# ----------------------------------------------------------------------------------------------
def build_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_symmetry import TPAConfig, TPAForCausalLM

    def llama(n_kv, ffn):
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            num_attention_heads=H,
            num_key_value_heads=n_kv,
            head_dim=DH,
            intermediate_size=ffn,
            num_hidden_layers=LAYERS,
            tie_word_embeddings=True,
            max_position_embeddings=40000,
        )
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")

    def tpa(ffn, **kw):
        cfg = TPAConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            num_attention_heads=H,
            head_dim=DH,
            intermediate_size=ffn,
            num_hidden_layers=LAYERS,
            max_position_embeddings=40000,
            **kw,
        )
        return TPAForCausalLM._from_config(cfg, attn_implementation="sdpa")

    def params(m):
        return sum(p.numel() for p in m.parameters())

    torch.manual_seed(0)
    mha = llama(H, MHA_FFN)
    target = params(mha)
    per_ffn_unit = 3 * D * LAYERS

    def matched(make, **kw):
        probe = make(MHA_FFN, **kw)
        ffn = MHA_FFN + round((target - params(probe)) / per_ffn_unit)
        return make(ffn, **kw)

    models = {
        "Llama MHA (8 KV heads)": mha,
        "Llama GQA (2 KV heads)": matched(lambda f: llama(2, f)),
        "T6 TPA (R_Q=6, R_K=R_V=2)": matched(tpa, q_rank=6, k_rank=2, v_rank=2),
        "TPA non-contextual A (R_K=R_V=2)": matched(tpa, q_rank=None, k_rank=2, v_rank=2, contextual_a=False),
    }
    return {name: m.eval() for name, m in models.items()}, {name: params(m) for name, m in models.items()}


def cache_bytes(cache) -> int:
    from hf_symmetry.modeling.modeling_tpa import TPACache

    if isinstance(cache, TPACache):
        return cache.cached_bytes()
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )


@torch.no_grad()
def kv_cache_sizes(models) -> dict:
    out = {}
    for name, model in models.items():
        measured = {}
        for n in (64, 1024):
            ids = torch.randint(0, VOCAB, (1, n))
            measured[n] = cache_bytes(model(ids, use_cache=True).past_key_values)
        slope = (measured[1024] - measured[64]) / (1024 - 64)
        const = measured[64] - 64 * slope
        out[name] = {
            "bytes_per_token": slope,
            "bytes_per_token_per_layer": slope / LAYERS,
            "constant_bytes": const,
            "measured_bytes": {str(k): v for k, v in measured.items()},
            "total_bytes": {"1k": measured[1024], "8k": slope * 8192 + const, "32k": slope * 32768 + const},
            "dtype": "float32",
        }
    return out


# ----------------------------------------------------------------------------------------------
# Decode latency
# ----------------------------------------------------------------------------------------------
def filled_cache(model, ctx: int):
    from transformers import DynamicCache

    from hf_symmetry.modeling.modeling_tpa import TPACache

    cfg = model.config
    g = torch.Generator().manual_seed(ctx)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if cfg.model_type == "hf_symmetry_tpa":
        cache = TPACache(config=cfg)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            a_k = r(1, ctx, cfg.k_rank, H) if cfg.contextual_a else attn.k_a.detach()
            a_v = r(1, ctx, cfg.v_rank, H) if cfg.contextual_a else attn.v_a.detach()
            cache.update_factors(i, a_k, r(1, ctx, cfg.k_rank, DH), a_v, r(1, ctx, cfg.v_rank, DH))
    else:
        cache = DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            kv = cfg.num_key_value_heads
            cache.update(r(1, kv, ctx, DH), r(1, kv, ctx, DH), i)
    return cache


@torch.no_grad()
def decode_latency(models, contexts, rounds: int, steps: int) -> dict:
    tpa_name = next(n for n in models if n.startswith("T6"))
    runs = {n: (m, None) for n, m in models.items() if "non-contextual" not in n and not n.startswith("T6")}
    runs[tpa_name + ", factor-space"] = (models[tpa_name], "factor")
    runs[tpa_name + ", materialised K/V"] = (models[tpa_name], "materialize")
    result = {}
    for ctx in contexts:
        caches = {n: filled_cache(m, ctx) for n, (m, _) in runs.items()}
        times = {n: [] for n in runs}
        token = torch.tensor([[5]])
        for rnd in range(rounds + 1):  # round 0 is a warm-up
            for name, (model, path) in runs.items():
                if path:
                    model.config.tpa_decode_path = path
                cache = caches[name]
                t0 = time.perf_counter()
                for s in range(steps):
                    model(
                        input_ids=token, past_key_values=cache, position_ids=torch.tensor([[ctx + s]]), use_cache=True
                    )
                dt = (time.perf_counter() - t0) / steps
                cache.crop(-steps)
                if rnd:
                    times[name].append(dt)
        models[tpa_name].config.tpa_decode_path = "auto"
        best = {n: min(t) for n, t in times.items()}
        base = best["Llama MHA (8 KV heads)"]
        base_med = statistics.median(times["Llama MHA (8 KV heads)"])
        result[str(ctx)] = {
            n: {
                "ms_per_token": 1e3 * t,
                "vs_mha": t / base,
                "median_ms_per_token": 1e3 * statistics.median(times[n]),
                "median_vs_mha": statistics.median(times[n]) / base_med,
                "rounds_ms": [1e3 * x for x in times[n]],
            }
            for n, t in best.items()
        }
    return result


# ----------------------------------------------------------------------------------------------
# Converted SmolLM2: perplexity vs rank
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def smollm2_rank_curve(eval_tokens: int, calib_tokens: int, ranks) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.assets import smollm2_dir, text_path
    from hf_symmetry.conversion.to_tpa import attention_input_grams, convert_model_to_tpa
    from hf_symmetry.evaluation.perplexity import perplexity
    from hf_symmetry.text import read_text, tokenize_text

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tokenize_text(tok, read_text(text_path("britannica-eval")), max_tokens=eval_tokens)
    calib = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=calib_tokens)
    window = min(512, eval_tokens)
    ppl = lambda m: perplexity(m, ids, window=window, stride=window, progress=False).perplexity  # noqa: E731
    cfg = model.config
    n_kv, dh, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    rows = [
        {
            "k_rank": n_kv,
            "v_rank": n_kv,
            "variant": "source (Llama GQA)",
            "perplexity": ppl(model),
            "cache_elements_per_token": 2 * n_kv * dh * L,
        }
    ]
    t0 = time.time()
    grams = attention_input_grams(model, calib, progress=False)
    calib_seconds = time.time() - t0
    for rk, rv in ranks:
        for calibrate in (False,) if (rk, rv) == (n_kv, n_kv) else (False, True):
            t0 = time.time()
            tpa, rep = convert_model_to_tpa(
                model, k_rank=rk, v_rank=rv, calib_grams=grams, calibrate=calibrate, progress=False
            )
            seconds = time.time() - t0
            rows.append(
                {
                    "k_rank": rk,
                    "v_rank": rv,
                    "variant": "exact" if rep.exact else ("calibrated" if calibrate else "head-mode SVD"),
                    "perplexity": ppl(tpa),
                    "cache_elements_per_token": rep.cache_elements_per_token_tpa,
                    "mean_k_activation_rel_err": statistics.mean(e.k_activation_rel_err for e in rep.layers),
                    "mean_v_activation_rel_err": statistics.mean(e.v_activation_rel_err for e in rep.layers),
                    "mean_k_weight_rel_err": statistics.mean(e.k_weight_rel_err for e in rep.layers),
                    "mean_v_weight_rel_err": statistics.mean(e.v_weight_rel_err for e in rep.layers),
                    "convert_seconds": seconds,
                }
            )
            del tpa
    return {
        "eval_text": "britannica-eval",
        "eval_tokens": int(ids.numel()),
        "window": window,
        "calib_text": "britannica-calib",
        "calib_tokens": int(calib.numel()),
        "calibration_forward_seconds": calib_seconds,
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------
def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


def markdown(res: dict) -> str:
    out = [
        f"Machine: {res['machine']['cpu']}, {res['machine']['threads']} torch threads; "
        f"torch {res['machine']['torch']}, transformers {res['machine']['transformers']}; {res['date']}.",
        "",
    ]
    out += [
        f"### KV cache (float32; d={D}, h={H}, d_h={DH}, {LAYERS} layers, equal parameter counts)",
        "",
        "| model | params | bytes/token (all layers) | 1k tokens | 8k tokens | 32k tokens | vs MHA |",
        "|---|---|---|---|---|---|---|",
    ]
    mha = res["kv_cache"]["Llama MHA (8 KV heads)"]["bytes_per_token"]
    for name, r in res["kv_cache"].items():
        t = r["total_bytes"]
        out.append(
            f"| {name} | {res['params'][name] / 1e6:.2f} M | {r['bytes_per_token']:.0f} | {fmt_bytes(t['1k'])} | "
            f"{fmt_bytes(t['8k'])} | {fmt_bytes(t['32k'])} | {r['bytes_per_token'] / mha:.3f} |"
        )
    out += [
        "",
        "### Decode latency per token (batch 1, ms, best of the interleaved rounds; ratio to MHA in parentheses)",
        "",
    ]
    ctxs = list(res["decode_latency"])
    names = list(res["decode_latency"][ctxs[0]])
    out += ["| model | " + " | ".join(f"context {c}" for c in ctxs) + " |", "|---|" + "---|" * len(ctxs)]
    for n in names:
        cells = [
            f"{res['decode_latency'][c][n]['ms_per_token']:.2f} ({res['decode_latency'][c][n]['vs_mha']:.2f}x)"
            for c in ctxs
        ]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    if "smollm2_rank_curve" in res:
        s = res["smollm2_rank_curve"]
        out += [
            "",
            f"### SmolLM2-135M → TPA: perplexity vs K/V rank ({s['eval_tokens']} tokens of {s['eval_text']}, "
            f"window {s['window']}; calibration: {s['calib_tokens']} tokens of {s['calib_text']})",
            "",
            "| R_K | R_V | variant | cache elements/token (30 layers) | vs source | perplexity | "
            "mean rel. act. error K / V |",
            "|---|---|---|---|---|---|---|",
        ]
        src = s["rows"][0]["cache_elements_per_token"]
        for r in s["rows"]:
            err = (
                f"{r['mean_k_activation_rel_err']:.3f} / {r['mean_v_activation_rel_err']:.3f}"
                if "mean_k_activation_rel_err" in r
                else ""
            )
            out.append(
                f"| {r['k_rank']} | {r['v_rank']} | {r['variant']} | {r['cache_elements_per_token']} | "
                f"{r['cache_elements_per_token'] / src:.2f} | {r['perplexity']:.2f} | {err} |"
            )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds/contexts and no SmolLM2 curve")
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine 2 threads oversubscribe)",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--no-smollm2", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    import hf_symmetry  # noqa: F401

    res = {
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpu": cpu_name(),
            "cores": __import__("os").cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "setup": {"d_model": D, "heads": H, "head_dim": DH, "layers": LAYERS, "vocab": VOCAB},
    }
    t0 = time.time()
    models, params = build_models()
    res["params"] = params
    res["kv_cache"] = kv_cache_sizes(models)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.quick:
        contexts, args.rounds = contexts[:2], 2
    res["decode_latency"] = decode_latency(models, contexts, args.rounds, args.steps)
    res["decode_latency_method"] = (
        f"{args.rounds} interleaved rounds of {args.steps} decode steps per model "
        "(after one warm-up round); ms_per_token = best round, median_* = median round; "
        "caches pre-filled with random tensors of the context length"
    )
    del models
    if not (args.quick or args.no_smollm2):
        n_kv = 3
        ranks = [(n_kv, n_kv), (3, 2), (2, 3), (2, 2), (2, 1), (1, 2), (1, 1)]
        res["smollm2_rank_curve"] = smollm2_rank_curve(args.eval_tokens, args.calib_tokens, ranks)
    res["seconds"] = time.time() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tpa.json").write_text(json.dumps(res, indent=2) + "\n")
    print(markdown(res))
    print(f"\nwrote {RESULTS / 'tpa.json'} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
