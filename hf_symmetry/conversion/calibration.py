"""Calibration statistics for data-dependent merges: Gram matrices of every linear layer's inputs
(RegMean, collected layer by layer by :mod:`hf_symmetry.calibration`) and the diagonal Fisher
(Fisher merging, a full backward pass), over batches of calibration token ids.

Grams are keyed in the canonical vocabulary of :mod:`hf_symmetry.architectures.adapter`:
``layers.{i}.attn_in`` (what q/k/v read), ``layers.{i}.o_in``, ``layers.{i}.ffn_in`` (gate/up),
``layers.{i}.down_in`` and ``head_in`` (the LM head), so that
:meth:`hf_symmetry.conversion.match.MatchSolution.transform_grams` can carry them through a match.
The Fisher is keyed by parameter name, like the state dict.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

Tensors = dict[str, torch.Tensor]


_SITES = {"attn_in": "attn_in", "o_in": "o_in", "ffn_in": "ffn_in", "down_in": "down_in"}


def statistics_dtype(source) -> torch.dtype:
    """Statistics in float32 at least, float64 when the weights are float64 (exactness tests)."""
    locations = getattr(source, "_locations", None)
    if locations:
        dtype = next(iter(locations.values()))[1]
    else:
        key = next(k for k in source.keys() if not k.endswith(("position_ids", "token_type_ids")))
        dtype = source.get([key])[key].dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def gram_matrices(source, config: dict | None, batches: list[torch.Tensor], progress: bool = True,
                  desc: str = "grams", placement=None) -> Tensors:
    """``G = Σ_tokens x xᵀ`` (float64) of the input of every linear layer, over all batches, keyed
    ``layers.{i}.attn_in`` / ``o_in`` / ``ffn_in`` / ``down_in`` and ``head_in`` (when the model has
    an LM head).

    ``source``: a checkpoint folder, a tensor source with its ``config``, or an in-memory model;
    the layer-wise calibration engine runs it one layer at a time on ``placement`` (default: CPU,
    float64 for float64 weights, else float32)."""
    from ..calibration import CalibrationEngine, StatsRequest
    from ..devices import resolve
    from .stream import DictSource

    if isinstance(source, torch.nn.Module):
        source, config = DictSource(source.state_dict()), source.config.to_dict()
    if placement is None:
        from ..checkpoint import CheckpointReader

        probe = CheckpointReader(source) if not hasattr(source, "keys") else source
        placement = resolve("cpu", statistics_dtype(probe))
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    has_head = engine.adapter.spec.lm_head is not None and engine.skeleton().get_output_embeddings() is not None
    result = engine.collect(batches, StatsRequest(grams=tuple(_SITES)),
                            final=StatsRequest(grams=("head_in",)) if has_head else None)
    grams: Tensors = {}
    for i, stats in enumerate(result.layers):
        for key, site in _SITES.items():
            grams[f"layers.{i}.{key}"] = stats.grams[site]
    if result.final is not None:
        grams["head_in"] = result.final.grams["head_in"]
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
