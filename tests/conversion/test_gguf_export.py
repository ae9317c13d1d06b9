"""``export-gguf`` (issue 29, item 5): stock outputs (stock-sliced, rotated) written as GGUF and read back
through transformers' GGUF loading give the folder's greedy text and logits; Llama's q/k rows must be
permuted to GGML's RoPE layout (left out, the logits change)."""

from __future__ import annotations

import json

import pytest
import torch

import hf_symmetry  # noqa: F401
from hf_symmetry.cli import main
from hf_symmetry.conversion import gguf_export as G


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory):
    """An untied tiny Llama (d = 96, 6 heads of 8) with SmolLM2's byte-level BPE tokenizer and vocabulary."""
    from transformers import AutoTokenizer

    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.testing import tiny_model

    folder = tmp_path_factory.mktemp("bpe_llama") / "model"
    tiny_model(
        "llama", dtype=torch.float32, vocab_size=49152, hidden_size=96, intermediate_size=128, tie_word_embeddings=False
    ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(folder)
    return folder


def _slice(src, out, round_to):
    assert (
        main(
            [
                "compress",
                str(src),
                str(out),
                "--structure",
                "slice",
                "--calib",
                "britannica-calib",
                "--calib-tokens",
                "1024",
                "--round-to",
                str(round_to),
                "--no-verify",
                "--quiet",
            ]
        )
        == 0
    )
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize(
    "round_to,cls,read_by",
    [(48, "LlamaForCausalLM", "from_pretrained"), (32, "MistralForCausalLM", "load_gguf_checkpoint")],
)
def test_stock_slice_round_trips_through_gguf(bpe_llama, tmp_path, round_to, cls, read_by, capsys):
    """Width 48 (a multiple of the 6 heads: a Llama, which transformers builds from the file alone) and
    64 (not: a Mistral, filled through transformers' GGUF reader): float32 GGUF gives the folder's logits
    exactly and its greedy text, with the file's own tokenizer tokenizing alike; q8_0 keeps the logits
    close."""
    out = tmp_path / "sliced"
    config = _slice(bpe_llama, out, round_to)
    assert config["architectures"] == [cls] and config["hidden_size"] % round_to == 0
    f32 = tmp_path / "sliced-f32.gguf"
    assert (
        main(
            [
                "export-gguf",
                str(out),
                str(f32),
                "--type",
                "f32",
                "--check",
                "--new-tokens",
                "12",
                "--quiet",
                "--json-out",
                str(tmp_path / "f32.json"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "greedy text equal" in printed
    assert printed.strip().splitlines()[-1].endswith("(whole command, verification included)")  # --check ran
    check = json.loads((tmp_path / "f32.json").read_text())["check"]
    assert check["same_text"] and check["max_abs_dlogit"] < 1e-5 and check["class"] == cls
    assert check["read_by"].startswith(read_by) and check["same_tokenization"] is True
    report = G.export_gguf(out, tmp_path / "sliced-q8.gguf", type="q8_0", progress=False)
    assert report.tensor_types.get("Q8_0", 0) > 0 and report.tensor_types["F32"] == 2 * 2 + 1  # norms: float32
    q8 = G.round_trip(out, tmp_path / "sliced-q8.gguf", new_tokens=4)
    assert 0 < q8["max_abs_dlogit"] < 0.25 * q8["max_abs_logit"]


def test_rotated_output_round_trips_and_the_rope_permutation_matters(bpe_llama, tmp_path, monkeypatch):
    """A rotated (stock) output: exact through an f32 GGUF. Negative control: without the q/k row
    permutation transformers' loader de-permutes rows that were never permuted, and the logits change."""
    rotated = tmp_path / "rotated"
    assert main(["rotate", str(bpe_llama), str(rotated), "--no-verify"]) == 0
    G.export_gguf(rotated, tmp_path / "rot.gguf", type="f32", progress=False)
    good = G.round_trip(rotated, tmp_path / "rot.gguf", new_tokens=8)
    assert good["same_text"] and good["max_abs_dlogit"] < 1e-5
    monkeypatch.setattr(G, "permute_rope_rows", lambda W, n: W)
    G.export_gguf(rotated, tmp_path / "bad.gguf", type="f32", progress=False)
    assert G.round_trip(rotated, tmp_path / "bad.gguf", new_tokens=8)["max_abs_dlogit"] > 0.1


def test_export_refuses_what_gguf_cannot_hold(bpe_llama, tmp_path, capsys):
    out = tmp_path / "mixed"  # a tied head kept in the compressed (remote-code) family
    from hf_symmetry.testing import tiny_model

    src = tmp_path / "tied"
    tiny_model("llama", dtype=torch.float32).save_pretrained(src)
    (src / "config.json").write_text(
        json.dumps({**json.loads((src / "config.json").read_text()), "model_type": "hf_symmetry_compressed_llama"})
    )
    assert main(["export-gguf", str(src), str(tmp_path / "x.gguf")]) == 2
    assert "remote-code family has no GGUF architecture" in capsys.readouterr().err
    assert main(["export-gguf", str(bpe_llama), str(out)]) == 2
    assert "ending in .gguf" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists() and not out.exists()


def test_permutation_is_llama_cpps():
    """Per head, rows (j, j + d_h/2) of the HF layout become rows (2j, 2j + 1)."""
    W = torch.arange(2 * 8, dtype=torch.float32)[:, None]  # 2 heads of 8 rows
    P = G.permute_rope_rows(W, 2)[:, 0].tolist()
    assert P == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
