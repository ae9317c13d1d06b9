"""What LoRA adapts, for stock causal LMs and hf_symmetry's own families, using PEFT only.

* Every ``nn.Linear`` (and subclass, e.g. TPA's factor projections, FaRR's per-layer-width
  projections) inside the model is a LoRA target (``target_modules``), except the LM head and
  anything inside the input/output embeddings.
* The structured layers of the compressed families (``modeling.structured_linear.LINEAR_CLASSES``:
  ``LowRankLinear``, ``KroneckerLinear``, ``GSLinear``, ``DenseLinear``) are not ``nn.Linear``: their
  factor matrices (``lr_u``/``lr_v``, ``kron_a``/``kron_b``, ``gs_left``/``gs_right``, ``weight``) are
  adapted through PEFT's own parameter targeting (``LoraConfig.target_parameters``, ``lora.ParamWrapper``):
  each factor gets a low-rank additive update (a 3-D factor gets one per leading slice, i.e. per Kronecker row block /
  GS block), which merges exactly into the factor, so the merged model keeps its structure.
  Where a factor's slice is smaller than the LoRA rank, its adapter rank is capped at the slice's
  smaller side (a full-rank update of that factor), via ``rank_pattern``/``alpha_pattern``.
* ``lora_alpha`` equals the rank (scaling 1) for every adapter.

A requested rank larger than a projection's smaller dimension (``min(in, out)``) is refused.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from ..modeling.structured_linear import LINEAR_CLASSES

__all__ = ["LoraPlan", "lora_plan", "apply_lora", "STRUCTURED_CLASSES"]

# the structured layers of the compressed families, by class name (the registry's): the class may come from a
# checkpoint's remote-code module rather than from hf_symmetry.modeling, so it is matched by name or marker
STRUCTURED_CLASSES = tuple(cls.__name__ for cls in LINEAR_CLASSES.values())


def is_structured_linear(module: nn.Module) -> bool:
    """Whether ``module`` is one of the structured linears (hf_symmetry's or a remote-code copy's)."""
    return getattr(type(module), "is_structured_linear", False) is True or type(module).__name__ in STRUCTURED_CLASSES


@dataclass
class LoraPlan:
    rank: int
    target_modules: list[str] = field(default_factory=list)  # full names of nn.Linear modules
    target_parameters: list[str] = field(default_factory=list)  # full names of structured factors
    rank_caps: dict[str, int] = field(default_factory=dict)  # factor name -> capped rank
    projections: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (out, in)

    def lora_config(self):
        from peft import LoraConfig  # lazy: keeps `hf-symmetry --help` fast

        pattern = {re.escape(k): v for k, v in self.rank_caps.items()}
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.rank,
            lora_dropout=0.0,
            bias="none",
            target_modules=list(self.target_modules) or None,
            target_parameters=list(self.target_parameters) or None,
            rank_pattern=pattern,
            alpha_pattern=dict(pattern),
        )

    def as_dict(self) -> dict:
        return dict(
            rank=self.rank,
            linear_modules=len(self.target_modules),
            structured_factors=len(self.target_parameters),
            capped_factors=len(self.rank_caps),
        )


def _excluded_prefixes(model) -> list[str]:
    names = []
    ids = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    ids |= {id(getattr(model, "head_mix", None))} - {id(None)}
    for name, module in model.named_modules():
        if id(module) in ids:
            names.append(name)
    return names


def lora_plan(model: nn.Module, rank: int) -> LoraPlan:
    """The LoRA targets of ``model`` at ``rank``; ``ValueError`` if there are none or a projection is
    smaller than ``rank`` on either side."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {rank}")
    excluded = _excluded_prefixes(model)

    def skip(name: str) -> bool:
        return any(name == e or name.startswith(e + ".") for e in excluded)

    plan = LoraPlan(rank=rank)
    for name, module in model.named_modules():
        if skip(name):
            continue
        if isinstance(module, nn.Linear):
            plan.target_modules.append(name)
            plan.projections[name] = (module.out_features, module.in_features)
        elif is_structured_linear(module):
            plan.projections[name] = (module.out_features, module.in_features)
            for pname, p in module.named_parameters(recurse=False):
                if pname == "bias":
                    continue
                full = f"{name}.{pname}"
                plan.target_parameters.append(full)
                slice_dims = p.shape[1:] if p.ndim == 3 else p.shape
                if rank > min(slice_dims):
                    plan.rank_caps[full] = int(min(slice_dims))
    if not plan.projections:
        raise ValueError(f"{type(model).__name__} has no projection LoRA can adapt")
    small = [(n, d) for n, d in plan.projections.items() if rank > min(d)]
    if small:
        n, (o, i) = small[0]
        raise ValueError(
            f"LoRA rank {rank} is larger than layer {n} ({o}x{i}); choose --lora-rank <= {min(o, i)}"
            + (f" ({len(small)} layers affected)" if len(small) > 1 else "")
        )
    return plan


def apply_lora(model: nn.Module, plan: LoraPlan):
    """``peft.get_peft_model`` with ``plan``'s config: only the adapters are trainable."""
    from peft import get_peft_model  # lazy: keeps `hf-symmetry --help` fast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about nested ParamWrappers on structured layers
        return get_peft_model(model, plan.lora_config())
