"""``bench_tpa_decode.py --modes latency``: decode ms/token of several configurations measured side by side in one
process, in interleaved rounds, so that a shared machine's changing load falls on all of them alike (the
per-configuration subprocesses of the other modes measure memory; their one-shot timings follow the load).

Every configuration is loaded and prefilled once per cache: its dynamic cache (or quantized cache) for eager
decoding, and, unless quantized, a static cache decoded both eagerly and by ``torch.compile(model.forward,
fullgraph=True)`` (compiled first, outside the rounds). Each round runs ``steps`` decode steps of every
(configuration, variant) in turn; the result is the best and the median round, ms/token."""

from __future__ import annotations

import statistics
import time


def latency(job: dict, load, hamlet_ids, qcache: dict) -> dict:
    import torch
    from transformers import DynamicCache, QuantizedCache, StaticCache

    device = torch.device(job["device"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    L, B, rounds, steps, warm = job["context"], job["batch"], job.get("rounds", 6), job.get("steps", 4), 2
    runners, compile_s = {}, {}
    with torch.no_grad():
        for name, spec in job["configs"].items():
            model, tok = load(spec["folder"])
            ids = hamlet_ids(tok, L * B).view(B, L).to(device)
            nbits = spec["nbits"]
            cache = (
                DynamicCache(config=model.config)
                if nbits is None
                else QuantizedCache(config=model.config, nbits=nbits, **qcache)
            )
            variants = {"eager": (model.forward, cache)}
            if nbits is None:
                static = StaticCache(config=model.config, max_cache_len=L + 2 * rounds * steps + warm + 1)
                variants["static eager"] = (model.forward, static)
                variants["compiled"] = (torch.compile(model.forward, fullgraph=True), static)
            prefilled = {}
            for variant, (_, c) in variants.items():
                if id(c) not in prefilled:
                    logits = model(ids, past_key_values=c, logits_to_keep=1).logits
                    prefilled[id(c)] = [logits[:, -1:].argmax(-1), L]  # shared by the variants of one cache
            for variant, (step, c) in variants.items():
                runners[(name, variant)] = (step, c, prefilled[id(c)])
            if "compiled" in variants:
                t = time.perf_counter()
                run_steps(*runners[(name, "compiled")], warm, B, device, sync)
                compile_s[name] = round(time.perf_counter() - t, 1)
        times = {key: [] for key in runners}
        for _ in range(rounds):
            for key, runner in runners.items():
                times[key].append(1000 * run_steps(*runner, steps, B, device, sync) / steps)
    out = {}
    for (name, variant), ms in times.items():
        out.setdefault(name, {})[variant] = {"best_ms": round(min(ms), 2), "median_ms": round(statistics.median(ms), 2)}
    for name, seconds in compile_s.items():
        out[name]["compile_s"] = seconds
    return {"latency": out, "rounds": rounds, "steps": steps}


def run_steps(step, cache, state, n, B, device, sync) -> float:
    """``n`` greedy decode steps through ``cache``; ``state`` = [next token ids, position], advanced in place."""
    import torch

    sync()
    t = time.perf_counter()
    for _ in range(n):
        nxt, pos = state
        position = torch.full((B, 1), pos, device=device)
        logits = step(input_ids=nxt, position_ids=position, past_key_values=cache, logits_to_keep=1).logits
        state[0], state[1] = logits[:, -1:].argmax(-1), pos + 1
    sync()
    return time.perf_counter() - t
