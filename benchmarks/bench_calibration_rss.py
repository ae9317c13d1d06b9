"""Peak host memory (RSS) of the calibrated conversions over the checkpoint size, and their time
against a plain transformers load + forward over the same calibration tokens.

Random-weight Llama checkpoints (several shards, SmolLM2's tokenizer) are generated layer by layer
(generation itself holds one layer) at the requested sizes with the same width and more layers,
so "flat in depth" shows directly. ``--shape llama3-8b`` uses Llama-3-8B's shapes instead (hidden
4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, vocabulary 128256; bfloat16, about 16 GB).
Each job runs in a fresh process (``/usr/bin/time`` reads its peak RSS and CPU time):

* ``to-tpa --k-rank 2 --v-rank 2 --calib britannica-calib``
* ``farr --params-fraction 0.8 --calibrate britannica-calib``
* ``merge --method regmean A A`` (the checkpoint with itself: the calibration and merge work of two inputs)
* ``slice``: ``compress --structure slice --calib britannica-calib`` (SliceGPT)
* ``lowrank-seq``: ``compress --structure lowrank --sequential --calib britannica-calib``
* ``lowrank``: ``compress --structure lowrank --calib britannica-calib`` (stage W on one pass's statistics)
* ``plain``: ``AutoModelForCausalLM.from_pretrained`` + a forward over the same tokens in 512-token windows

all with ``--calib-tokens 4096`` (``--tokens``), on the CPU, verification off. ``--code DIR`` runs the
jobs with the hf_symmetry source tree in DIR (e.g. an export of an older commit) for a side-by-side
"before" column.

    python benchmarks/bench_calibration_rss.py --sizes 1 3 --out benchmarks/results/calibration_rss.json
    python benchmarks/bench_calibration_rss.py --shape llama3-8b --jobs to-tpa farr --tokens 1024 \
        --label 8b --out benchmarks/results/calibration_rss.json
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

# name -> (hidden, FFN, heads, KV heads, vocabulary, dtype, tied embeddings, fixed number of layers)
SHAPES = {
    "bench": (1536, 4096, 12, 4, 49152, torch.float32, True, None),
    "llama3-8b": (4096, 14336, 32, 8, 128256, torch.bfloat16, False, 32),
}


def layer_bytes(shape: str) -> int:
    hidden, inter, heads, kv, _, dtype, _, _ = SHAPES[shape]
    element = torch.empty((), dtype=dtype).element_size()
    return element * (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * inter + 2 * hidden)


def embed_bytes(shape: str) -> int:
    hidden, _, _, _, vocab, dtype, tied, _ = SHAPES[shape]
    return torch.empty((), dtype=dtype).element_size() * vocab * hidden * (1 if tied else 2)


_PLAIN = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_symmetry.calibration import calibration_ids
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="auto").eval()
ids = calibration_ids(AutoTokenizer.from_pretrained(sys.argv[1]), "britannica-calib", int(sys.argv[2]))
with torch.no_grad():
    for s in range(0, ids.numel(), 512):
        model(input_ids=ids[s:s + 512][None], use_cache=False)
print("seconds", time.perf_counter() - t)
"""


def make_checkpoint(folder: Path, n_layers: int, shape: str = "bench", seed: int = 0) -> int:
    """A random Llama checkpoint of ``shape`` with ``n_layers`` layers (shards of 400 MB), written
    layer by layer; returns its bytes."""
    from transformers import LlamaConfig

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.checkpoint_io import ShardedWriter

    if (folder / "config.json").is_file():
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    hidden, inter, heads, kv_heads, vocab, dtype, tied, _ = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(seed)
    writer = ShardedWriter(folder, 400 * 10**6)
    rnd = lambda *size: (0.02 * torch.randn(*size, generator=gen)).to(dtype)  # noqa: E731
    ones = lambda: (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)  # noqa: E731
    writer.add({"model.embed_tokens.weight": rnd(vocab, hidden)})
    kv = hidden * kv_heads // heads
    for i in range(n_layers):
        p = f"model.layers.{i}."
        writer.add(
            {
                p + "input_layernorm.weight": ones(),
                p + "self_attn.q_proj.weight": rnd(hidden, hidden),
                p + "self_attn.k_proj.weight": rnd(kv, hidden),
                p + "self_attn.v_proj.weight": rnd(kv, hidden),
                p + "self_attn.o_proj.weight": rnd(hidden, hidden),
                p + "post_attention_layernorm.weight": ones(),
            }
        )
        for name, size in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            writer.add({p + f"mlp.{name}.weight": rnd(*size)})  # one matrix at a time
    writer.add({"model.norm.weight": torch.ones(hidden, dtype=dtype)})
    if not tied:
        writer.add({"lm_head.weight": rnd(vocab, hidden)})
    writer.close()
    cfg.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(smollm2_dir()) / name).is_file():
            shutil.copy2(Path(smollm2_dir()) / name, folder / name)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _child_hwm(pid: int) -> int | None:
    """Peak RSS (VmHWM, bytes) of the process ``/usr/bin/time`` (``pid``) runs, read from /proc."""
    try:
        child = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        status = Path(f"/proc/{child[0]}/status").read_text() if child else ""
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return None


def run_job(
    job: str, ckpt: Path, work: Path, tokens: int, code: Path, threads: int, timeout: float | None = None
) -> dict:
    out = work / f"out-{job}-{ckpt.name}"
    shutil.rmtree(out, ignore_errors=True)
    cli = [sys.executable, "-m", "hf_symmetry.cli"]
    common = ["--quiet", "--overwrite"]
    argv = {
        "to-tpa": cli
        + [
            "to-tpa",
            str(ckpt),
            str(out),
            "--k-rank",
            "2",
            "--v-rank",
            "2",
            "--calib",
            "britannica-calib",
            "--calib-tokens",
            str(tokens),
            "--no-verify",
        ]
        + common,
        "farr": cli
        + [
            "farr",
            str(ckpt),
            str(out),
            "--params-fraction",
            "0.8",
            "--calibrate",
            "britannica-calib",
            "--calib-tokens",
            str(tokens),
            "--no-verify",
        ]
        + common,
        "regmean": cli
        + ["merge", "--method", "regmean", str(ckpt), str(ckpt), str(out), "--calib-tokens", str(tokens), "--no-eval"]
        + common,
        "slice": cli
        + [
            "compress",
            str(ckpt),
            str(out),
            "--structure",
            "slice",
            "--calib",
            "britannica-calib",
            "--calib-tokens",
            str(tokens),
        ]
        + common,
        "lowrank-seq": cli
        + [
            "compress",
            str(ckpt),
            str(out),
            "--structure",
            "lowrank",
            "--sequential",
            "--calib",
            "britannica-calib",
            "--calib-tokens",
            str(tokens),
        ]
        + common,
        "lowrank": cli
        + [
            "compress",
            str(ckpt),
            str(out),
            "--structure",
            "lowrank",
            "--calib",
            "britannica-calib",
            "--calib-tokens",
            str(tokens),
        ]
        + common,
        "plain": [sys.executable, "-c", _PLAIN, str(ckpt), str(tokens), str(threads)],
    }[job]
    if job != "plain" and code.resolve() == Path(__file__).resolve().parents[1]:  # older trees lack --device
        argv += ["--device", "cpu"]
    compress_cli = code / "hf_symmetry" / "commands" / "compress.py"
    if job in ("slice", "lowrank-seq", "lowrank") and "add_verify_args" in compress_cli.read_text():
        argv += ["--no-verify"]  # newer trees verify by default; the benchmark measures the conversion
    start = time.perf_counter()
    log = work / f"{job}-{ckpt.name}.stderr"
    with open(log, "w") as err:  # a file, not a pipe: a chatty job cannot block on a full pipe
        proc = subprocess.Popen(
            ["/usr/bin/time", "-f", "MAXRSS_KB %M CPU_S %U %S"] + argv,
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=code,
            env=_env(code, threads),
            start_new_session=True,
        )
    hwm = 0
    while proc.poll() is None:  # the peak so far, for a job stopped at the time limit
        hwm = max(hwm, _child_hwm(proc.pid) or 0)
        if timeout is not None and time.perf_counter() - start > timeout:
            os.killpg(proc.pid, 9)
            proc.wait()
            for partial in [out, *work.glob(f".{out.name}.partial-*")]:  # what the killed job left
                shutil.rmtree(partial, ignore_errors=True)
            return {
                "job": job,
                "error": f"stopped at the time limit ({timeout:.0f} s)",
                "seconds": round(time.perf_counter() - start, 1),
                "peak_rss_bytes_so_far": hwm,
            }
        time.sleep(2)
    stderr = log.read_text()
    seconds = time.perf_counter() - start
    stats = [line.split() for line in stderr.splitlines() if line.startswith("MAXRSS_KB")]
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        return {"job": job, "error": stderr.strip().splitlines()[-3:], "seconds": round(seconds, 1)}
    rss, cpu = (int(stats[-1][1]) * 1024, float(stats[-1][3]) + float(stats[-1][4])) if stats else (None, None)
    return {"job": job, "seconds": round(seconds, 1), "cpu_seconds": cpu, "peak_rss_bytes": rss}


def _merge_into(out: str | None, label: str, results: list[dict]) -> None:
    """Merge ``results`` into the JSON file ``out`` (replacing earlier rows of the same label, job and
    checkpoint) and give every row its time over the plain load + forward of the same checkpoint
    (wall and CPU seconds)."""
    if not out:
        return
    path = Path(out)
    old = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    key = lambda q: (q.get("label"), q["job"], q["layers"], q.get("shape", "bench"))  # noqa: E731
    new = {key(r) for r in results}
    runs = [q for q in old["runs"] if key(q) not in new] + results
    for r in runs:
        plain = next(
            (
                q
                for q in runs
                if q["job"] == "plain"
                and q["layers"] == r["layers"]
                and q.get("shape", "bench") == r.get("shape", "bench")
                and "error" not in q
            ),
            None,
        )
        if plain and r["job"] != "plain" and "error" not in r:
            r["time_over_plain"] = round(r["seconds"] / plain["seconds"], 2)
            if r.get("cpu_seconds") and plain.get("cpu_seconds"):
                r["cpu_over_plain"] = round(r["cpu_seconds"] / plain["cpu_seconds"], 2)
    old["runs"] = runs
    old["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    old["date"] = time.strftime("%Y-%m-%d")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=2) + "\n")


def _env(code: Path, threads: int) -> dict:
    env = dict(
        os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"
    )
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 3.0], help="checkpoint sizes in GB (default 1 3)")
    p.add_argument(
        "--jobs",
        nargs="+",
        default=["to-tpa", "farr", "regmean", "slice", "lowrank-seq", "plain"],
        choices=["to-tpa", "farr", "regmean", "slice", "lowrank-seq", "lowrank", "plain"],
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="bench",
        help="checkpoint shapes (default: bench, width 1536; llama3-8b: one 16 GB checkpoint)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of a fixed-shape checkpoint (default: the shape's own, 32 for llama3-8b); fewer "
        "give a shallow checkpoint of the same widths, whose per-layer peak is the deep one's",
    )
    p.add_argument("--delete", action="store_true", help="delete each generated checkpoint after its jobs")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--work", default="/tmp/bench_calibration_rss", help="checkpoints and outputs (default: /tmp/...)")
    p.add_argument(
        "--code",
        default=str(Path(__file__).resolve().parents[1]),
        help="hf_symmetry source tree the jobs run with (default: this checkout)",
    )
    p.add_argument("--label", default="after", help="label of this run in the results (default: after)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per job (default 1)")
    p.add_argument("--out", default=None, help="JSON file to merge the results into")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop a job after this many seconds (its peak RSS so far is recorded)",
    )
    args = p.parse_args(argv)
    work = Path(args.work)
    results = []
    fixed = args.layers or SHAPES[args.shape][-1]
    for size in [None] if fixed else args.sizes:
        n_layers = fixed or max(1, round((size * 1e9 - embed_bytes(args.shape)) / layer_bytes(args.shape)))
        ckpt = work / (f"{args.shape}-{n_layers}L" if args.shape != "bench" else f"llama-{n_layers}L")
        nbytes = make_checkpoint(ckpt, n_layers, args.shape)
        shards = len(list(ckpt.glob("*.safetensors")))
        for job in args.jobs:
            r = run_job(job, ckpt, work, args.tokens, Path(args.code), args.threads, args.timeout)
            r.update(
                label=args.label,
                shape=args.shape,
                checkpoint_bytes=nbytes,
                layers=n_layers,
                shards=shards,
                tokens=args.tokens,
            )
            if r.get("peak_rss_bytes"):
                r["rss_over_checkpoint"] = round(r["peak_rss_bytes"] / nbytes, 3)
            results.append(r)
            print(json.dumps(r), flush=True)
            _merge_into(args.out, args.label, results)  # partial results survive an interrupted run
        if args.delete:
            shutil.rmtree(ckpt, ignore_errors=True)
    _merge_into(args.out, args.label, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
