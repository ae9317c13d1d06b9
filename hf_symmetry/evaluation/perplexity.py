"""The one perplexity definition of hf_symmetry (texts are read and tokenised by :mod:`hf_symmetry.text`).

Every command and card measures perplexity the same way (:data:`PPL`): the first ``tokens``
tokens of a text (no special tokens), scored by a sliding window of ``window`` tokens that
advances by ``stride``; each token after the first is predicted exactly once, with up to
``window - 1`` tokens of context. Cards name the definition next to the number
(:meth:`PerplexityWindows.describe`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class PerplexityWindows:
    """Window, stride and token count of a perplexity measurement."""

    tokens: int = 2048
    window: int = 512
    stride: int = 256

    def describe(self, tokens: int | None = None) -> str:
        n = self.tokens if tokens is None else tokens
        return f"first {n} tokens, sliding window {self.window}, stride {self.stride}"


#: the definition every command and card uses unless told otherwise (``--ppl-tokens`` changes the count)
PPL = PerplexityWindows()
#: tokens compared for max |Δlogit| by every verification
LOGIT_TOKENS = 512


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # tokens of the text scored (the first one is context only: tokens - 1 predictions)
    window: int
    stride: int

    @property
    def predicted(self) -> int:
        return self.tokens - 1

    def describe(self) -> str:
        return PerplexityWindows(self.tokens, self.window, self.stride).describe()

    def as_dict(self) -> dict:
        return dict(
            perplexity=self.perplexity, nll=self.nll, tokens=self.tokens, window=self.window, stride=self.stride
        )


def input_device(model) -> torch.device:
    """Where a model's inputs go: its embedding's device (:func:`hf_symmetry.devices.module_device`;
    accelerate's execution device, else the CPU, when it offloaded the embedding)."""
    try:
        from ..devices import module_device  # lazy: runs in the isolated check's interpreter
    except ImportError:
        # executed as a standalone file by hub.check's isolated loader, where hf_symmetry cannot be
        # imported: a model loaded there whole, on one device, takes its inputs where its embedding is (a structured
        # embedding, as compress writes by default, has no dense `weight`: its first parameter says where it is)
        first = next(model.get_input_embeddings().parameters(), None)
        return (first if first is not None else next(model.parameters())).device
    return module_device(model)


def windows(n: int, window: int = PPL.window, stride: int = PPL.stride) -> int:
    """How many forward passes :func:`perplexity` makes over ``n`` tokens."""
    return len(range(1, n, min(stride, window - 1)))


@torch.no_grad()
def perplexity(
    model, ids: torch.Tensor, window: int = PPL.window, stride: int = PPL.stride, progress: bool = True, bar=None
) -> PerplexityResult:
    """Sliding-window perplexity: each window scores the next ``stride`` tokens (at most
    ``window - 1``) once, seeing up to ``window`` tokens of context including them.
    ``bar``: an open tqdm bar to advance once per window instead of a bar of its own."""
    if stride <= 0 or stride > window or window < 2:
        raise ValueError(f"need 0 < stride <= window and window >= 2; got stride={stride}, window={window}")
    n = ids.numel()
    if n < 2:
        raise ValueError("need at least two tokens to measure perplexity")
    block = min(stride, window - 1)
    total_nll = 0.0
    starts = range(1, n, block)
    own = bar is None
    bar = tqdm(total=len(starts), desc="perplexity", disable=not progress, leave=False) if own else bar
    try:
        for s in starts:
            e = min(s + block, n)
            b = max(0, e - window)
            logits = model(input_ids=ids[b:e].unsqueeze(0).to(input_device(model))).logits[0].float()
            # logits at position t - 1 predict token t
            total_nll += torch.nn.functional.cross_entropy(
                logits[s - 1 - b : e - 1 - b], ids[s:e].to(logits.device), reduction="sum"
            ).item()
            bar.update(1)
    finally:
        if own:
            bar.close()
    mean = total_nll / (n - 1)
    return PerplexityResult(math.exp(mean), mean, n, window, stride)
