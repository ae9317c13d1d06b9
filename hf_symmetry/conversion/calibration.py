"""Calibration statistics for data-dependent merges: Gram matrices of every linear layer's inputs
(RegMean) and the diagonal Fisher (Fisher merging), over batches of calibration token ids.

Grams are keyed in the canonical vocabulary of :mod:`hf_symmetry.architectures.adapter`:
``layers.{i}.attn_in`` (what q/k/v read), ``layers.{i}.o_in``, ``layers.{i}.ffn_in`` (gate/up),
``layers.{i}.down_in`` and ``head_in`` (the LM head), so that
:meth:`hf_symmetry.conversion.match.MatchSolution.transform_grams` can carry them through a match.
The Fisher is keyed by parameter name, like the state dict.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..architectures import Adapter

Tensors = dict[str, torch.Tensor]


def calibration_batches(ids: torch.Tensor, seq_len: int = 256, batch_size: int = 4) -> list[torch.Tensor]:
    """Split a 1-D token stream into full ``[batch, seq_len]`` batches (the last batch may be
    smaller; a trailing partial sequence is dropped, so no padding ever enters a statistic)."""
    if seq_len < 2 or batch_size < 1:
        raise ValueError(f"calibration needs seq_len >= 2 and batch_size >= 1; got {seq_len}, {batch_size}")
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than one sequence of {seq_len}")
    seqs = ids[: n * seq_len].reshape(n, seq_len)
    return list(torch.split(seqs, batch_size))


def _gram_modules(adapter: Adapter) -> dict[str, str]:
    """canonical Gram key -> module name (the module whose *input* the Gram is of)."""
    s, a = adapter.spec, adapter.spec.attention
    names = {}
    for i in range(adapter.n_layers):
        p = f"{adapter.prefix}{s.layers}.{i}."
        names[f"layers.{i}.attn_in"] = p + (a.qkv or a.q)
        names[f"layers.{i}.o_in"] = p + a.o
        names[f"layers.{i}.ffn_in"] = p + s.ffn.up
        names[f"layers.{i}.down_in"] = p + s.ffn.down
    if s.lm_head:
        names["head_in"] = s.lm_head
    return names


@torch.no_grad()
def gram_matrices(model, adapter: Adapter, batches: list[torch.Tensor], progress: bool = True,
                  desc: str = "grams") -> Tensors:
    """``G = Σ_tokens x xᵀ`` (float64) of the input of every linear layer, over all batches."""
    modules = dict(model.named_modules())
    wanted = {key: name for key, name in _gram_modules(adapter).items() if name in modules}
    missing = sorted(set(_gram_modules(adapter)) - set(wanted) - {"head_in"})
    if missing:
        raise ValueError(f"model has no module for {missing[:3]} ({type(model).__name__})")
    grams: Tensors = {}

    def hook_for(key):
        def hook(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            grams[key] = grams.get(key, 0) + x.T @ x
        return hook

    handles = [modules[name].register_forward_pre_hook(hook_for(key)) for key, name in wanted.items()]
    try:
        for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
            model(input_ids=batch)
    finally:
        for h in handles:
            h.remove()
    return grams


def fisher_diagonal(model, batches: list[torch.Tensor], progress: bool = True, desc: str = "fisher") -> Tensors:
    """Empirical diagonal Fisher ``F = mean_n (∂ log p(x_n) / ∂θ)²`` over calibration sequences,
    ``log p(x_n)`` the sequence's mean next-token log-likelihood. Each sequence gets its own
    backward pass: squaring a batch's summed gradient would not be the Fisher."""
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(f"Fisher merging needs a language-model head to define a likelihood; "
                         f"{type(model).__name__} has none (use average or regmean)")
    params = {n: p for n, p in model.named_parameters()}
    fisher = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    was_training = model.training
    model.eval()
    count = 0
    try:
        for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
            for seq in batch:
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=seq[None], labels=seq[None]).loss
                loss.backward()
                for n, p in params.items():
                    if p.grad is not None:
                        fisher[n] += p.grad.detach().float().pow(2)
                count += 1
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {n: f / count for n, f in fisher.items()}
