"""Perplexity by sliding window, and the token batches every comparison runs on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm


def read_text(path: str | Path) -> str:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return text


def tokenize_text(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """1-D LongTensor of token ids for ``text`` (no special tokens), at most ``max_tokens``."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if not ids:
        raise ValueError("text tokenises to zero tokens")
    ids = torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)
    return ids


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float          # mean negative log-likelihood per predicted token (nats)
    tokens: int         # number of predicted tokens
    window: int
    stride: int

    def as_dict(self) -> dict:
        return dict(perplexity=self.perplexity, nll=self.nll, tokens=self.tokens, window=self.window, stride=self.stride)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int = 512, stride: int = 256, progress: bool = True) -> PerplexityResult:
    """Sliding-window perplexity: each window scores the next ``stride`` tokens (at most
    ``window - 1``) once, seeing up to ``window`` tokens of context including them."""
    if stride <= 0 or stride > window or window < 2:
        raise ValueError(f"need 0 < stride <= window and window >= 2; got stride={stride}, window={window}")
    n = ids.numel()
    if n < 2:
        raise ValueError("need at least two tokens to measure perplexity")
    device = next(model.parameters()).device
    block = min(stride, window - 1)
    total_nll = 0.0
    starts = range(1, n, block)
    for s in tqdm(starts, desc="perplexity", disable=not progress, leave=False):
        e = min(s + block, n)
        b = max(0, e - window)
        logits = model(input_ids=ids[b:e].unsqueeze(0).to(device)).logits[0].float()
        # logits at position t - 1 predict token t
        total_nll += torch.nn.functional.cross_entropy(logits[s - 1 - b:e - 1 - b], ids[s:e].to(device),
                                                       reduction="sum").item()
    mean = total_nll / (n - 1)
    return PerplexityResult(math.exp(mean), mean, n - 1, window, stride)
