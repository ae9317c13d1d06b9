"""What a user sees and publishes (issue 16): every conversion writes a folder with no local path
in it, prints the numbers its card holds, names two different inputs differently, writes
ordinary file modes; the README's command lines parse with the CLI's own parser and the cards'
Python snippets run as written, without a prompt."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from hf_symmetry.cli import build_parser, main
from hf_symmetry.hub.cards import fmt_number
from hf_symmetry.testing import tiny_model

REPO = Path(__file__).resolve().parents[2]
TEXT = (
    "The play opens with a storm at sea, and the island is the scene of the whole action. " * 40
    + "Prospero was the rightful duke of Milan, and his brother took the dukedom from him. " * 40
)
VERIFY = ["--tokens", "24", "--ppl-tokens", "80", "--quiet"]


def _word_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]"] + sorted(set(re.findall(r"\w+|[^\w\s]", TEXT)))
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(97 - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def _save(model, folder: Path, tokenizer: bool = True) -> Path:
    model.to(torch.float32).save_pretrained(folder)
    if tokenizer:
        _word_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Inputs and the verification text under a private temporary path; two different Llama
    models in folders with the same name (``a/model``, ``b/model``)."""
    root = tmp_path_factory.mktemp("private-inputs-xyz")
    a = _save(tiny_model("llama", seed=0), root / "a" / "model")
    b = _save(tiny_model("llama", seed=1), root / "b" / "model")
    bert = _save(tiny_model("bert", seed=0), root / "bert")
    text = root / "held-out.txt"
    text.write_text(TEXT)
    return {"root": root, "a": a, "b": b, "bert": bert, "text": text}


def _run(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def _text_files(folder: Path):
    for f in folder.rglob("*"):
        if f.is_file() and f.suffix in (".md", ".json", ".txt", ".py", ".yaml", ".jinja"):
            yield f


def _assert_nothing_local(folder: Path, root: Path) -> None:
    for f in _text_files(folder):
        content = f.read_text(errors="replace")
        assert str(root) not in content, f"{f.name} publishes the local path {root}"
        assert "private-inputs-xyz" not in content, f"{f.name} publishes part of a local path"


def _assert_modes(folder: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.rglob("*"):
        if f.is_file():
            assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f"{f.name} has mode {oct(f.stat().st_mode & 0o777)}"


def _assert_printed_equals_card(out: str, folder: Path) -> None:
    card = ModelCard.load(folder / "README.md")
    e = card.data.hf_symmetry["exactness"]
    figures = [e["max_abs_dlogit"]]
    if e.get("perplexity_original") is not None:
        figures += [e["perplexity_original"], e["perplexity_converted"]]
        assert f"window {e['ppl_window']}, stride {e['ppl_stride']}" in out
    figures += [r.metric_value for r in card.data.eval_results or []]
    for x in figures:
        assert fmt_number(x) in out, f"{fmt_number(x)} (card) is not what the command printed:\n{out}"
        assert fmt_number(x) in card.text


CONVERSIONS = {
    "rotate": lambda i, out: ["rotate", str(i["a"]), out],
    "match": lambda i, out: ["match", str(i["a"]), str(i["b"]), out],
    "to-tpa": lambda i, out: ["to-tpa", str(i["a"]), out, "--k-rank", "1", "--v-rank", "1"],
    "farr": lambda i, out: ["farr", str(i["a"]), out, "--tau", "0.9"],
    "farr-encoder": lambda i, out: ["farr", str(i["bert"]), out, "--params-fraction", "0.7", "--qk"],
}


@pytest.fixture(scope="module")
def converted(inputs, tmp_path_factory):
    """Each conversion run once through the CLI; (stdout, folder) by name."""
    import contextlib
    import io

    outs, done = tmp_path_factory.mktemp("outs"), {}
    for name, argv in CONVERSIONS.items():
        folder = outs / name
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv(inputs, str(folder)) + ["--text", str(inputs["text"]), *VERIFY]) == 0
        done[name] = (buf.getvalue(), folder)
    folder = outs / "merge"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(
                [
                    "merge",
                    "--method",
                    "average",
                    "--match",
                    str(inputs["a"]),
                    str(inputs["b"]),
                    str(folder),
                    "--text",
                    str(inputs["text"]),
                    "--ppl-tokens",
                    "80",
                    "--quiet",
                ]
            )
            == 0
        )
    done["merge"] = (buf.getvalue(), folder)
    # compress verifies like the conversions above; heal takes its own evaluation flags (--eval-text); the
    # card must be as clean
    text = str(inputs["text"])
    for name, argv in {
        "compress": [
            "compress",
            str(inputs["a"]),
            str(outs / "compress"),
            "--structure",
            "slice",
            "--calib",
            text,
            "--calib-tokens",
            "160",
            "--calib-seq-len",
            "16",
            "--text",
            text,
            *VERIFY,
        ],
        "heal": [
            "heal",
            str(outs / "compress"),
            str(outs / "heal"),
            "--teacher",
            str(inputs["a"]),
            "--text",
            text,
            "--tokens",
            "256",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--lora-rank",
            "2",
            "--eval-text",
            text,
            "--eval-tokens",
            "80",
            "--quiet",
        ],
    }.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0, name
        done[name] = (buf.getvalue(), outs / name)
    return done


@pytest.mark.parametrize("name", [*CONVERSIONS, "merge", "compress", "heal"])
def test_conversion_folder_publishes_no_local_path_and_has_ordinary_modes(name, converted, inputs):
    out, folder = converted[name]
    _assert_nothing_local(folder, inputs["root"])
    _assert_modes(folder)
    card = ModelCard.load(folder / "README.md")
    assert card.data.hf_symmetry["exactness"] or name in ("merge", "compress", "heal")  # lossy: no exactness
    assert "(Δ )" not in card.text and "seed 000" not in card.text
    assert "## References" in card.text
    # per-layer detail stays out of the front matter
    assert len(card.content.split("---")[1]) < 6000


@pytest.mark.parametrize("name", CONVERSIONS)
def test_printed_numbers_are_the_card_numbers(name, converted):
    out, folder = converted[name]
    _assert_printed_equals_card(out, folder)
    assert "done in" in out  # the reported time covers the whole command


def test_merge_prints_every_perplexity_it_records_and_names_inputs_apart(converted):
    out, folder = converted["merge"]
    card = ModelCard.load(folder / "README.md")
    ev = json.loads((folder / "hf_symmetry_card.json").read_text())["data"]["evaluation"]
    assert set(ev["inputs"]) == {"a/model", "b/model"}  # two folders called `model`, two names
    for x in [ev["merged"], *ev["inputs"].values()]:
        assert fmt_number(x) in out and fmt_number(x) in card.text
    assert card.data.eval_results[0].metric_value == ev["merged"]
    assert card.data.hf_symmetry["inputs"] == ["a/model", "b/model"]
    assert not card.data.base_model  # no Hub ancestor: nothing invented, nothing duplicated


def test_match_card_names_anchor_and_source_apart(converted):
    out, folder = converted["match"]
    card = ModelCard.load(folder / "README.md")
    x = card.data.hf_symmetry["extra"]
    assert x["source"] != x["anchor"] and {x["source"], x["anchor"]} == {"a/model", "b/model"}
    assert f"`{x['source']}` re-parametrised" in card.text and f"to `{x['anchor']}`" in card.text


def test_farr_prints_the_card_parameter_count(converted):
    for name in ("farr", "farr-encoder"):
        out, folder = converted[name]
        card = ModelCard.load(folder / "README.md")
        assert f"-> {card.data.hf_symmetry['size']['parameters']:,}" in out


def test_card_snippets_run_as_written_without_a_prompt(converted, tmp_path):
    """The Python block of every card, with the placeholder replaced by the folder, in a fresh
    interpreter whose stdin is closed: a trust_remote_code prompt would fail it."""
    script = []
    for name, (_, folder) in converted.items():
        card = (folder / "README.md").read_text()
        (block,) = re.findall(r"```python\n(.*?)```", card, re.S)
        ref = re.search(r'from_pretrained\("([^"]+)"', block).group(1)
        script.append(block.replace(f'"{ref}"', repr(str(folder))))
        script.append(f"print('ok', {name!r}, type(model).__name__)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", "\n".join(script)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("ok ") == len(converted)
    assert "[y/N]" not in r.stdout + r.stderr and "trust_remote_code" not in r.stderr


def _readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _readme_command_lines() -> list[str]:
    """Every concrete ``hf-symmetry ...`` command line of the README's shell blocks (usage
    synopses with ``[...]``, ``|`` or placeholders are not commands)."""
    lines = []
    for lang, block in _readme_blocks((REPO / "README.md").read_text()):
        if lang not in ("", "bash", "sh", "console"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip().removeprefix("$ ")
            for part in re.split(r"&&|;", line):
                part = part.strip()
                m = re.match(r"^(?:\S*/)?hf-symmetry\s+(?!\S+:)(.*)$", part)  # not an error message
                if m and not re.search(r"[\[\]|…]|\.\.\.|\(|\bMODEL\b|\bOUT\b|OUT_DIR|REPO|\bA B\b", part):
                    lines.append(m.group(1))
    return lines


def test_readme_command_lines_parse_with_the_cli_parser(monkeypatch):
    from hf_symmetry.commands import common

    monkeypatch.setattr(
        common._PushTarget,
        "__call__",
        lambda self, parser, ns, value, option_string=None: setattr(ns, self.dest, value),
    )
    lines = _readme_command_lines()
    assert len(lines) >= 8, lines
    parser = build_parser()
    seen = set()
    for line in lines:
        args = parser.parse_args(shlex.split(line))  # SystemExit on anything the CLI does not accept
        seen.add(args.command)
    assert {"rotate", "eval", "farr", "spectra", "compress", "to-tpa", "match", "merge", "heal"} <= seen


def test_farr_warns_when_a_choice_removes_little_yet_costs_much():
    from types import SimpleNamespace

    from hf_symmetry.commands.farr import costly_reduction_warning
    from hf_symmetry.conversion.farr import FarrOptions

    tau = FarrOptions(tau=0.99, params_fraction=None, vo=True, qk=False)
    report = SimpleNamespace(
        params_before=1000, params_after=998, verification={"perplexity_original": 36.2, "perplexity_converted": 111.4}
    )
    warning = costly_reduction_warning(report, tau)
    assert "τ = 0.99" in warning and "0.2%" in warning and "36.2 -> 111.4" in warning
    report.verification = {"perplexity_original": 36.2, "perplexity_converted": 36.5}  # cheap: no warning
    assert costly_reduction_warning(report, tau) is None
    report.params_after, report.verification["perplexity_converted"] = 700, 111.4  # removes much: fair
    assert costly_reduction_warning(report, tau) is None
    report.params_after, report.verification = 998, {"hidden_cosine": 0.9}  # encoders
    assert "cosine 0.9" in costly_reduction_warning(report, tau)


@pytest.mark.parametrize("command", ["rotate", "to-tpa", "farr"])
def test_a_source_without_tokenizer_is_refused_before_anything_is_written(command, tmp_path, capsys):
    folder = tmp_path / "no_tokenizer"
    tiny_model("llama", dtype=torch.float32).save_pretrained(folder)
    out = tmp_path / "out"
    extra = {"rotate": [], "to-tpa": ["--k-rank", "2", "--v-rank", "2"], "farr": ["--params-fraction", "0.8"]}[command]
    assert main([command, str(folder), str(out), *extra, "--text", "hamlet"]) != 0
    assert "no tokenizer files" in capsys.readouterr().err
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    # the control: --no-verify needs no tokenizer, and the conversion runs
    assert main([command, str(folder), str(out), *extra, "--no-verify", "--quiet"]) == 0
    assert (out / "config.json").is_file()
