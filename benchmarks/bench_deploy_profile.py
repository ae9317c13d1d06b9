"""Where a decode step's and a prefill's time goes, in SmolLM2 and its compressed outputs (issue 47).

bench_deploy.py's folders (``compress --stage none``, loaded as a user loads them, their own remote code) and
the source, all in one process, float32, ``OMP_NUM_THREADS`` threads: a prompt of L tokens of hamlet into a
dynamic cache (``logits_to_keep=1``, as ``generate`` does), then greedy one-token steps. Forward hooks on the
model's modules time each category, a module's own time being its time less that of its hooked children:

* decoder linears: every layer's q/k/v/o and gate/up/down projections (the structured modules);
* lm_head: the source's ``lm_head``; a compressed output's head (its mix and the embedding matrix applied as the
  head; the same matrix looked up as the embedding counts below);
* attention: the attention module less its projections (rotary, cache update, SDPA) and the rotary tables;
* norms, activations, residuals: the decoder layers and MLPs less their children, the embedding lookup and
  the final norm;
* rest: the forward outside these modules (mask, positions, output; Python and dispatch between modules).

Times are the CPU time of the one computing thread (``time.thread_time``: one torch thread computes on the
calling thread), so that the time this shared machine's scheduler gives other processes is not counted (the
wall time of each forward is recorded too); the tables take the least time of each category over all samples.
Every round runs each model in turn (the order reversed every other round) once with the hooks and once
without (the step time without hooks, which the speed-ups use). From the source's split, the Amdahl bound of an
output: the source's step with its decoder linears (and, second bound, its lm_head) taking the output's
parameter fraction of their time, the rest unchanged.

    OMP_NUM_THREADS=1 python benchmarks/bench_deploy_profile.py --out benchmarks/results/deploy_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench_deploy import CONFIGS, build_folders  # benchmarks/ is on the path: this script runs from there
from hf_symmetry.assets import text_path

CATEGORIES = {
    "linears": "decoder linears",
    "lm_head": "lm_head",
    "attention": "attention (rotary, cache, SDPA)",
    "elementwise": "norms, activations, residuals",
    "rest": "rest",
}
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
HEAD = ("lm_head", "head_mix", "model.embed_tokens.matrix")


def category(name: str, kwargs: dict) -> str | None:
    """The category of module ``name``'s own time (None: not hooked, its time falls to its parent's)."""
    if LINEAR.fullmatch(name):
        return "linears"
    if name in HEAD:  # the structured embedding's matrix is looked up as the embedding with embed=True
        return "elementwise" if kwargs.get("embed") else "lm_head"
    if name == "model.rotary_emb" or re.fullmatch(r"model\.layers\.\d+\.self_attn", name):
        return "attention"
    if name in ("model.embed_tokens", "model.norm") or re.fullmatch(r"model\.layers\.\d+(\.mlp)?", name):
        return "elementwise"
    return "rest" if name in ("", "model") else None


class Split:
    """Forward hooks that add each hooked module's own CPU time (its time less its hooked children's) to its
    category; ``totals`` since the last ``reset``."""

    def __init__(self, model):
        self.totals, self.stack, self.handles = dict.fromkeys(CATEGORIES, 0.0), [], []
        for name, module in model.named_modules():
            if category(name, {"embed": True}) is not None:
                self.handles.append(module.register_forward_pre_hook(partial(self.enter, name), with_kwargs=True))
                self.handles.append(module.register_forward_hook(partial(self.leave, name), always_call=True))

    def enter(self, name, module, args, kwargs):
        self.stack.append([category(name, kwargs), 0.0, time.thread_time()])

    def leave(self, name, module, args, output):
        t = time.thread_time()
        cat, children, t0 = self.stack.pop()
        self.totals[cat] += (t - t0) - children
        if self.stack:
            self.stack[-1][1] += t - t0

    def reset(self) -> None:
        self.totals = dict.fromkeys(CATEGORIES, 0.0)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure(model, ids: torch.Tensor, steps: int, hooks: bool) -> tuple[dict, list[dict]]:
    """The prefill's and each decode step's record: ``total`` (the forward's CPU time), ``wall`` and, with hooks,
    each category's CPU time, seconds."""
    split = Split(model) if hooks else None

    def call(**kw):
        if split:
            split.reset()
        t, wall = time.thread_time(), time.perf_counter()
        out = model(**kw, use_cache=True, logits_to_keep=1)
        record = {
            "total": time.thread_time() - t,
            "wall": time.perf_counter() - wall,
            **(split.totals if split else {}),
        }
        return out.cache, out.logits[:, -1:].argmax(-1), record

    try:
        with torch.inference_mode():
            cache, tok, prefill = call(input_ids=ids)
            decode = []
            for _ in range(steps):
                cache, tok, record = call(input_ids=tok, cache=cache)
                decode.append(record)
    finally:
        if split:
            split.remove()
    return prefill, decode


def params(model, names) -> int:
    """Parameters of the named modules of ``model`` (those it has)."""
    modules = dict(model.named_modules())
    return sum(p.numel() for n in names if n in modules for p in modules[n].parameters())


def fractions(model, source) -> dict:
    """The output's parameters over the source's: decoder linears, lm_head."""
    lin = [n for n, _ in model.named_modules() if LINEAR.fullmatch(n)]
    src_lin = [n for n, _ in source.named_modules() if LINEAR.fullmatch(n)]
    head = [n for n in HEAD if n != "model.embed_tokens.matrix" or "lm_head" not in dict(model.named_modules())]
    return {
        "linears": params(model, lin) / params(source, src_lin),
        "lm_head": params(model, head) / params(source, ["lm_head"]),
    }


def ms(values) -> float:
    return round(1e3 * values, 3)


def summary(runs: list[dict], names: list[str], fraction: dict) -> dict:
    """Per model and phase, over every sample (rounds × steps): the best (least) ms of each category (hooked
    runs) and of the step without hooks, which on a shared machine are the closest to its unloaded times,
    and their medians; the speed-up over the source: best over best, and the median over rounds of the
    source's mean step time over the model's in the same round (hook-free)."""
    out = {}
    src = {r["round"]: r for r in runs if r["config"] == "source" and not r["hooks"]}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        out[name] = {"fraction": fraction.get(name)}
        for phase in ("prefill", "decode"):
            hooked = [s for r in mine if r["hooks"] for s in r[phase]]
            free = [s["total"] for r in mine if not r["hooks"] for s in r[phase]]
            row = {c: ms(min(s[c] for s in hooked)) for c in CATEGORIES}
            row["median"] = {c: ms(statistics.median(s[c] for s in hooked)) for c in CATEGORIES}
            row.update(step_ms=ms(min(free)), step_median_ms=ms(statistics.median(free)))
            ratios = [
                statistics.mean(s["total"] for s in src[r["round"]][phase])
                / statistics.mean(s["total"] for s in r[phase])
                for r in mine
                if not r["hooks"]
            ]
            row["paired_speedup"] = round(statistics.median(ratios), 3)
            out[name][phase] = row
        for phase in ("prefill", "decode"):
            out[name][phase]["best_speedup"] = round(out["source"][phase]["step_ms"] / out[name][phase]["step_ms"], 3)
    return out


def bound(src: dict, p_lin: float, p_head: float | None = None) -> float:
    """The source's step over the same step with its linears (and lm_head) at ``p`` of their time."""
    total = sum(src[c] for c in CATEGORIES)
    saved = src["linears"] * (1 - p_lin) + (src["lm_head"] * (1 - p_head) if p_head is not None else 0.0)
    return total / (total - saved)


def tables(result: dict) -> list[dict]:
    models, out = result["models"], []
    for phase, what in (("decode", "one decode step at a {L}-token context"), ("prefill", "a {L}-token prefill")):
        steps = f" × {result['steps']} steps" if phase == "decode" else ""
        src = models["source"][phase]
        rows = []
        for name, m in models.items():
            row = m[phase]
            total = sum(row[c] for c in CATEGORIES)
            cells = [f"{row[c]:.2f}" + ("" if name != "source" else f" ({row[c] / total:.0%})") for c in CATEGORIES]
            rows.append(
                [
                    CONFIGS[name][0],
                    f"{row['step_ms']:.1f}",
                    *cells,
                    _x(src["linears"], row["linears"]),
                    _x(src["lm_head"], row["lm_head"]),
                ]
            )
        out.append(
            {
                "name": phase,
                "caption": f"Where {what.format(L=result['context'])} goes: the best (least) ms of each category "
                f"over {result['rounds']} rounds{steps} (hooked runs; the source's share of the categories' sum in "
                "brackets), the best step without hooks, and the linears' and lm_head's speed-up over the source's.",
                "columns": [
                    "model",
                    "step ms (no hooks)",
                    *CATEGORIES.values(),
                    "linears × faster",
                    "lm_head × faster",
                ],
                "rows": rows,
            }
        )
    rows = []
    for name, m in models.items():
        if name == "source":
            continue
        f = m["fraction"]
        row = [CONFIGS[name][0], f"{f['linears']:.3f}", f"{f['lm_head']:.3f}", f"{1 / f['linears']:.2f}"]
        for phase in ("decode", "prefill"):
            src = models["source"][phase]
            row += [
                _x(src["linears"], m[phase]["linears"]),
                f"{bound(src, f['linears']):.2f}",
                f"{bound(src, f['linears'], f['lm_head']):.2f}",
                f"{m[phase]['best_speedup']:.2f} / {m[phase]['paired_speedup']:.2f}",
            ]
        rows.append(row)
    out.append(
        {
            "name": "bound",
            "caption": "Parameter fractions (the output's over the source's) of the decoder linears and the lm_head; "
            "per phase the linears' measured speed-up (1 / fraction if they ran at their parameter count), the "
            "Amdahl bound from the source's split with the decoder linears at their fraction, the bound with the "
            "lm_head at its fraction too, and the measured speed-up of the whole step without hooks: best over best / "
            "median over rounds of the paired ratio.",
            "columns": [
                "output",
                "linears fraction",
                "lm_head fraction",
                "1 / linears fraction",
                "decode: linears ×",
                "decode bound",
                "decode bound (+ head)",
                "decode measured",
                "prefill: linears ×",
                "prefill bound",
                "prefill bound (+ head)",
                "prefill measured",
            ],
            "rows": rows,
        }
    )
    return out


def _x(ref: float, value: float) -> str:
    return f"{ref / value:.2f}" if value else "–"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        nargs="+",
        default=["lowrank-0.25", "kron-0.25", "gs-0.25", "slice-0.25"],
        choices=[c for c, v in CONFIGS.items() if v[2] and v[2][0] == "compress"],
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=16, help="decode steps per run")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--work", default=str(Path.home() / ".cache" / "hf_symmetry_bench" / "deploy"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    names = ["source", *args.only]
    folders = build_folders(Path(args.work), names)
    tok = AutoTokenizer.from_pretrained(folders["source"])
    text = text_path("hamlet").read_text(encoding="utf-8")
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[:, : args.context]
    models = {
        n: AutoModelForCausalLM.from_pretrained(
            folders[CONFIGS[n][1]], trust_remote_code=True, dtype=torch.float32
        ).eval()
        for n in names
    }
    fraction = {n: fractions(models[n], models["source"]) for n in args.only}
    for model in models.values():
        measure(model, ids[:, :32], 2, hooks=False)  # warm-up
    runs, loads = [], []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names if rnd % 2 == 0 else names[::-1]:
            for hooks in (True, False):
                prefill, decode = measure(models[name], ids, args.steps, hooks)
                runs.append({"config": name, "round": rnd, "hooks": hooks, "prefill": [prefill], "decode": decode})
            print(name, rnd, {k: round(v * 1e3, 2) for k, v in runs[-2]["decode"][-1].items()}, flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, float32, "
        f"{torch.get_num_threads()} thread(s), eager, batch 1",
        "command": "OMP_NUM_THREADS=1 python benchmarks/bench_deploy_profile.py --out "
        "benchmarks/results/deploy_profile.json",
        "clock": "CPU time of the computing thread (time.thread_time); wall time per forward in runs",
        "load_average": [round(min(loads), 1), round(max(loads), 1)],
        "context": args.context,
        "rounds": args.rounds,
        "steps": args.steps,
        "models": summary(runs, names, fraction),
        "runs": [
            {**r, **{k: [{c: ms(v) for c, v in s.items()} for s in r[k]] for k in ("prefill", "decode")}} for r in runs
        ],
    }
    result["tables"] = tables(result)
    for t in result["tables"]:
        print(t["name"], *t["rows"], sep="\n  ")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
