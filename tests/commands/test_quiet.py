"""``--quiet`` of every command also silences the libraries' progress bars (transformers' "Loading weights",
"Writing model shards"; huggingface_hub's): one shared place, :func:`hf_symmetry.commands.common.progress_bars`,
around every command in :func:`hf_symmetry.cli.main`, restored afterwards. Negative control: the same command
without ``--quiet`` shows transformers' bar."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch
from huggingface_hub import utils as hub_utils
from transformers.utils import logging as hf_logging

import hf_symmetry  # noqa: F401
from hf_symmetry.cli import COMMAND_MODULES, build_parser, main


def _subparsers():
    parser = build_parser()
    return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices


def _bars_on() -> tuple[bool, bool]:
    return hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()


@pytest.mark.parametrize("name", [n for n in COMMAND_MODULES if "--quiet" in _subparsers()[n]._option_string_actions])
def test_every_quiet_command_runs_with_the_libraries_bars_off(name, monkeypatch):
    """Each command that takes --quiet runs with transformers' and huggingface_hub's bars off under it and on
    without it, and finds them as they were afterwards (the command itself stubbed: only the flag's path)."""
    seen = []
    module = importlib.import_module(f"hf_symmetry.commands.{name.replace('-', '_')}")
    monkeypatch.setattr(module, "run", lambda args: seen.append(_bars_on()) or 0)
    monkeypatch.setattr("hf_symmetry.cli.check_inputs", lambda args: None)  # the inputs "x" are never read
    sub = _subparsers()[name]
    argv = [name, *("x" for a in sub._actions if not a.option_strings)]
    argv += [x for a in sub._actions if a.option_strings and a.required for x in (a.option_strings[0], "1")]
    argv += [
        x for g in sub._mutually_exclusive_groups if g.required for x in (g._group_actions[0].option_strings[0], "1")
    ]
    before = _bars_on()
    assert before == (True, True)
    assert main([*argv, "--quiet"]) == 0 and _bars_on() == before
    assert main(argv) == 0 and _bars_on() == before
    assert seen == [(False, False), (True, True)]


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A tiny Llama with SmolLM2's tokenizer."""
    from hf_symmetry.assets import smollm2_dir
    from hf_symmetry.testing import tiny_model

    folder = tmp_path_factory.mktemp("quiet") / "model"
    tiny_model("llama", dtype=torch.float32, vocab_size=49152).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir() / name, folder / name)
    return folder


def test_quiet_verify_shows_no_loading_weights_bar(tiny_with_tokenizer, capfd):
    m = str(tiny_with_tokenizer)
    argv = ["verify", m, m, "--tokens", "16", "--ppl-tokens", "0", "--device", "cpu"]
    assert main([*argv, "--quiet"]) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s]" not in err
    assert main(argv) == 0  # negative control: transformers' bar is there without --quiet
    assert "Loading weights" in capfd.readouterr().err
