"""GS's one-token path (issue 47) on whole models, paired in one process: SmolLM2 compressed with GS at
``--ratio`` 0.25 and 0.5 (bench_deploy.py's folders, their own remote code) against the source, each GS model
run with its one-token path (``GSLinear._one_token``: two ``mm`` with the weights on the left) and with one
token through its batched matmuls instead (the path before), in turn within every round.

On a shared machine, bench_deploy.py's fresh process per measurement pairs the source with an output measured
a minute later; here every configuration of a round runs within seconds of the others, in one process
(float32, one thread, a 512-token prompt of hamlet then 16 decode steps on a dynamic cache). A speed-up is the
median over rounds of the source's time over the configuration's time in the same round.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gs_one_token.py --out benchmarks/results/gs_one_token.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_symmetry.assets import smollm2_dir, text_path

WORK = Path.home() / ".cache" / "hf_symmetry_bench" / "deploy"  # bench_deploy.py's folders
STEPS = 16


def bmm_one_token(self, x: torch.Tensor) -> torch.Tensor:
    """One token through the batched matmuls (GSLinear's path for several tokens)."""
    kl, kr, b = self.kl, self.kr, self.rank
    h = torch.bmm(x.reshape(kr, 1, -1), self.gs_right.mT).view(kr, kl, b).transpose(0, 1)
    return torch.bmm(h.reshape(kl, 1, kr * b), self.gs_left.mT).reshape(x.shape[:-1] + (self.out_features,))


def measure(model, ids: torch.Tensor) -> tuple[float, float]:
    """(prefill s, decode ms/token): the prompt into a dynamic cache, then STEPS greedy one-token steps."""
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(STEPS):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return prefill, (time.perf_counter() - t) / STEPS * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    source = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(source)
    ids = tok(text_path("hamlet").read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, : args.context]
    models = {"source": AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()}
    for r in ("0.25", "0.5"):
        models[f"gs-{r}"] = AutoModelForCausalLM.from_pretrained(WORK / f"gs-{r}", trust_remote_code=True).eval()
    gs_class = next(type(m) for m in models["gs-0.25"].modules() if type(m).__name__ == "GSLinear")
    one_token = gs_class._one_token
    configs = [("source", None), ("gs-0.25", one_token), ("gs-0.25", bmm_one_token)]
    configs += [("gs-0.5", one_token), ("gs-0.5", bmm_one_token)]
    for model in models.values():
        measure(model, ids)  # warm-up
    rows, loads = [], []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, path in configs if rnd % 2 == 0 else configs[::-1]:  # the order alternates: drift falls on all
            if path is not None:
                gs_class._one_token = path
            prefill, decode = measure(models[name], ids)
            path_name = "" if path is None else ("one-token mm" if path is one_token else "batched matmul")
            rows.append(
                {"round": rnd, "config": name, "one_token": path_name, "prefill_s": prefill, "decode_ms": decode}
            )
            print(rows[-1], flush=True)
    gs_class._one_token = one_token
    summary = []
    for name, path in configs[1:]:
        path_name = "one-token mm" if path is one_token else "batched matmul"
        mine = [r for r in rows if r["config"] == name and r["one_token"] == path_name]
        src = {r["round"]: r for r in rows if r["config"] == "source"}
        ratio = {k: statistics.median(src[r["round"]][k] / r[k] for r in mine) for k in ("prefill_s", "decode_ms")}
        summary.append([f"compress gs {name[3:]}", path_name, f"{ratio['prefill_s']:.2f}", f"{ratio['decode_ms']:.2f}"])
        summary[-1].append(f"{statistics.median(r['decode_ms'] for r in mine):.1f}")
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, float32, 1 thread",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gs_one_token.py --out "
        "benchmarks/results/gs_one_token.json",
        "load_average": [round(min(loads), 1), round(max(loads), 1)],
        "tables": [
            {
                "name": "main",
                "caption": f"Speed-up over the source in the same round (median of {args.rounds} rounds), "
                f"{args.context}-token prompt / decode; decode ms/token median of the GS model",
                "columns": ["output", "one token through", "prefill", "decode", "decode ms/token"],
                "rows": summary,
            }
        ],
        "source_decode_ms": round(statistics.median(r["decode_ms"] for r in rows if r["config"] == "source"), 1),
        "runs": rows,
    }
    for row in summary:
        print(row)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
