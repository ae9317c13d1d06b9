"""Publishing (issue #45): a compressed folder whose token embedding is structured (compress's default) publishes,
and a push that fails leaves the local folder exactly as it was (its card names no repo that was never made).
Against the fake Hub of tests/fake_hub.py."""

from __future__ import annotations

import hashlib

import pytest
import torch
from fake_hub import FakeHub
from test_push import _go_online

from hf_symmetry.cli import main
from hf_symmetry.evaluation.compare import load_model
from hf_symmetry.hub.push import push_folder


@pytest.fixture(scope="module")
def server():
    with FakeHub(lifetime=900) as hub:
        yield hub


@pytest.fixture
def hub(server, monkeypatch, tmp_path):
    server.repos.clear()
    server.requests.clear()
    server.refuse_commits = False
    _go_online(monkeypatch, server, tmp_path)
    return server


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """``hf-symmetry compress`` of a tiny Llama (word-level tokenizer) with its defaults: a structured embedding.
    The verification records a perplexity on a local text, which the pre-push check recomputes without
    hf_symmetry."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_symmetry.testing import tiny_model

    root = tmp_path_factory.mktemp("push")
    src, text = root / "tiny", root / "words.txt"
    tiny_model("llama", dtype=torch.float32).save_pretrained(src)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(src)
    text.write_text(" ".join(str(i % 97) for i in range(3000)))
    flags = ["--calib", str(text), "--calib-tokens", "512", "--calib-seq-len", "64", "--text", str(text)]
    out = root / "compressed"
    argv = ["compress", str(src), str(out), "--structure", "lowrank", "--ratio", "0.3", *flags, "--quiet"]
    assert main([*argv, "--tokens", "32", "--ppl-tokens", "64"]) == 0
    return out


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_compressed_folder_with_a_structured_embedding_publishes(hub, compressed, tmp_path):
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(compressed, folder)
    with pytest.raises(AttributeError):  # what the isolated perplexity used to read, and why the check refused it
        load_model(folder).get_input_embeddings().weight
    result = push_folder(folder, "user/compressed", progress=False)
    assert result.check["perplexities"], result.check  # the card's perplexity was recomputed without hf_symmetry
    assert all(p["rel_diff"] <= 1e-4 for p in result.check["perplexities"])
    assert "model.safetensors" in hub.repos["user/compressed"].files


@pytest.mark.parametrize("failure", ["refused commit", "no network"])
def test_a_failed_push_leaves_the_folder_as_it_was(hub, compressed, tmp_path, monkeypatch, failure):
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(compressed, folder)
    before = _digests(folder)
    if failure == "refused commit":
        hub.refuse_commits = True
    else:
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ValueError, match="refused the commit|could not create"):
        push_folder(folder, "user/never", check=False, progress=False)
    assert _digests(folder) == before  # README.md and hf_symmetry_card.json do not name user/never
    assert "user/never" not in hub.repos
    # the control: a push that succeeds does write the repo id into the card
    hub.refuse_commits = False
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    push_folder(folder, "user/now", check=False, progress=False)
    after = _digests(folder)
    assert after["README.md"] != before["README.md"] and "user/now" in (folder / "README.md").read_text()


def test_push_command_with_a_failed_commit_exits_2_and_changes_nothing(hub, compressed, tmp_path, capsys):
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(compressed, folder)
    before = _digests(folder)
    hub.refuse_commits = True
    assert main(["push", str(folder), "user/never", "--no-check", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused the commit" in err[0], err
    assert _digests(folder) == before
