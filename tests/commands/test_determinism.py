"""Every file a conversion writes is byte-deterministic: the same inputs and seed give the same bytes, whichever
folder OUT is (issue #45). Each conversion runs twice on a tiny model, into ``<tmp>/a/<name>`` and
``<tmp>/b/<name>`` (two parent folders: a card that recorded where OUT lives would differ), with its verification
(the card records the figures), and the two folders are compared file by file, byte for byte. The only files
left out are :data:`EXCEPTIONS`, each with its reason. The negative control: the comparison sees a one-byte change
and a file only one run wrote."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from hf_symmetry.cli import main

#: files that may differ between two identical runs, with the reason: none. (The one figure that would differ, the
#: speed against the source that the verification may record in the card, is a timing of this machine, not a property
#: of the model: the test switches it off, see :func:`no_timings`.)
EXCEPTIONS: dict[str, str] = {}

WORDS = " ".join(str(i % 97) for i in range(6000))

HEAL = ["--tokens", "512", "--seq-len", "32", "--batch-size", "4", "--lora-rank", "4", "--teacher-sample-fraction", "0"]
HEAL += ["--device", "cpu", "--eval-text", "{text}", "--ppl-tokens", "64"]  # (its verification: a perplexity)
CALIB = ["--calib", "{text}", "--calib-tokens", "512", "--calib-seq-len", "64"]
#: (name, argv after the command's model/OUT arguments are filled in): every conversion command, on the tiny Llama
CONVERSIONS = {
    "rotate": ["rotate", "{model}", "{out}", "--residual", "random", "--seed", "3"],
    "rotate-scaled": ["rotate", "{model}", "{out}", "--scaling", "--seed", "5"],
    "to-tpa": ["to-tpa", "{model}", "{out}", "--k-rank", "1", "--calib", "{text}", "--calib-tokens", "256"],
    "farr": ["farr", "{model}", "{out}", "--tau", "0.9"],
    "compress": ["compress", "{model}", "{out}", "--structure", "lowrank", "--ratio", "0.3", *CALIB],
    "compress-slice": ["compress", "{model}", "{out}", "--structure", "slice", "--ratio", "0.2", *CALIB],
    "match": ["match", "{model}", "{other}", "{out}"],
    "merge": ["merge", "--method", "average", "{model}", "{other}", "{out}"],
    "export-gguf": ["export-gguf", "{model}", "{out}/model.gguf"],
    "spectra": ["spectra", "{model}", "{out}"],
    "heal": ["heal", "{other}", "{out}", "--teacher", "{model}", "--text", "{text}", *HEAL],
}
VERIFY = ["--tokens", "32", "--ppl-tokens", "64", "--text", "{text}"]
NO_VERIFY_FLAG = {"export-gguf", "spectra", "heal"}  # (no verification to run; heal's --text is its training text)


def _folder_with_tokenizer(folder: Path, seed: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_symmetry.testing import tiny_model

    tiny_model("llama", dtype=torch.float32, seed=seed).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def no_timings(monkeypatch):
    """The verification's speed measurement (wall-clock timings in the card) off, where the verification has one."""
    from hf_symmetry.commands import common

    monkeypatch.setattr(common, "speed_card_entry", lambda *args, **kwargs: None, raising=False)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    text = root / "words.txt"
    text.write_text(WORDS)
    return {
        "model": _folder_with_tokenizer(root / "m", 0),
        "other": _folder_with_tokenizer(root / "n", 1),
        "text": text,
    }


def digests(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def differing(a: Path, b: Path) -> list[str]:
    """The files of two output folders that differ or that only one of them has, exceptions left out."""
    da, db = digests(a), digests(b)
    return sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k) and k not in EXCEPTIONS)


def _run(name: str, inputs: dict, out: Path) -> None:
    if name == "export-gguf":  # (its OUT is one file: it goes in a folder of its own)
        out.mkdir()
    argv = [a.format(out=out, **inputs) for a in CONVERSIONS[name]] + ["--quiet"]
    if name not in NO_VERIFY_FLAG:
        argv += [a.format(**inputs) for a in VERIFY]
    assert main(argv) == 0, argv


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_every_file_a_conversion_writes_is_byte_identical_across_runs(name, inputs, tmp_path):
    a, b = tmp_path / "a" / name, tmp_path / "b" / name
    a.parent.mkdir()
    b.parent.mkdir()
    _run(name, inputs, a)
    _run(name, inputs, b)
    assert len(digests(a)) >= (1 if name == "export-gguf" else 3), sorted(digests(a))  # weights, config, card
    if name.startswith("compress"):  # the layer map (safetensors' own writer orders its metadata differently each time)
        assert "layer_map.safetensors" in digests(a)
    assert differing(a, b) == []


def test_the_comparison_sees_a_changed_byte_and_a_missing_file(tmp_path):
    """Negative control of :func:`differing`."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "w.bin").write_bytes(b"\x00" * 64)
    assert differing(a, b) == []
    (b / "sub" / "w.bin").write_bytes(b"\x00" * 63 + b"\x01")
    (a / "only_here.json").write_text("{}")
    assert differing(a, b) == ["only_here.json", "sub/w.bin"]
    shutil.rmtree(b)
    assert differing(a, a) == []
