"""OPT-shaped vs Llama-shaped decoders of the same size, trained on the same tokens: how much do SliceGPT
and ProcrustesGPT's structured classes at 25 % cost each? (The SliceGPT and ProcrustesGPT papers report OPT models
losing less than Llama-2 at
the same slicing; this asks whether that difference appears when the data, size and training are equal.)

Both models are trained here from scratch on the CPU with the shared Trainer setup (``hf_symmetry.training``,
the one ``examples/train_clm.py`` uses) on the corpus of ``bench_t6_training.py`` (the embedded Britannica
article and six Shakespeare plays from ``hf_symmetry.assets``, plus ``pydoc_data`` prose, SmolLM2's tokenizer,
the vocabulary restricted to the ids that occur), same tokens in the same order, same steps, schedule and
seed. Shapes: the same width, depth and heads; OPT: LayerNorm, learned positions, ReLU FFN of 4·d with biases;
Llama: RMSNorm, RoPE, SwiGLU without biases, its FFN width chosen so that the parameters without
embeddings match OPT's (within 1 %). Heads untied in both, so SliceGPT pays the same for them.

Then ``compress --structure slice --ratio R`` on each (R = 0.25, 0.4, 0.5), in memory (``compress_model``; the same
ratio
definition, so both end at about the same parameter count): Llama into the compressed family (one global
PCA), OPT centred into the RMS-decoder family (``conversion/compress/layernorm_decoders/``). Then ``compress
--structure S --ratio 0.25`` for each S of ``--structures`` (low rank, Kronecker, GS; ``compress``'s defaults:
stage W, one rotation per residual segment for Kronecker and GS), Llama into the compressed family, OPT into
the RMS-decoder family's structured linears. Perplexity on the held-out split before and after. Calibration:
the first ``--calib-tokens`` training tokens.

The trained models are cached under ``--work`` (keyed by every training setting), so a rerun with other
compression settings does not train again.

    nice -n 10 python benchmarks/bench_opt_vs_llama.py            # one process, one thread

Output: ``benchmarks/results/opt_vs_llama.json`` (CPU seconds per phase included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# sized for a shared 2-core machine (about 12 CPU-minutes in all; 400 steps are ~0.95 epochs of the corpus);
# larger runs: --hidden 256 --steps 4000 ...
DEFAULTS = dict(
    hidden=128,
    layers=4,
    heads=4,
    seq_len=128,
    batch=8,
    steps=400,
    lr=2e-3,
    val_tokens=4096,
    calib_tokens=4096,
    ratios="0.25,0.4,0.5",
    structures="lowrank,kron",
    structured_ratio=0.25,
    seed=0,
)
_TRAINING = ("hidden", "layers", "heads", "seq_len", "batch", "steps", "lr", "val_tokens", "seed")


def configs(vocab: int, ids: dict, o: dict):
    """(OPT config, Llama config, their parameter counts without embeddings)."""
    import transformers as T

    d, L, H = o["hidden"], o["layers"], o["heads"]
    common = dict(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=L,
        num_attention_heads=H,
        max_position_embeddings=max(512, o["seq_len"]),
        tie_word_embeddings=False,
        **ids,
    )
    opt = T.OPTConfig(
        **common,
        ffn_dim=4 * d,
        word_embed_proj_dim=d,
        do_layer_norm_before=True,
        activation_function="relu",
        enable_bias=True,
        dropout=0.0,
        attention_dropout=0.0,
    )
    opt_layer = (4 * d * d + 4 * d) + (2 * 4 * d * d + 4 * d + d) + 4 * d  # attention, FFN, two LayerNorms
    inter = round((opt_layer - 4 * d * d - 2 * d) / (3 * d))  # SwiGLU: 3 d·I, two RMSNorms
    llama = T.LlamaConfig(
        **common,
        intermediate_size=inter,
        num_key_value_heads=H,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    counts = {}
    for name, cfg in (("opt", opt), ("llama", llama)):
        with __import__("torch").device("meta"):
            m = T.AutoModelForCausalLM.from_config(cfg)
        counts[name] = sum(
            p.numel()
            for n, p in m.named_parameters()
            if not any(s in n for s in ("embed_tokens", "embed_positions", "lm_head"))
        )
    assert abs(counts["opt"] - counts["llama"]) / counts["opt"] < 0.01, counts
    return opt, llama, counts


def perplexity(model, sequences, batch: int = 16) -> float:
    import torch

    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, sequences.shape[0], batch):
            x = sequences[i : i + batch]
            total += model(x, labels=x).loss.item() * x.shape[0]
            n += x.shape[0]
    return math.exp(total / n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--work", default="/tmp/families/bench_opt_vs_llama")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "opt_vs_llama.json"))
    a = p.parse_args(argv)
    o = {k: getattr(a, k) for k in DEFAULTS}

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_t6_training import prepared_data

    from hf_symmetry.calibration import CalibrationText
    from hf_symmetry.conversion.compress import CompressOptions, compress_model
    from hf_symmetry.training import TrainSettings, train

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cpu0 = time.process_time()
    train_ds, val_ds, vocab, ids, data_info, full_vocab = prepared_data(work, o["seq_len"], o["val_tokens"])
    opt_cfg, llama_cfg, counts = configs(vocab, ids, o)
    calib = train_ds.sequences.reshape(-1)[: o["calib_tokens"]]
    calibration = CalibrationText(tokens=o["calib_tokens"], seq_len=o["seq_len"])  # the text: the training data's
    val = val_ds.sequences
    result = {
        "machine": "2-core CPU VM, no GPU, shared with other jobs; one torch thread, nice 10",
        "date": time.strftime("%Y-%m-%d"),
        "options": o,
        "vocab_used": vocab,
        "tokenizer_vocab": full_vocab,
        "parameters_without_embeddings": counts,
        "data": data_info,
        "models": {},
    }
    import transformers as T

    tag = "-".join(f"{k}{o[k]}" for k in _TRAINING)
    for name, cfg in (("opt", opt_cfg), ("llama", llama_cfg)):
        cfg._attn_implementation = "sdpa"
        cached = work / f"model-{name}-{tag}"
        if (cached / "train_meta.json").exists():  # trained by an earlier run with the same settings
            model = T.AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
            meta = json.loads((cached / "train_meta.json").read_text())
            reused = True
        else:
            reused = False
            torch.manual_seed(o["seed"])
            model = T.AutoModelForCausalLM.from_config(cfg)
            settings = TrainSettings(
                output_dir=str(work / name),
                max_steps=o["steps"],
                per_device_batch_size=o["batch"],
                learning_rate=o["lr"],
                weight_decay=0.1,
                max_grad_norm=1.0,
                seed=o["seed"],
                use_cpu=True,
                progress=False,
                logging_steps=max(1, o["steps"] // 12),
            )
            t = time.process_time()
            out = train(model, train_ds, None, settings)
            meta = {
                "train_tokens": out.train_tokens,
                "train_cpu_seconds": time.process_time() - t,
                "train_curve": [(h["step"], h["loss"]) for h in out.log_history if "loss" in h],
            }
            model.float().save_pretrained(cached)
            (cached / "train_meta.json").write_text(json.dumps(meta))
        model = model.float().eval()
        t = time.process_time()
        dense_ppl = perplexity(model, val)
        eval_cpu = time.process_time() - t
        entry = {
            "model_type": cfg.model_type,
            "hidden": cfg.hidden_size,
            **meta,
            "reused_cached_model": reused,
            "perplexity_dense": dense_ppl,
            "eval_cpu_seconds": eval_cpu,
            "sliced": [],
            "structured": [],
        }
        for ratio in (float(r) for r in str(o["ratios"]).split(",")):
            t = time.process_time()
            options = CompressOptions(structure="slice", ratio=ratio)
            sliced, report = compress_model(model, options, calib_ids=calib, calibration=calibration)
            slice_cpu = time.process_time() - t
            sliced_ppl = perplexity(sliced.float(), val)
            acc = report.accounting
            entry["dense_params"] = acc.dense_model_params
            entry["sliced"].append(
                {
                    "ratio": ratio,
                    "sliced_params": acc.compressed_model_params,
                    "ratio_over_model": acc.ratio_over_model,
                    "ratio_over_compressed": acc.ratio_over_compressed,
                    "residual_width": acc.residual
                    if acc.residual is not None
                    else getattr(sliced.config, "residual_size", None),
                    "output_family": sliced.config.model_type,
                    "perplexity_sliced": sliced_ppl,
                    "perplexity_ratio": sliced_ppl / dense_ppl,
                    "slice_cpu_seconds": slice_cpu,
                }
            )
            del sliced
        for structure in [s for s in str(o["structures"]).split(",") if s]:
            t = time.process_time()
            options = CompressOptions(
                structure=structure,
                ratio=o["structured_ratio"],
            )
            compressed, report = compress_model(model, options, calib_ids=calib, calibration=calibration)
            cpu = time.process_time() - t
            ppl = perplexity(compressed.float(), val)
            acc = report.accounting
            entry["structured"].append(
                {
                    "structure": structure,
                    "method": report.method,
                    "ratio": o["structured_ratio"],
                    "params": acc.compressed_model_params,
                    "ratio_over_model": acc.ratio_over_model,
                    "ratio_over_compressed": acc.ratio_over_compressed,
                    "output_family": compressed.config.model_type,
                    "skip_connections": compressed.config.skip_connections,
                    "perplexity": ppl,
                    "perplexity_ratio": ppl / dense_ppl,
                    "compress_cpu_seconds": cpu,
                }
            )
            print(json.dumps({name: entry["structured"][-1]}), flush=True)
            del compressed
        result["models"][name] = entry
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "train_curve"}}), flush=True)
        del model
    result["cpu_seconds_total"] = time.process_time() - cpu0
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out} ({result['cpu_seconds_total']:.0f} CPU-s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
