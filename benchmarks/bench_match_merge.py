"""Benchmark: rotation-symmetry matching and model merging (issue 3).

    .venv/bin/python benchmarks/bench_match_merge.py [--part independent|finetune|time ...] [--quick]

Three parts, each side by side in one run:

* ``independent``: two small Llama-style models (RoPE, GQA 4/2, 4 layers, byte-level BPE vocabulary
  of 2048 trained on the same text) trained on the CPU from different seeds on the same text for
  the same steps; held-out perplexity of each end model, of their plain average, and of the average
  after matching (heads+FFN, +scaling, +residual stream, +residual refinement), with the distance
  reduction of each match.
* ``finetune``: two short full fine-tunes of SmolLM2-135M-Instruct on different texts (Britannica
  prose, Hamlet); held-out perplexity on both texts of average / TIES / Fisher / RegMean merges,
  each with and without matching.
* ``time``: ``hf-symmetry match`` of SmolLM2 to one fine-tune, and mergekit's ``linear`` merge of the
  same pair, timed in the same run (ratio).

Trained models are cached under ``benchmarks/_cache/match_merge/``; figures go to
``benchmarks/results/match_merge.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from hf_symmetry.assets import smollm2_dir, text_path
from hf_symmetry.conversion.match import MatchOptions, match_checkpoint, match_state_dict
from hf_symmetry.conversion.merge import merge_state_dicts
from hf_symmetry.evaluation.perplexity import perplexity
from hf_symmetry.text import read_text, tokenize_text
from hf_symmetry.evaluation.compare import load_model, load_tokenizer, model_from_state_dict

HERE = Path(__file__).resolve().parent
CACHE = HERE / "_cache" / "match_merge"
RESULTS = HERE / "results" / "match_merge.json"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        ),
        platform.processor(),
    )
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "date": "2026-11-21"}


def ppl(model, ids: torch.Tensor, window: int, stride: int) -> float:
    return perplexity(model, ids, window=window, stride=stride, progress=False).perplexity


# --------------------------------------------------------------------------- independent pair


TRAIN_TEXTS = ("britannica-calib", "hamlet", "lear", "tempest")
TINY = dict(
    vocab_size=2048,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=352,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
)


def bpe_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (vocabulary 2048) trained once on the training texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not (folder / "tokenizer.json").is_file():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=TINY["vocab_size"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"],
            show_progress=False,
        )
        tok.train_from_iterator([read_text(text_path(n)) for n in TRAIN_TEXTS], trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        folder.mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def train_tiny(folder: Path, tokenizer, seed: int, steps: int, batch: int = 8, seq: int = 128) -> Path:
    """Train one small Llama from ``seed`` (initialisation and data order) and cache it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    ids = torch.cat([tokenize_text(tokenizer, read_text(text_path(n))) for n in TRAIN_TEXTS])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(f"  seed {seed} step {step}: loss {loss.item():.3f}")
    model.eval()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".train-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "training.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "steps": steps,
                "batch": batch,
                "seq": seq,
                "texts": TRAIN_TEXTS,
                "seconds": time.perf_counter() - start,
            }
        )
    )
    tmp.replace(folder)
    return folder


def part_independent(quick: bool) -> dict:
    steps = 60 if quick else 1000
    root = CACHE / f"independent-{steps}"
    tokenizer = bpe_tokenizer(CACHE / "bpe-2048")
    folders = [train_tiny(root / f"seed{s}", tokenizer, s, steps) for s in (0, 1)]
    eval_ids = tokenize_text(tokenizer, read_text(text_path("britannica-eval")), 8192)
    models = [load_model(f) for f in folders]
    sds = [m.state_dict() for m in models]
    config = models[0].config.to_dict()
    out = {
        "model": {k: v for k, v in TINY.items() if k != "rope_parameters"},
        "steps": steps,
        "train_texts": list(TRAIN_TEXTS),
        "eval": {"text": "britannica-eval", "tokens": eval_ids.numel()},
        "perplexity": {},
        "distance": {},
        "seconds": {},
    }

    def record(name: str, model) -> None:
        out["perplexity"][name] = ppl(model, eval_ids, 256, 128)
        log(f"  {name:<32} perplexity {out['perplexity'][name]:.2f}")

    record("end model A (seed 0)", models[0])
    record("end model B (seed 1)", models[1])
    plain = merge_state_dicts(sds, config, {"merge_method": "average", "models": ["A", "B"]})
    record("plain average", model_from_state_dict(plain.outcome.config, plain.state_dict))
    variants = {
        "matched: residual only": MatchOptions(heads="none", ffn=False, residual=True),
        "matched: heads + FFN": MatchOptions(),
        "matched: heads + FFN + scaling": MatchOptions(scaling=True),
        "matched: + residual (embeddings)": MatchOptions(scaling=True, residual=True),
        "matched: + residual, 3 refinements": MatchOptions(scaling=True, residual=True, residual_iters=3),
        "matched: + residual, 10 refinements": MatchOptions(scaling=True, residual=True, residual_iters=10),
    }
    for name, options in variants.items():
        start = time.perf_counter()
        m = match_state_dict(sds[0], sds[1], config, options)
        out["seconds"][name] = time.perf_counter() - start
        total = m.distances.summary()["total"]
        out["distance"][name] = {
            "relative_before": total["relative_before"],
            "relative_after": total["relative_after"],
            "reduction": total["reduction"],
        }
        merged = merge_state_dicts(
            sds, config, {"merge_method": "average", "models": ["A", "B"], "match": vars(options)}
        )
        record(f"average, {name}", model_from_state_dict(merged.outcome.config, merged.state_dict))
        log(
            f"    distance {total['relative_before']:.3f} -> {total['relative_after']:.3f} "
            f"({100 * total['reduction']:.1f} % of the squared distance removed)"
        )
    # data-dependent merges of the same pair (calibration: training text, never the held-out text)
    calib = tokenize_text(tokenizer, read_text(text_path("britannica-calib")), 512 if quick else 4096)
    out["calibration_tokens"] = calib.numel()
    best = MatchOptions(scaling=True, residual=True, residual_iters=3)
    for method in ("regmean", "fisher"):
        for options in (None, best):
            recipe = {"merge_method": method, "models": ["A", "B"], "calibration": {"seq_len": 128}}
            if options is not None:
                recipe["match"] = vars(options)
            merged = merge_state_dicts(sds, config, recipe, calibration_ids=calib)
            label = f"{method}{', matched: + residual, 3 refinements' if options else ', not matched'}"
            record(label, model_from_state_dict(merged.outcome.config, merged.state_dict))
    return out


# --------------------------------------------------------------------------- same-base pair


FT_TEXTS = {"britannica": ("britannica-calib", "britannica-eval"), "hamlet": ("hamlet", "hamlet")}


def split_text(name: str) -> tuple[str, str]:
    """(training text, held-out text) for a fine-tuning corpus; Hamlet is split 70/30."""
    train, held = FT_TEXTS[name]
    if train != held:
        return read_text(text_path(train)), read_text(text_path(held))
    text = read_text(text_path(train))
    cut = text.index("\n", int(0.7 * len(text)))
    return text[:cut], text[cut:]


def finetune_smollm2(
    folder: Path, text: str, steps: int, batch: int = 2, seq: int = 256, seed: int = 0, lr: float = 1e-4
) -> Path:
    if (folder / "config.json").is_file():
        return folder
    base = smollm2_dir()
    tok = load_tokenizer(base)
    ids = tokenize_text(tok, text)
    model = load_model(base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log(f"  {folder.name} step {step}: loss {loss.item():.3f}")
    model.eval()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".ft-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "training.json").write_text(
        json.dumps({"steps": steps, "batch": batch, "seq": seq, "lr": lr, "seconds": time.perf_counter() - start})
    )
    tmp.replace(folder)
    return folder


def part_finetune(quick: bool) -> dict:
    steps = 2 if quick else 20
    root = CACHE / f"smollm2-ft-{steps}"
    texts = {name: split_text(name) for name in FT_TEXTS}
    folders = {name: finetune_smollm2(root / name, texts[name][0], steps) for name in FT_TEXTS}
    tok = load_tokenizer(smollm2_dir())
    eval_ids = {name: tokenize_text(tok, held, 512 if quick else 1024) for name, (_, held) in texts.items()}
    per_text = 256 if quick else 1024  # calibration: the start of each training text, whole sequences of 256
    calib = torch.cat([tokenize_text(tok, texts[n][0], per_text) for n in FT_TEXTS])
    base_model = load_model(smollm2_dir())
    base = base_model.state_dict()
    config = base_model.config.to_dict()
    sds = [load_model(folders[n]).state_dict() for n in FT_TEXTS]
    out = {
        "steps": steps,
        "texts": {n: list(v) for n, v in FT_TEXTS.items()},
        "eval_tokens": {n: ids.numel() for n, ids in eval_ids.items()},
        "calibration_tokens": calib.numel(),
        "perplexity": {},
        "seconds": {},
        "distance_reduction": {},
    }

    def record(name: str, model) -> None:
        out["perplexity"][name] = {n: ppl(model, ids, 512, 256) for n, ids in eval_ids.items()}
        log(f"  {name:<28} " + "  ".join(f"{n} {v:.3f}" for n, v in out["perplexity"][name].items()))

    record("SmolLM2 (base)", base_model)
    del base_model
    for n, sd in zip(FT_TEXTS, sds):
        record(f"fine-tune on {n}", model_from_state_dict(config, sd))
    methods = {"average": {}, "ties": {"parameters": {"density": 0.5}}, "fisher": {}, "regmean": {}}
    for method, extra in methods.items():
        for match in (False, True):
            recipe = {
                "merge_method": method,
                "models": list(FT_TEXTS),
                **extra,
                "calibration": {"tokens": calib.numel()},
            }
            if match:
                recipe["match"] = True
            base_sd = None
            if method == "ties":
                recipe["base_model"] = "smollm2"
                base_sd = base
            start = time.perf_counter()
            merged = merge_state_dicts(sds, config, recipe, base=base_sd, calibration_ids=calib)
            name = f"{method}{' + match' if match else ''}"
            out["seconds"][name] = time.perf_counter() - start
            for src, d in merged.outcome.distances.items():
                out["distance_reduction"].setdefault(name, {})[src] = d["total"]["reduction"]
            record(name, model_from_state_dict(merged.outcome.config, merged.state_dict))
            del merged
    return out


# --------------------------------------------------------------------------- time


def mergekit_exe() -> str | None:
    exe = Path(sys.executable).parent / "mergekit-yaml"
    return str(exe) if exe.is_file() else shutil.which("mergekit-yaml")


def part_time(quick: bool) -> dict:
    steps = 2 if quick else 20
    tuned = CACHE / f"smollm2-ft-{steps}" / "britannica"
    if not (tuned / "config.json").is_file():
        finetune_smollm2(tuned, split_text("britannica")[0], steps)
    base = smollm2_dir()
    out = {"pair": [str(base.name), f"fine-tune ({tuned.parent.name}/{tuned.name})"], "runs": []}
    exe = mergekit_exe()
    if exe is None:
        out["mergekit"] = "not installed (pip install mergekit)"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        tmp = Path(tmp)
        recipe = tmp / "linear.yaml"
        recipe.write_text(
            yaml.safe_dump(
                {
                    "merge_method": "linear",
                    "dtype": "float32",
                    "models": [
                        {"model": str(base), "parameters": {"weight": 1.0}},
                        {"model": str(tuned), "parameters": {"weight": 1.0}},
                    ],
                }
            )
        )
        for run in range(1 if quick else 2):
            row = {}
            for name, options in (
                ("match", MatchOptions()),
                ("match + scaling + residual", MatchOptions(scaling=True, residual=True)),
            ):
                start = time.perf_counter()
                match_checkpoint(base, tuned, tmp / f"m{run}-{len(row)}", options, progress=False)
                row[name] = time.perf_counter() - start
            if exe:
                start = time.perf_counter()
                res = subprocess.run(
                    [exe, str(recipe), str(tmp / f"mk{run}")],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
                )
                row["mergekit linear (subprocess)"] = time.perf_counter() - start
                if res.returncode:
                    raise RuntimeError(res.stderr[-2000:])
            log("  " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items()))
            out["runs"].append(row)
    if exe:
        best = {k: min(r[k] for r in out["runs"]) for k in out["runs"][0]}
        out["best_seconds"] = best
        out["ratio_match_to_mergekit"] = {
            k: best[k] / best["mergekit linear (subprocess)"] for k in best if k.startswith("match")
        }
    return out


# --------------------------------------------------------------------------- main


PARTS = {"independent": part_independent, "finetune": part_finetune, "time": part_time}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=list(PARTS), nargs="+", default=list(PARTS))
    p.add_argument("--quick", action="store_true", help="tiny training runs (smoke test; figures meaningless)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2; use 1 on a contended machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    CACHE.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() and not args.quick else {}
    results["machine"] = machine()
    for part in args.part:
        log(f"part {part}")
        start = time.perf_counter()
        results[part] = PARTS[part](args.quick)
        results[part]["wall_seconds"] = time.perf_counter() - start
        results[part]["machine"] = machine()  # parts may be re-run on their own, on another day
        if not args.quick:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
