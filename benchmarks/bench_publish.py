"""Publishing benchmark on the real default model (SmolLM2-135M-Instruct), against the fake Hub of
the test suite (tests/fake_hub.py) on 127.0.0.1:

1. ``hf-symmetry rotate default`` (cached in benchmarks/_cache/publish/): the card it writes.
2. The pre-push load check (isolated Python, forward pass, perplexity recomputed from the card).
3. The push (one commit, every file), then ``from_pretrained("bench/smollm2-rotated",
   trust_remote_code=True)`` in a Python where hf_symmetry cannot be imported: max |Δlogit| of the
   downloaded model against the original SmolLM2 (the symmetry's exactness after the round trip)
   and against the local folder (must be 0).
4. The lm-eval bridge on the built-in smoke task (local text, not a benchmark) for the original
   and the rotated model side by side.

Run: .venv/bin/python benchmarks/bench_publish.py [--limit N]   (writes benchmarks/results/publish.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / "_cache" / "publish"
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT / "tests"))


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
        platform.processor(),
    )


def rotated_folder() -> tuple[Path, float | None]:
    from hf_symmetry.cli import main

    out = CACHE / "smollm2-rotated"
    if (out / "README.md").is_file():
        return out, None
    start = time.perf_counter()
    assert main(["rotate", "default", str(out), "--overwrite", "--quiet"]) == 0
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=12, help="smoke-task items for the lm-eval comparison")
    args = ap.parse_args()

    import torch
    from huggingface_hub import ModelCard, constants

    from fake_hub import FakeHub
    from hf_symmetry.assets import smollm2_dir, text_path
    from hf_symmetry.evaluation.bridge import SMOKE_TASK, run_lm_eval
    from hf_symmetry.hub.entries import lm_eval_card_entries
    from hf_symmetry.evaluation.compare import load_model, load_tokenizer, model_output
    from hf_symmetry.text import read_text, tokenize_text
    from hf_symmetry.hub.check import isolated_env, prepush_check, run_isolated
    from hf_symmetry.hub.push import push_folder

    torch.set_num_threads(2)
    res: dict = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg()},
        "date": "2026-11-21",
        "model": "SmolLM2-135M-Instruct (float32)",
    }
    folder, rotate_s = rotated_folder()
    res["rotate_seconds_incl_verify"] = rotate_s
    card = ModelCard.load(folder / "README.md")
    res["card"] = {
        "exactness": card.data.hf_symmetry["exactness"],
        "size": card.data.hf_symmetry["size"],
        "eval_results": [
            {"metric": r.metric_type, "value": r.metric_value, "dataset": r.dataset_name}
            for r in card.data.eval_results or []
        ],
    }

    start = time.perf_counter()
    check = prepush_check(folder)
    res["prepush_check"] = {**check.as_dict(), "seconds": time.perf_counter() - start}
    print("check", res["prepush_check"], flush=True)

    with FakeHub(lifetime=3600) as hub, tempfile.TemporaryDirectory() as tmp:
        os.environ.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.token)
        constants.HF_HUB_OFFLINE = False
        start = time.perf_counter()
        pushed = push_folder(folder, "bench/smollm2-rotated", check=False, progress=False)
        push_s = time.perf_counter() - start
        res["push"] = {
            "seconds": push_s,
            "files": pushed.files,
            "bytes": pushed.bytes,
            "mb_per_s": pushed.bytes / 1e6 / push_s,
            "commits": len(hub.repos["bench/smollm2-rotated"].commits),
        }
        print("push", res["push"], flush=True)

        ids = tokenize_text(load_tokenizer(folder), read_text(text_path("britannica-eval")), max_tokens=512)
        env = isolated_env(Path(tmp))
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.token, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
        start = time.perf_counter()
        facts, downloaded = run_isolated("bench/smollm2-rotated", ids, Path(tmp), env, tokenizer=True)
        download_s = time.perf_counter() - start
        original = model_output(load_model(smollm2_dir()), ids)[0]
        local = model_output(load_model(folder), ids)[0]
        res["download"] = {
            "seconds_incl_load_and_forward": download_s,
            "class": facts["class"],
            "hf_symmetry_importable": facts["hf_symmetry_importable"],
            "tokens": ids.numel(),
            "max_abs_dlogit_vs_original": (downloaded - original).abs().max().item(),
            "max_abs_dlogit_vs_local_folder": (downloaded - local).abs().max().item(),
            "card_max_abs_dlogit": card.data.hf_symmetry["exactness"]["max_abs_dlogit"],
        }
        print("download", res["download"], flush=True)

    lm = {}
    for name, model in (("original", smollm2_dir()), ("rotated", folder)):
        start = time.perf_counter()
        out = run_lm_eval(model, SMOKE_TASK, limit=args.limit)
        entries = {e["metric_type"]: e["metric_value"] for e in lm_eval_card_entries(out)}
        lm[name] = {**entries, "seconds": time.perf_counter() - start, "items": args.limit}
        print("lm-eval", name, lm[name], flush=True)
    lm["acc_ratio_rotated_over_original"] = (
        lm["rotated"]["acc"] / lm["original"]["acc"] if lm["original"]["acc"] else None
    )
    res["lm_eval_smoke"] = lm
    res["ratios"] = {"check_over_push_seconds": res["prepush_check"]["seconds"] / push_s}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "publish.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
