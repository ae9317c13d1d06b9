"""Train a small T6 (Tensor Product Attention) language model from scratch with the HF Trainer.

Runs offline on CPU: the first half of the Britannica article (embedded text) tokenised with the
SmolLM2 tokenizer, a 2-layer T6 (R_Q=6, R_K=R_V=2), a few optimizer steps by default; the held-out
loss is measured on the second half before and after.
Nothing is pushed anywhere; ``--out`` saves the model (with its remote code) and tokenizer.

    python examples/train_t6.py                 # 20 steps
    python examples/train_t6.py --steps 2000 --hidden 384 --layers 6 --heads 6 --out t6-small
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch
from transformers import AutoTokenizer, Trainer, TrainingArguments

import hf_symmetry
from hf_symmetry.assets import resolve_text, smollm2_dir, text_path
from hf_symmetry.evaluation import read_text, tokenize_text


class Chunks(torch.utils.data.Dataset):
    """Non-overlapping ``seq_len`` windows of one token stream (labels = inputs; the model shifts)."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        n = ids.numel() // seq_len
        self.data = ids[: n * seq_len].view(n, seq_len)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default="britannica-calib",
                   help="training text: a file or an embedded name (default: the first half of 'britannica')")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--q-rank", type=int, default=6)
    p.add_argument("--k-rank", type=int, default=2)
    p.add_argument("--v-rank", type=int, default=2)
    p.add_argument("--non-contextual-a", action="store_true", help="learned constant A factors")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save the trained model and tokenizer here")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    train_ids = tokenize_text(tok, read_text(resolve_text(args.text)))
    eval_ids = tokenize_text(tok, read_text(text_path("britannica-eval")), max_tokens=args.eval_tokens)
    config = hf_symmetry.TPAConfig(
        vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, q_rank=args.q_rank, k_rank=args.k_rank, v_rank=args.v_rank,
        contextual_a=not args.non_contextual_a, max_position_embeddings=max(1024, args.seq_len),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True)
    model = hf_symmetry.TPAForCausalLM(config)
    print(f"T6: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"KV cache {config.kv_cache_elements_per_token(per_layer=False)} elements/token "
          f"(MHA of the same shape: {2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim})")

    out_dir = args.out or tempfile.mkdtemp(prefix="t6-")
    targs = dict(output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                 per_device_eval_batch_size=args.batch_size, learning_rate=args.lr,
                 warmup_steps=min(10, args.steps // 10),
                 lr_scheduler_type="cosine", weight_decay=0.01, logging_steps=max(1, args.steps // 10),
                 save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=args.seed,
                 push_to_hub=False, disable_tqdm=False)
    if args.gradient_checkpointing:
        import dataclasses

        names = {f.name for f in dataclasses.fields(TrainingArguments)}
        targs["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = True
    trainer = Trainer(model=model, args=TrainingArguments(**targs),
                      train_dataset=Chunks(train_ids, args.seq_len), eval_dataset=Chunks(eval_ids, args.seq_len))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    print(f"held-out loss {before:.3f} -> {after:.3f} (perplexity {math.exp(before):.0f} -> {math.exp(after):.0f})")

    model.eval()
    prompt = tok("The island of", return_tensors="pt").to(model.device)
    with torch.no_grad():
        sample = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    print("greedy sample:", repr(tok.decode(sample[0], skip_special_tokens=True)))
    if args.out:
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
        print(f"saved to {args.out} (loads with AutoModelForCausalLM, trust_remote_code=True without hf_symmetry)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
