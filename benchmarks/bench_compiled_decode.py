"""Compiled decoding on every causal-LM family hf_symmetry ships, against eager decoding (issue 37).

Families: stock ``LlamaForCausalLM`` (the control), TPA (a converted GQA model's form: TPA-KV-only, non-contextual
A on the KV-head grouping, k_rank = v_rank = 3, as ``hf-symmetry to-tpa`` writes SmolLM2 at full rank), compressed
Llama (every linear low rank, a quarter of its smaller side), FaRR Llama (value/output head dim 48 of 64 in every
layer) and the RMS decoder (rotary, sequential blocks, dense, GELU MLP, MHA: the family has no KV heads, and an
untied head: the family does not tie). Each is built at SmolLM2-135M's shape (hidden 576,
9 heads, 3 KV heads where the family has them, intermediate 1536, vocabulary 49152, ``--layers`` layers) with
random weights: a timing needs no trained weights.

Every family runs in a fresh subprocess: float32, SDPA attention, ``torch.no_grad``, batch 1. A prompt of L random
tokens is prefilled into a ``StaticCache`` (``max_cache_len`` = L + the decode steps + 8) and, separately, with
``use_cache=True`` (the family's dynamic cache). Single-token greedy decode steps are then timed for

* ``eager (dynamic)``: ``model.forward`` with the dynamic cache,
* ``eager (static)``: ``model.forward`` with the static cache,
* ``compiled``: ``torch.compile(model.forward, fullgraph=True)`` with the same static cache (2 warm-up steps
  first, their seconds recorded as the compile time),

in interleaved rounds (``--rounds`` rounds of ``--steps`` steps of each variant in turn, so that the machine's
changing load falls on all three alike): best round and median round, ms/token. The compiled step's logits are
checked against an eager step on the same cache (the compiled step is rolled back with ``crop(-1)`` on every cache
layer and the same token decoded eagerly): max |Δlogit|.

    OMP_NUM_THREADS=1 python benchmarks/bench_compiled_decode.py                      # 30 layers, L = 2048
    OMP_NUM_THREADS=1 python benchmarks/bench_compiled_decode.py --layers 2 --context 64   # a quick check

Results: benchmarks/results/compiled_decode.json (one record per family and the table BENCHMARKS.md shows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from child import machine, run_child  # benchmarks/ is on the path: this script runs from there

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "compiled_decode.json"
FAMILIES = ("llama", "tpa", "compressed", "farr", "rms-decoder")
LABELS = {
    "llama": "Llama (transformers, control)",
    "tpa": "TPA (GQA form, k/v rank 3)",
    "compressed": "compressed Llama (low rank ¼)",
    "farr": "FaRR Llama (V/O head dim 48)",
    "rms-decoder": "RMS decoder (rotary, own head)",
}
#: SmolLM2-135M's shape
SHAPE = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
WARM = 2


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------
def _line(text: str) -> str:
    """The last non-empty line of an error (the exception), fit for a table cell."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()] or [""]
    return lines[-1][:160].replace("|", "\\|")


def _cell(v: dict | None) -> str:
    return f"{v['best_ms']:.0f} ({v['median_ms']:.0f})" if v else "–"


def tables(runs: list[dict], layers: int, context: int) -> list[dict]:
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([LABELS[r["family"]], "–", "–", "–", "–", "–", "–", "–", "failed: " + _line(r["error"])])
            continue
        dyn, stat, comp = r.get("eager_dynamic"), r.get("eager_static"), r.get("compiled")
        eager_best = min(v["median_ms"] for v in (dyn, stat) if v)
        ratio = f"{comp['median_ms'] / eager_best:.2f}" if comp else "–"
        delta = r.get("max_abs_dlogit")
        rows.append(
            [
                LABELS[r["family"]],
                f"{r['parameters'] / 1e6:.1f}",
                _cell(dyn),
                _cell(stat),
                _cell(comp),
                ratio,
                f"{r['compile_s']:.0f}" if r.get("compile_s") is not None else "–",
                f"{delta:.1e}" if delta is not None else "–",
                ("compile failed: " + _line(r["compile_error"])) if r.get("compile_error") else "",
            ]
        )
    return [
        {
            "name": "main",
            "caption": f"Random weights of SmolLM2-135M's shape, {layers} layers, float32, SDPA, batch 1, "
            f"prompt of {context} tokens; decode ms/token, best round (median round) of interleaved rounds; "
            "compiled = `torch.compile(model.forward, fullgraph=True)` with the static cache; × eager = compiled "
            "median / the faster eager median (below 1: compiled is faster); compile s = the two warm-up steps; "
            "max |Δlogit| = compiled step against an eager step on the same cache.",
            "columns": [
                "family",
                "parameters (M)",
                "eager (dynamic cache)",
                "eager (static cache)",
                "compiled (static cache)",
                "× eager",
                "compile s",
                "max \\|Δlogit\\|",
                "note",
            ],
            "rows": rows,
        }
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per family (subprocess)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if os.environ.get("OMP_NUM_THREADS") else ""
    cmd = f"{threads}python benchmarks/bench_compiled_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print("random weights (timing needs no trained weights), SmolLM2-135M's shape,", args.layers, "layers", flush=True)
    runs = []
    for family in args.families:
        job = dict(family=family, layers=args.layers, context=args.context, rounds=args.rounds, steps=args.steps)
        print(f"{family} ...", flush=True)
        record = run_child(__file__, job, args.timeout)
        record["load_avg"] = round(os.getloadavg()[0], 1)
        runs.append(record)
        print("  ", {k: v for k, v in record.items() if k not in job}, flush=True)
        data = {
            "machine": machine("cpu"),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": cmd.strip(),
            "weights": "random (SmolLM2-135M's shape; timing does not need trained weights)",
            "runs": runs,
            "tables": tables(runs, args.layers, args.context),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------
# Child: one family in a fresh process
# ----------------------------------------------------------------------------------------------
def build_config(family: str, layers: int):
    import transformers as T

    from hf_symmetry.modeling.configuration_compressed_llama import CompressedLlamaConfig
    from hf_symmetry.modeling.configuration_farr import FarrLlamaConfig
    from hf_symmetry.modeling.configuration_rms_decoder import RMSDecoderConfig
    from hf_symmetry.modeling.configuration_tpa import TPAConfig

    s = SHAPE
    rope = {"rope_type": "default", "rope_theta": 100000.0}
    llama = dict(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    if family == "llama":
        return T.LlamaConfig(**llama)
    if family == "tpa":  # as conversion/to_tpa/target.py writes a converted GQA model
        kw = {k: v for k, v in llama.items() if k != "num_key_value_heads"}
        return TPAConfig(**kw, q_rank=None, k_rank=s["kv_heads"], v_rank=s["kv_heads"], contextual_a=False)
    if family == "compressed":
        d, kv, f = s["hidden"], s["kv_heads"] * s["head_dim"], s["intermediate"]
        shapes = dict(q_proj=(d, d), k_proj=(kv, d), v_proj=(kv, d), o_proj=(d, d))
        shapes.update(gate_proj=(f, d), up_proj=(f, d), down_proj=(d, f))
        per_layer = {m: {"type": "lowrank", "rank": min(o, i) // 4} for m, (o, i) in shapes.items()}
        kw = {k: v for k, v in llama.items() if k != "tie_word_embeddings"}
        return CompressedLlamaConfig(**kw, layer_structures=[dict(per_layer) for _ in range(layers)], lm_head="tied")
    if family == "farr":
        return FarrLlamaConfig(**llama, v_head_dims=[48] * layers)
    if family == "rms-decoder":
        return RMSDecoderConfig(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            intermediate_size=s["intermediate"],
            num_hidden_layers=layers,
            num_attention_heads=s["heads"],
            max_position_embeddings=8192,
            rotary=True,
            rope_parameters=rope,
            hidden_act="gelu",
            bos_token_id=1,
            eos_token_id=2,
        )
    raise ValueError(family)


def build_model(family: str, layers: int):
    import torch
    from transformers import AutoModelForCausalLM

    import hf_symmetry  # noqa: F401  (registers the families with the Auto classes)

    torch.manual_seed(0)
    config = build_config(family, layers)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    if family == "tpa":  # a converted GQA model: A = R on the KV-head grouping (head i in group i // (h/R))
        h, r = config.num_attention_heads, config.k_rank
        grouping = torch.zeros(r, h)
        grouping[torch.arange(h) // (h // r), torch.arange(h)] = float(r)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_a.copy_(grouping)
                layer.self_attn.v_a.copy_(grouping)
    return model


def child(job: dict) -> dict:
    import torch
    from transformers import StaticCache

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    L, rounds, steps = job["context"], job["rounds"], job["steps"]
    model = build_model(job["family"], job["layers"])
    out = {"parameters": sum(p.numel() for p in model.parameters())}
    ids = torch.randint(3, SHAPE["vocab"], (1, L), generator=torch.Generator().manual_seed(0))
    static_steps = WARM + 1 + 2 * rounds * steps  # warm-up, the logits check, eager and compiled rounds
    with torch.no_grad():
        static = StaticCache(config=model.config, max_cache_len=L + static_steps + 8)
        t = time.perf_counter()
        logits = model(ids, past_key_values=static, logits_to_keep=1).logits
        out["prefill_s"] = round(time.perf_counter() - t, 2)
        s_state = [logits[:, -1:].argmax(-1), L]
        d_out = model(ids, use_cache=True, logits_to_keep=1)
        d_cache = d_out.past_key_values
        d_state = [d_out.logits[:, -1:].argmax(-1), L]
        out["cache_layers"] = {"static": type(static.layers[0]).__name__, "dynamic": type(d_cache.layers[0]).__name__}

        runners = {
            "eager_dynamic": (model.forward, d_cache, d_state),
            "eager_static": (model.forward, static, s_state),
        }
        try:
            compiled = torch.compile(model.forward, fullgraph=True)
            warm = [decode(compiled, static, s_state, 1) for _ in range(WARM)]
            out["compile_s"] = round(sum(warm), 1)
            out["warmup_steps_s"] = [round(w, 2) for w in warm]
            # the logits check: a compiled step, rolled back, then the same token decoded eagerly
            nxt, pos = s_state
            c_logits = step_logits(compiled, static, nxt, pos)
            for layer in static.layers:
                layer.crop(-1)
            e_logits = step_logits(model.forward, static, nxt, pos)
            out["max_abs_dlogit"] = float((c_logits - e_logits).abs().max())
            out["logit_scale"] = round(float(e_logits.abs().max()), 3)
            s_state[0], s_state[1] = e_logits[:, -1:].argmax(-1), pos + 1
            runners["compiled"] = (compiled, static, s_state)
        except Exception as exc:  # record the failure, time the eager variants anyway
            out["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        times = {name: [] for name in runners}
        for _ in range(rounds):
            for name, (fn, cache, state) in runners.items():
                times[name].append(1000 * decode(fn, cache, state, steps) / steps)
    for name, ms in times.items():
        out[name] = {"best_ms": round(min(ms), 1), "median_ms": round(statistics.median(ms), 1)}
    return out


def step_logits(fn, cache, nxt, pos):
    import torch

    position = torch.full((1, 1), pos)
    return fn(input_ids=nxt, position_ids=position, past_key_values=cache, logits_to_keep=1).logits.clone()


def decode(fn, cache, state, n: int) -> float:
    """``n`` greedy decode steps through ``cache``; ``state`` = [next token ids, position], advanced in place."""
    t = time.perf_counter()
    for _ in range(n):
        logits = step_logits(fn, cache, *state)
        state[0], state[1] = logits[:, -1:].argmax(-1), state[1] + 1
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
