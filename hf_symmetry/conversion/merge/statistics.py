"""Calibration statistics for data-dependent merges: Gram matrices of every linear layer's inputs
(RegMean, collected layer by layer by :mod:`hf_symmetry.calibration`) and the diagonal Fisher
(Fisher merging, a full backward pass), over batches of calibration token ids.

Grams are keyed in the canonical vocabulary of :mod:`hf_symmetry.architectures.adapter`:
``layers.{i}.attn_in`` (what q/k/v read), ``layers.{i}.o_in``, ``layers.{i}.ffn_in`` (gate/up),
``layers.{i}.down_in`` and ``head_in`` (the LM head), so that
:meth:`hf_symmetry.conversion.match.solution.MatchSolution.transform_grams` can carry them through a match.
The Fisher is keyed by parameter name, like the state dict.
"""

from __future__ import annotations

import math

import torch
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from accelerate.utils import get_max_memory, set_module_tensor_to_device
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from ...calibration import CalibrationEngine, StatsRequest
from ...checkpoint_io import CheckpointReader
from ...devices import default_placement, to_model
from ...modeling import register_auto_classes
from ..stream import DictSource

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


def gram_matrices(
    source, config, batches: list[torch.Tensor], progress: bool = True, desc: str = "grams", placement=None
) -> Tensors:
    """``G = Σ_tokens x xᵀ`` (float64) of the input of every linear layer, over all batches, keyed
    ``layers.{i}.attn_in`` / ``o_in`` / ``ffn_in`` / ``down_in`` and ``head_in`` (when the model has
    an LM head).

    ``source``: a checkpoint folder (``config`` None), a tensor source with its ``config`` (dict),
    or an in-memory model (``config`` ignored: the model's own); the layer-wise calibration engine
    runs it one layer at a time on ``placement`` (default: CPU, float64 for float64 weights, else
    float32)."""
    if isinstance(source, torch.nn.Module):
        source, config = DictSource(source.state_dict()), source.config.to_dict()
    if placement is None:
        probe = CheckpointReader(source) if not hasattr(source, "keys") else source
        placement = default_placement(statistics_dtype(probe))
    engine = CalibrationEngine(source, config, placement=placement, progress=progress)
    has_head = engine.adapter.spec.lm_head is not None and engine.skeleton().get_output_embeddings() is not None
    result = engine.collect(
        batches, StatsRequest(grams=tuple(_SITES)), final=StatsRequest(grams=("head_in",)) if has_head else None
    )
    grams: Tensors = {}
    for i, stats in enumerate(result.layers):
        for key, site in _SITES.items():
            grams[f"layers.{i}.{key}"] = stats.grams[site]
    if result.final is not None:
        grams["head_in"] = result.final.grams["head_in"]
    return grams


def _available_memory() -> dict:
    """accelerate ``max_memory``: free memory of every visible GPU and the host's available memory."""
    budget = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            budget[i] = int(torch.cuda.mem_get_info(i)[0] * 0.9)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        budget["cpu"] = int(info.get("MemAvailable", info.get("MemFree", 0)) * 0.8)
    except OSError:  # not Linux: let accelerate ask psutil
        budget = get_max_memory()
    return budget


class FisherMemoryError(MemoryError, ValueError):
    """Fisher merging's backward pass does not fit in the memory there is (refused before any work)."""


def _fisher_budget(placement=None) -> dict:
    budget = _available_memory()
    if placement is not None and placement.device.type == "cpu":
        budget = {"cpu": budget.get("cpu", 0)}
    return budget


def check_fisher_memory(shapes: dict[str, tuple], dtype: torch.dtype = torch.float32, placement=None) -> None:
    """Refuse, with one line, a Fisher merge whose backward pass cannot fit: the model's weights,
    their gradients and the float32 Fisher (``shapes``: the checkpoint's tensor shapes) against
    the free memory of the visible GPUs and the host (the CPU only with ``--device cpu``)."""
    params = sum(math.prod(s) for k, s in shapes.items() if not k.endswith(("position_ids", "token_type_ids")))
    element = torch.empty((), dtype=dtype).element_size()
    needed = params * (2 * element + 4)  # weights, gradients, float32 Fisher
    budget = _fisher_budget(placement)
    if needed > sum(budget.values()):
        raise FisherMemoryError(
            f"Fisher merging needs about {needed / 1e9:.1f} GB (weights, gradients and the Fisher of "
            f"{params / 1e6:.0f} M parameters: its backward pass needs the whole model) but only "
            f"{sum(budget.values()) / 1e9:.1f} GB is free on the GPUs and the host; use regmean "
            "(calibrated layer by layer) or a larger machine"
        )


def fisher_model(config: dict, state_dict, dtype: torch.dtype = torch.float32, placement=None):
    """The model a Fisher pass runs on, placed by accelerate's big-model machinery: built empty,
    given a device map over the visible GPUs and the host (``infer_auto_device_map``; no disk: a
    backward pass needs every weight and its gradient in memory) and dispatched. A model whose
    weights, gradients and Fisher accumulators do not fit in the memory there is is refused with
    one clear error (:class:`FisherMemoryError`) before anything is loaded, instead of failing out
    of memory half-way. ``state_dict``: any mapping (``in`` and ``[]``), read one tensor at a time."""
    register_auto_classes()

    cfg = dict(config)
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "transformers_version"})
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    check_fisher_memory({n: tuple(p.shape) for n, p in model.named_parameters()}, dtype, placement)
    budget = _fisher_budget(placement)
    # a third of each budget for the weights: gradients and the Fisher take the rest
    device_map = infer_auto_device_map(
        model,
        max_memory={k: v // 3 for k, v in budget.items()},
        no_split_module_classes=getattr(model, "_no_split_modules", None),
        dtype=dtype,
    )
    if "disk" in device_map.values():
        raise FisherMemoryError(
            "Fisher merging cannot offload weights to disk (the backward pass needs them all); "
            "use regmean or a machine with more memory"
        )
    tied = (
        set(getattr(model, "all_tied_weights_keys", {}) or {}) if getattr(cfg, "tie_word_embeddings", False) else set()
    )
    names = dict(model.named_parameters())
    for name in names:
        if name in state_dict:
            set_module_tensor_to_device(model, name, "cpu", value=state_dict[name], dtype=dtype)
        elif name not in tied:
            raise ValueError(f"state dict lacks {name}")
    if tied:
        model.tie_weights()
    if set(device_map.values()) - {"cpu"}:
        model = dispatch_model(model, device_map)
    return model.eval()


def fisher_diagonal(model, batches: list[torch.Tensor], progress: bool = True, desc: str = "fisher") -> Tensors:
    """Empirical diagonal Fisher ``F = mean_n (∂ log p(x_n) / ∂θ)²`` over calibration sequences,
    ``log p(x_n)`` the sequence's mean next-token log-likelihood. Each sequence gets its own
    backward pass: squaring a batch's summed gradient would not be the Fisher."""
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(
            f"Fisher merging needs a language-model head to define a likelihood; "
            f"{type(model).__name__} has none (use average or regmean)"
        )

    params = {n: p for n, p in model.named_parameters()}
    fisher = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    was_training = model.training
    model.eval()
    count = 0
    try:
        for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
            for seq in batch:
                model.zero_grad(set_to_none=True)
                ids = to_model(seq[None], model)  # the ids where the (dispatched) model embeds them
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                for n, p in params.items():
                    if p.grad is not None:
                        fisher[n] += p.grad.detach().float().pow(2)
                count += 1
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {n: (f / count).cpu() for n, f in fisher.items()}
