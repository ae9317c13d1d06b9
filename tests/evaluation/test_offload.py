"""Verification under accelerate's device map when the model spans CPU memory and disk.

``load_for_eval(device="auto")`` asks accelerate for ``device_map="auto"``; with too little memory
for the whole model it offloads layers to ``offload_folder``. Here the CPU's budget is cut to half
the model, so the map spans CPU and disk on any machine, and every figure verification measures
(logits, perplexity, a whole ``verify`` of the folder against itself) must equal the figures of the
same model loaded whole. The negative control checks that the budget really forced disk offload.
"""

from __future__ import annotations

import pytest
import torch

from hf_symmetry.evaluation import verification
from hf_symmetry.evaluation.perplexity import perplexity
from hf_symmetry.testing import tiny_model


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama", dtype=torch.float32, num_hidden_layers=4).save_pretrained(path)
    return path


@pytest.fixture
def half_the_cpu(monkeypatch, folder):
    """accelerate sees a CPU with room for about half the model's bytes (and no GPU)."""
    import transformers.integrations.accelerate as hf_accelerate

    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    monkeypatch.setattr(hf_accelerate, "accelerate_max_memory", lambda max_memory=None: {"cpu": size // 2})
    return size


def _on_disk(model) -> list[str]:
    return [k for k, v in (getattr(model, "hf_device_map", None) or {}).items() if v == "disk"]


def test_the_auto_map_spans_cpu_and_disk_and_measures_what_the_whole_model_does(folder, half_the_cpu, tmp_path):
    whole = verification.load_for_eval(folder, device="cpu")
    spread = verification.load_for_eval(folder, device="auto", offload_folder=tmp_path / "offload")
    assert _on_disk(spread), spread.hf_device_map  # the budget forced part of it to disk
    assert not _on_disk(whole)
    assert any(p.device.type == "meta" for p in spread.parameters())
    ids = torch.randint(0, whole.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    a, kind_a = verification._output(whole, ids)
    b, kind_b = verification._output(spread, ids)
    assert kind_a == kind_b == "logits" and a.abs().max() > 0
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert perplexity(whole, ids, 16, 8, progress=False).perplexity == pytest.approx(
        perplexity(spread, ids, 16, 8, progress=False).perplexity, rel=1e-5
    )


def test_verify_a_folder_against_itself_through_the_offloaded_map(folder, half_the_cpu, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    text = tmp_path / "digits.txt"
    text.write_text(" ".join(str((7 * i) % 97) for i in range(300)))
    v = verification.verify(folder, folder, text=str(text), tokens=32, ppl_tokens=64, device="auto", progress=False)
    assert v.max_abs_dlogit == 0.0 and v.perplexity_original == v.perplexity_converted > 1


def test_without_the_cut_budget_nothing_goes_to_disk(folder, tmp_path):
    """Negative control: the same call with the machine's real memory keeps everything in memory,
    so the tests above see disk offload because of the budget, not by accident."""
    model = verification.load_for_eval(folder, device="auto", offload_folder=tmp_path / "offload")
    assert not _on_disk(model) and not any(p.device.type == "meta" for p in model.parameters())
