"""Peak host memory (RSS) of the calibrated conversions over the checkpoint size, and their time
against a plain transformers load + forward over the same calibration tokens.

Random-weight Llama checkpoints (float32, several shards, SmolLM2's tokenizer) are generated at
the requested sizes with the same width and more layers, so "flat in depth" shows directly. Each
job runs in a fresh process (``/usr/bin/time`` reads its peak RSS):

* ``to-tpa --k-rank 2 --v-rank 2 --calib britannica-calib``
* ``farr --params-fraction 0.8 --calibrate britannica-calib``
* ``merge --method regmean A A`` (the checkpoint with itself: the calibration and merge work of two inputs)
* ``plain``: ``AutoModelForCausalLM.from_pretrained`` + a forward over the same tokens in 512-token windows

all with ``--calib-tokens 4096`` (``--tokens``), on the CPU, verification off. ``--code DIR`` runs the
jobs with the hf_symmetry source tree in DIR (e.g. an export of an older commit) for a side-by-side
"before" column.

    python benchmarks/bench_calibration_rss.py --sizes 1 3 --out benchmarks/results/calibration_rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HIDDEN, INTER, HEADS, KV, VOCAB = 1536, 4096, 12, 4, 49152
LAYER_BYTES = 4 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV // HEADS + 3 * HIDDEN * INTER + 2 * HIDDEN)
EMBED_BYTES = 4 * VOCAB * HIDDEN

_PLAIN = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_symmetry.calibration import calibration_ids
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = calibration_ids(AutoTokenizer.from_pretrained(sys.argv[1]), "britannica-calib", int(sys.argv[2]))
with torch.no_grad():
    for s in range(0, ids.numel(), 512):
        model(input_ids=ids[s:s + 512][None], use_cache=False)
print("seconds", time.perf_counter() - t)
"""


def make_checkpoint(folder: Path, n_layers: int, seed: int = 0) -> int:
    """A random float32 Llama checkpoint with ``n_layers`` layers (shards of 400 MB); returns its bytes."""
    from transformers import LlamaConfig

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.checkpoint import ShardedWriter

    if (folder / "config.json").is_file():
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=n_layers,
                      num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=4096,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    gen = torch.Generator().manual_seed(seed)
    writer = ShardedWriter(folder, 400 * 10**6)
    rnd = lambda *shape: (0.02 * torch.randn(*shape, generator=gen))  # noqa: E731
    writer.add({"model.embed_tokens.weight": rnd(VOCAB, HIDDEN)})
    kv = HIDDEN * KV // HEADS
    for i in range(n_layers):
        p = f"model.layers.{i}."
        writer.add({p + "input_layernorm.weight": 1 + 0.1 * rnd(HIDDEN),
                    p + "self_attn.q_proj.weight": rnd(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": rnd(kv, HIDDEN),
                    p + "self_attn.v_proj.weight": rnd(kv, HIDDEN), p + "self_attn.o_proj.weight": rnd(HIDDEN, HIDDEN),
                    p + "post_attention_layernorm.weight": 1 + 0.1 * rnd(HIDDEN),
                    p + "mlp.gate_proj.weight": rnd(INTER, HIDDEN), p + "mlp.up_proj.weight": rnd(INTER, HIDDEN),
                    p + "mlp.down_proj.weight": rnd(HIDDEN, INTER)})
    writer.add({"model.norm.weight": torch.ones(HIDDEN)})
    writer.close()
    cfg.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(smollm2_dir()) / name).is_file():
            shutil.copy2(Path(smollm2_dir()) / name, folder / name)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run_job(job: str, ckpt: Path, work: Path, tokens: int, code: Path, threads: int) -> dict:
    out = work / f"out-{job}-{ckpt.name}"
    shutil.rmtree(out, ignore_errors=True)
    cli = [sys.executable, "-m", "hf_symmetry.cli"]
    common = ["--quiet", "--overwrite"]
    argv = {
        "to-tpa": cli + ["to-tpa", str(ckpt), str(out), "--k-rank", "2", "--v-rank", "2", "--calib", "britannica-calib",
                         "--calib-tokens", str(tokens), "--no-verify"] + common,
        "farr": cli + ["farr", str(ckpt), str(out), "--params-fraction", "0.8", "--calibrate", "britannica-calib",
                       "--calib-tokens", str(tokens), "--no-verify"] + common,
        "regmean": cli + ["merge", "--method", "regmean", str(ckpt), str(ckpt), str(out), "--calib-tokens",
                          str(tokens), "--no-eval"] + common,
        "plain": [sys.executable, "-c", _PLAIN, str(ckpt), str(tokens), str(threads)],
    }[job]
    if job != "plain" and code.resolve() == Path(__file__).resolve().parents[1]:   # older trees lack --device
        argv += ["--device", "cpu"]
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB %M"] + argv, capture_output=True, text=True,
                          cwd=code, env=_env(code, threads))
    seconds = time.perf_counter() - start
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS_KB")]
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        return {"job": job, "error": proc.stderr.strip().splitlines()[-3:], "seconds": seconds}
    return {"job": job, "seconds": round(seconds, 1), "peak_rss_bytes": rss[-1] * 1024 if rss else None}


def _env(code: Path, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 3.0], help="checkpoint sizes in GB (default 1 3)")
    p.add_argument("--jobs", nargs="+", default=["to-tpa", "farr", "regmean", "plain"])
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--work", default="/tmp/bench_calibration_rss", help="checkpoints and outputs (default: /tmp/...)")
    p.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                   help="hf_symmetry source tree the jobs run with (default: this checkout)")
    p.add_argument("--label", default="after", help="label of this run in the results (default: after)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per job (default 1)")
    p.add_argument("--out", default=None, help="JSON file to merge the results into")
    args = p.parse_args(argv)
    work = Path(args.work)
    results = []
    for size in args.sizes:
        n_layers = max(1, round((size * 1e9 - EMBED_BYTES) / LAYER_BYTES))
        ckpt = work / f"llama-{n_layers}L"
        nbytes = make_checkpoint(ckpt, n_layers)
        shards = len(list(ckpt.glob("*.safetensors")))
        for job in args.jobs:
            r = run_job(job, ckpt, work, args.tokens, Path(args.code), args.threads)
            r.update(label=args.label, checkpoint_bytes=nbytes, layers=n_layers, shards=shards, tokens=args.tokens)
            if r.get("peak_rss_bytes"):
                r["rss_over_checkpoint"] = round(r["peak_rss_bytes"] / nbytes, 3)
            results.append(r)
            print(json.dumps(r), flush=True)
    for r in results:   # time against the plain load + forward of the same checkpoint, same run
        plain = next((q for q in results if q["job"] == "plain" and q["layers"] == r["layers"] and "error" not in q), None)
        if plain and r["job"] != "plain" and "error" not in r:
            r["time_over_plain"] = round(r["seconds"] / plain["seconds"], 2)
    if args.out:
        path = Path(args.out)
        old = json.loads(path.read_text()) if path.is_file() else {"runs": []}
        old["runs"] = [q for q in old["runs"] if q.get("label") != args.label or q["layers"] not in
                       {r["layers"] for r in results}] + results
        old["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
        old["date"] = time.strftime("%Y-%m-%d")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(old, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
