"""Tiny random models of every supported family (for tests and benchmarks), with every
parameter that a symmetry could get wrong made non-trivial: norm γ ≠ 1, β ≠ 0, biases ≠ 0.
GQA where the family has it; odd-ish sizes so head/group slicing mistakes show."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import torch
import transformers as T

from .conversion.compress.routes import CALIBRATION
from .solvers.structures import Dense

#: compress's calibration in 40-token sequences: the tests' 120 calibration token ids run as three sequences
SEQ40 = replace(CALIBRATION, seq_len=40)

TINY_FAMILIES = ("llama", "mistral", "smollm3", "qwen2", "qwen3", "gpt2", "opt", "gptj", "bert", "roberta")
# Families added with structural capabilities: sandwich norms and (1+γ) RMSNorms (Gemma), fused
# projections (Phi-3), output norms and QK-norm over all heads (OLMo 2), per-head fused qkv with
# partial rotary and a parallel block (GPT-NeoX). Their RMSNorms/attention need float64-exact
# patches in tests (see tests/architectures/test_families.py).
NEW_TINY_FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "gpt_neox")
ALL_TINY_FAMILIES = TINY_FAMILIES + NEW_TINY_FAMILIES


_COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=80)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _llama_like(family: str, overrides: dict):
    cls = {
        "llama": T.LlamaConfig,
        "mistral": T.MistralConfig,
        "smollm3": T.SmolLM3Config,
        "qwen2": T.Qwen2Config,
        "qwen3": T.Qwen3Config,
    }[family]
    kw = dict(
        _COMMON,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=family in ("llama", "qwen3"),
        rope_parameters=dict(_ROPE),
    )
    if family == "mistral":
        kw["sliding_window"] = None
    if family == "smollm3":  # layer 1 is NoPE (SmolLM3 itself: every 4th layer)
        kw.update(no_rope_layers=[1, 0], tie_word_embeddings=True, pad_token_id=None, bos_token_id=0, eos_token_id=0)
    return cls(**{**kw, **overrides})


def _gpt2(family: str, overrides: dict):
    return T.GPT2Config(
        vocab_size=97,
        n_embd=48,
        n_layer=2,
        n_head=6,
        n_positions=128,
        n_inner=80,
        bos_token_id=0,
        eos_token_id=0,
        **overrides,
    )


def _opt(family: str, overrides: dict):
    return T.OPTConfig(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=6,
        ffn_dim=80,
        max_position_embeddings=128,
        word_embed_proj_dim=48,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        **overrides,
    )


def _gptj(family: str, overrides: dict):  # interleaved, partial rotary: 6 of 8 head dims
    return T.GPTJConfig(
        vocab_size=97,
        n_embd=48,
        n_layer=2,
        n_head=6,
        rotary_dim=6,
        n_inner=80,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        **overrides,
    )


def _gemma(family: str, overrides: dict):  # layer 0 sliding (window 8 < sequence), layer 1 global
    cls = T.Gemma2Config if family == "gemma2" else T.Gemma3TextConfig
    kw = dict(
        _COMMON,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=8,
        query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh",
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "gemma2":
        kw.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    else:
        kw.update(
            rope_parameters={
                "full_attention": dict(_ROPE),
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            }
        )
    return cls(**{**kw, **overrides})


def _phi3(family: str, overrides: dict):  # partial rotary as in Phi-4-mini: 6 of 8 head dims
    return T.Phi3Config(
        **{
            **_COMMON,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 128,
            "pad_token_id": 0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "tie_word_embeddings": True,
            "rope_parameters": {**_ROPE, "partial_rotary_factor": 0.75},
            **overrides,
        }
    )


def _olmo2(family: str, overrides: dict):
    return T.Olmo2Config(
        **{
            **_COMMON,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "pad_token_id": 0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "rope_parameters": dict(_ROPE),
            **overrides,
        }
    )


def _gpt_neox(family: str, overrides: dict):  # rotary on 4 of 8 head dims, parallel block, untied head
    return T.GPTNeoXConfig(
        **{
            **_COMMON,
            "max_position_embeddings": 128,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "rope_parameters": {**_ROPE, "partial_rotary_factor": 0.5},
            **overrides,
        }
    )


def _bert(family: str, overrides: dict):
    cls = T.BertConfig if family == "bert" else T.RobertaConfig
    return cls(**{**_COMMON, "max_position_embeddings": 130, "pad_token_id": 1, **overrides})


#: the tiny config of each family, by the function that makes it
_TINY_CONFIGS = {
    **dict.fromkeys(("llama", "mistral", "smollm3", "qwen2", "qwen3"), _llama_like),
    "gpt2": _gpt2,
    "opt": _opt,
    "gptj": _gptj,
    "gemma2": _gemma,
    "gemma3": _gemma,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "gpt_neox": _gpt_neox,
    "bert": _bert,
    "roberta": _bert,
}


def tiny_config(family: str, **overrides):
    if family not in _TINY_CONFIGS:
        raise ValueError(f"no tiny config for {family!r}; choose from {ALL_TINY_FAMILIES}")
    return _TINY_CONFIGS[family](family, overrides)


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A randomly initialised model whose norms and biases are all non-trivial."""
    cfg = tiny_config(family, **overrides)
    cls = {"bert": T.BertModel, "roberta": T.RobertaModel}.get(family, T.AutoModelForCausalLM)
    torch.manual_seed(seed)
    model = cls.from_config(cfg) if cls is T.AutoModelForCausalLM else cls(cfg)
    model = model.to(dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)
            if "norm" in name.lower() or name.split(".")[-2].startswith("ln"):
                p.copy_((1.0 + 0.3 * noise) if name.endswith("weight") else 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
    return model


def input_ids(vocab_size: int = 97, batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def outputs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def float64_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (or last hidden states) of a float64 copy of ``model`` on ``ids`` (``[L]`` or ``[B, L]``); the
    model itself is left as it is. Exactness of a converted checkpoint is checked this way: in float64 what is
    left is the checkpoint's own rounding to its dtype, the same on every machine, thread count and load,
    where a float32 comparison sits on the accumulation-order floor, which moves with all three."""
    twin = copy.deepcopy(model).to(torch.float64)
    return outputs(twin, ids.reshape(1, -1) if ids.dim() == 1 else ids)


#: first lines of every remote-code check: the interpreter runs with ``-S`` (no ``.pth`` files, so an
#: editable hf_symmetry is invisible), site-packages is appended by hand, and the check refuses to run
#: where hf_symmetry is importable anyway (it would then prove nothing)
_REMOTE_PREAMBLE = """import json, sys
sys.path.append(SITE_PACKAGES)
try:
    import hf_symmetry  # noqa: F401
except ImportError:
    pass
else:
    sys.exit("hf_symmetry is importable: the remote-code test would prove nothing")
"""


def run_without_hf_symmetry(script: str, workdir, timeout: int = 300, **constants) -> dict:
    """Run the Python source ``script`` in a fresh interpreter where hf_symmetry cannot be imported,
    offline, with a private HF cache under ``workdir`` and ``constants`` defined as globals (their
    ``repr``); returns the JSON object printed on its last stdout line. What a user without
    hf_symmetry gets from ``trust_remote_code=True``."""
    workdir = Path(workdir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        HF_HOME=str(workdir / "hf_home"),
        HF_MODULES_CACHE=str(workdir / "hf_modules"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    header = "".join(
        f"{k} = {v!r}\n" for k, v in {"SITE_PACKAGES": sysconfig.get_paths()["purelib"], **constants}.items()
    )
    run = subprocess.run(
        [sys.executable, "-S", "-c", header + _REMOTE_PREAMBLE + script],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise AssertionError(f"no JSON on the last stdout line: {run.stdout[-1000:]!r}\n{run.stderr[-1000:]}") from None


def full_width(plan):
    """A SliceGPT plan at full width (in place; returns the plan): the residual unsliced and every matrix dense at
    the hidden size: the sliced model must then be the original function."""
    plan.residual = plan.hidden
    for m in plan.matrices:
        m.structure = Dense((m.structure.shape[0], plan.hidden))
    return plan


def full_rank(plan):
    """Every structured matrix of a compress plan at full rank (in place; returns the plan): the
    compressed model must then be the original function."""
    for m in plan.matrices:
        m.structure = m.structure.at_full_rank()
    return plan
