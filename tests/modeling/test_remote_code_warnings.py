"""Published models carry hf_symmetry's flat remote-code files and run under whatever transformers the
downloader has. A deprecated transformers API used there works today and stops loading on the release
that removes it, with nobody able to fix the folders already on the Hub. So each family is loaded from a
saved folder as remote code and run (``forward``, then ``generate`` with its cache), and any
FutureWarning or DeprecationWarning raised from its files, or naming its classes, fails the test."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from heal_models import tiny
from transformers import AutoConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint
from hf_symmetry.modeling import cache_field
from hf_symmetry.testing import tiny_model

FLAT_FILES = {p.name for p in (Path(__file__).parents[2] / "hf_symmetry" / "modeling").glob("*_*.py")}
CLASS_PREFIXES = ("TPA", "Farr", "CompressedLlama", "RMSDecoder")


def _saved(family: str, folder: Path) -> Path:
    if family == "rms_decoder":  # what `rotate --residual` writes for a LayerNorm decoder (OPT)
        src = folder.parent / f"{folder.name}-src"
        tiny_model("opt", dtype=torch.float32).save_pretrained(src)
        rotate_checkpoint(src, folder, RotateOptions(residual="hadamard", heads="none", ffn=False), progress=False)
    else:
        tiny(family, vocab=97).save_pretrained(folder)
    assert any(name in FLAT_FILES for name in (p.name for p in folder.iterdir())), "no remote code saved"
    return folder


def remote_class(folder: Path):
    """The causal-LM class of ``folder``'s own code files, as ``trust_remote_code=True`` loads it (not the
    class hf_symmetry registers in this process)."""
    auto_map = AutoConfig.from_pretrained(folder, trust_remote_code=True).auto_map
    cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], folder)
    assert cls.__module__.startswith("transformers_modules"), cls.__module__
    return cls


def _deprecations(folder: Path) -> list[str]:
    """Load ``folder`` as remote code, run forward and cached greedy generation; return the deprecation
    warnings its code raised (attributed to a flat file, or naming one of its classes)."""
    ids = torch.arange(3, 11).unsqueeze(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = remote_class(folder).from_pretrained(folder).eval()
        with torch.no_grad():
            out = model(ids, use_cache=True)
            assert getattr(out, cache_field()) is not None
            generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 12)
    return [
        f"{Path(w.filename).name}:{w.lineno}: {w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
        and (Path(w.filename).name in FLAT_FILES or any(c in str(w.message) for c in CLASS_PREFIXES))
    ]


@pytest.mark.parametrize("family", ["tpa", "compressed", "farr", "rms_decoder"])
def test_remote_code_runs_without_deprecation_warnings(family, tmp_path):
    found = _deprecations(_saved(family, tmp_path / family))
    assert not found, "\n".join(found)


@pytest.mark.skipif(
    cache_field() != "cache",
    reason="the installed transformers still names the cache "
    "`past_key_values` (before 5.24): the old keyword is not deprecated there",
)
def test_the_check_catches_a_module_that_calls_a_deprecated_signature(tmp_path):
    """Negative control: the same family with ``create_causal_mask`` called by its pre-5.24 keyword."""
    folder = _saved("rms_decoder", tmp_path / "good")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    code = (bad / "modeling_rms_decoder.py").read_text()
    call = "create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)"
    assert call in code
    (bad / "modeling_rms_decoder.py").write_text(
        code.replace(
            call,
            "create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, "
            "past_key_values=cache, position_ids=position_ids)",
        )
    )
    found = _deprecations(bad)
    assert found and all("modeling_rms_decoder.py" in f for f in found), found
