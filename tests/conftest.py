"""Shared fixtures: real assets loaded once per session, tiny random models of every family,
and float64-exact RMSNorms."""

from __future__ import annotations

import os

import pytest
import torch

# Tests never reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# Copied from transformers.models.llama.modeling_llama.LlamaRMSNorm.forward, with its one change: transformers'
# RMSNorms compute in float32 even for float64 inputs, which would cap float64 exactness tests at ~1e-7; this
# keeps the input dtype. (tests/modeling/test_copies.py checks that the source exists and computes the same in float32.)
def _exact_rmsnorm_forward(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _legacy_exact_gptj_attn(self, query, key, value, attention_mask=None):
    # GPT-J before transformers 5.24 computes attention scores in float32 whatever the input dtype; keep float64.
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) / self.scale_attn
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value), attn_weights


@pytest.fixture
def exact_rmsnorm(monkeypatch):
    """float64-exact transformers RMSNorms: they keep the input dtype. (Attention needs no patch from
    transformers 5.24: the tiny models run its SDPA backend, which computes in the input dtype.)"""
    from transformers.models.gptj import modeling_gptj

    if not getattr(modeling_gptj.GPTJPreTrainedModel, "_supports_sdpa", False):
        # transformers < 5.24 (the supported range's older end): GPT-J has only its eager path, a private
        # float32 `_attn` with no public switch, so it is patched there; 5.24 and later need no patch
        monkeypatch.setattr(modeling_gptj.GPTJAttention, "_attn", _legacy_exact_gptj_attn)
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.smollm3 import modeling_smollm3

    for cls in (
        modeling_llama.LlamaRMSNorm,
        modeling_mistral.MistralRMSNorm,
        modeling_qwen2.Qwen2RMSNorm,
        modeling_qwen3.Qwen3RMSNorm,
        modeling_smollm3.SmolLM3RMSNorm,
    ):
        monkeypatch.setattr(cls, "forward", _exact_rmsnorm_forward)


@pytest.fixture(scope="session")
def smollm2_dir():
    from hf_symmetry.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def minilm_dir():
    from hf_symmetry.assets import minilm_dir

    return minilm_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from hf_symmetry.evaluation.compare import load_model

    return load_model(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def eval_ids(smollm2_tokenizer):
    """512 tokens of real held-out prose (SmolLM2 tokenizer)."""
    from hf_symmetry.assets import text_path
    from hf_symmetry.text import read_text, tokenize_text

    return tokenize_text(smollm2_tokenizer, read_text(text_path("britannica-eval")), max_tokens=512)


@pytest.fixture(scope="session")
def smollm2_logits64(smollm2, eval_ids):
    """SmolLM2's float64 logits on ``eval_ids``: the reference of the float64 exactness checks."""
    from hf_symmetry.testing import float64_logits

    return float64_logits(smollm2, eval_ids)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama folder with a word-level tokenizer over the words "0" … "96" (its vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_symmetry.testing import tiny_model

    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", dtype=torch.float32).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    return folder
