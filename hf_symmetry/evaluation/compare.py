"""Loading models for comparison and measuring how far two models' outputs are apart."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
from transformers.initialization import no_init_weights

from ..architectures import SUPPORTED_MODEL_TYPES, spec_for_model_type
from ..assets import resolve_model
from ..devices import to_model
from ..modeling import register_auto_classes


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """An HF model folder as its LM class when it has one (logits), else its base model
    (hidden states), in eval mode. hf_symmetry's own families are registered on import."""
    register_auto_classes()

    path = resolve_model(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = auto_class(config).from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval()


def auto_class(config, has_lm_head: bool = False):
    """The Auto class :func:`load_model` uses: the LM class when the config names one (or, for a
    config without ``architectures``, when the weights hold an ``lm_head``), else the base model."""
    arch = " ".join(getattr(config, "architectures", None) or [])
    if "CausalLM" in arch or "LMHead" in arch or (not arch and has_lm_head):
        return AutoModelForCausalLM
    if "MaskedLM" in arch:
        return AutoModelForMaskedLM
    return AutoModel


def model_from_state_dict(config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """An in-memory state dict (e.g. a matched or merged one) as a model in eval mode, without a
    round trip through disk. Refuses missing or unexpected tensors (a tied LM head may be absent)."""
    register_auto_classes()

    cfg = dict(config)
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)

    has_head = "lm_head.weight" in state_dict or (
        cfg.model_type in SUPPORTED_MODEL_TYPES and spec_for_model_type(cfg.model_type).lm_head is not None
    )

    with no_init_weights():  # every weight is loaded below; random init would cost seconds for nothing
        model = auto_class(cfg, has_lm_head=has_head).from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=False)
    tied = (
        set(getattr(model, "_tied_weights_keys", None) or {}) if getattr(cfg, "tie_word_embeddings", False) else set()
    )
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not fit {type(model).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if tied:
        model.tie_weights()
    return model.eval()


def load_tokenizer(path: str | Path):
    return AutoTokenizer.from_pretrained(resolve_model(path))


def model_output(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits when the model has an LM head, else the last hidden state."""
    with torch.no_grad():
        out = model(input_ids=to_model(ids.reshape(1, -1) if ids.dim() == 1 else ids, model))
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()


def is_causal_lm(model) -> bool:
    return any(s in type(model).__name__ for s in ("CausalLM", "LMHeadModel"))


def max_abs_diff(model_a, model_b, ids: torch.Tensor) -> float:
    return (model_output(model_a, ids) - model_output(model_b, ids)).abs().max().item()


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
