"""Rotation benchmark: wall time and peak RSS of `hf-symmetry rotate`, side by side with a
plain transformers load + save of the same checkpoint, each in its own fresh process.

1. SmolLM2-135M (the embedded default model).
2. Synthetic multi-shard Llama checkpoints of about 2.5 GB and 3.6 GB (random weights, GQA,
   52 and 76 layers), to show that streaming keeps peak RSS bounded by one layer and the
   embeddings, independent of depth (goal: < 30 % of the checkpoint's size).

Run: .venv/bin/python benchmarks/bench_rotate.py   (writes benchmarks/results/rotate.json)
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / "_cache"
RESULTS = HERE / "results"

SYNTH = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,
    vocab_size=16384,
)

CHILD_PRELUDE = """
import resource, sys, time, json
t0 = time.perf_counter()
"""
CHILD_REPORT = """
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0,
                              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_child(body: str) -> dict:
    code = CHILD_PRELUDE + textwrap.dedent(body) + CHILD_REPORT
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def rotate_job(src: Path, out: Path, shard: str) -> str:
    return f"""
    from hf_symmetry.cli import main
    assert main(["rotate", {str(src)!r}, {str(out)!r}, "--overwrite", "--no-verify",
                 "--quiet", "--max-shard-size", {shard!r}]) == 0
    """


def load_save_job(src: Path, out: Path, shard: str) -> str:
    return f"""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained({str(src)!r}, dtype=torch.float32)
    m.save_pretrained({str(out)!r}, max_shard_size={shard!r})
    """


def make_synthetic_checkpoint(folder: Path, n_layers: int) -> Path:
    """Write a random Llama checkpoint shard by shard (never the whole model in memory)."""
    import torch

    from hf_symmetry.checkpoint_io import ShardedWriter, write_config

    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    c = SYNTH
    d, hd, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    writer = ShardedWriter(tmp, 500 * 10**6)
    writer.add({"model.embed_tokens.weight": rand(c["vocab_size"], d), "model.norm.weight": 1 + rand(d)})
    for i in range(n_layers):
        p = f"model.layers.{i}."
        writer.add(
            {
                p + "self_attn.q_proj.weight": rand(c["num_attention_heads"] * hd, d),
                p + "self_attn.k_proj.weight": rand(c["num_key_value_heads"] * hd, d),
                p + "self_attn.v_proj.weight": rand(c["num_key_value_heads"] * hd, d),
                p + "self_attn.o_proj.weight": rand(d, c["num_attention_heads"] * hd),
                p + "mlp.gate_proj.weight": rand(f, d),
                p + "mlp.up_proj.weight": rand(f, d),
                p + "mlp.down_proj.weight": rand(d, f),
                p + "input_layernorm.weight": 1 + rand(d),
                p + "post_attention_layernorm.weight": 1 + rand(d),
            }
        )
    writer.add({"lm_head.weight": rand(c["vocab_size"], d)})
    writer.close()
    write_config(
        tmp,
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "num_hidden_layers": n_layers,
            **SYNTH,
        },
    )
    tmp.rename(folder)
    return folder


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def bench_pair(name: str, src: Path, shard: str) -> dict:
    out_rot, out_hf = CACHE / f"{name}-rotated", CACHE / f"{name}-hf-resaved"
    rot = run_child(rotate_job(src, out_rot, shard))
    hf = run_child(load_save_job(src, out_hf, shard))
    size = dir_bytes(src)
    row = {
        "checkpoint": name,
        "checkpoint_mb": size / 1e6,
        "rotate": rot,
        "transformers_load_save": hf,
        "time_ratio": rot["seconds"] / hf["seconds"],
        "rss_ratio": rot["peak_rss_mb"] / hf["peak_rss_mb"],
        "rotate_rss_fraction_of_checkpoint": rot["peak_rss_mb"] * 2**20 / size,
    }
    shutil.rmtree(out_rot, ignore_errors=True)
    shutil.rmtree(out_hf, ignore_errors=True)
    return row


def python_baseline() -> dict:
    return run_child("import torch, transformers, hf_symmetry")


def main() -> None:
    from hf_symmetry.assets import smollm2_dir

    CACHE.mkdir(exist_ok=True)
    RESULTS.mkdir(exist_ok=True)
    rows = [bench_pair("smollm2-135m", smollm2_dir(), "2GB")]
    for n_layers in (52, 76):
        src = make_synthetic_checkpoint(CACHE / f"synthetic-llama-{n_layers}L", n_layers)
        rows.append(bench_pair(f"synthetic-llama-{n_layers}L", src, "500MB"))
    baseline = python_baseline()
    cpu = subprocess.run(
        ["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu}, {platform.machine()}",
        "import_baseline": baseline,
        "rows": rows,
    }
    (RESULTS / "rotate.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"machine: {report['machine']}; python+torch+transformers+hf_symmetry import alone: "
        f"{baseline['peak_rss_mb']:.0f} MB RSS"
    )
    print(
        "| checkpoint | size | rotate: time / peak RSS | transformers load+save: time / peak RSS | time ratio | "
        "RSS ratio | rotate RSS / checkpoint |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['checkpoint']} | {r['checkpoint_mb']:.0f} MB | {r['rotate']['seconds']:.1f} s / "
            f"{r['rotate']['peak_rss_mb']:.0f} MB | {r['transformers_load_save']['seconds']:.1f} s / "
            f"{r['transformers_load_save']['peak_rss_mb']:.0f} MB | {r['time_ratio']:.2f} | {r['rss_ratio']:.2f} | "
            f"{100 * r['rotate_rss_fraction_of_checkpoint']:.1f} % |"
        )


if __name__ == "__main__":
    main()
