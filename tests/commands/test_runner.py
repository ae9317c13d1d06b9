"""``commands/runner.py``: every conversion command runs the same steps in the same order (check before any work,
convert, verify, summary, push, total-time line, emit); a command supplies only its own parts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from hf_symmetry.commands.runner import Conversion, run_conversion


@dataclass
class _Report:
    family: str = "llama"
    verification: dict | None = None


class _Steps(Conversion):
    """Records the order of its steps."""

    def __init__(self, args, refuse: bool = False):
        super().__init__(args)
        self.steps, self.refuse = [], refuse

    def check(self):
        self.steps.append("check")
        if self.refuse:
            raise ValueError("refused")

    def convert(self):
        self.steps.append("convert")
        return _Report(), ["converted"]

    def verify(self, report, lines):
        self.steps.append("verify")
        return super().verify(report, lines)  # --no-verify: None, no line

    def summary(self, report):
        self.steps.append("summary")
        return super().summary(report)


def _args(tmp_path, **kw):
    return SimpleNamespace(out=str(tmp_path / "out"), no_verify=True, json_out=str(tmp_path / "s.json"), **kw)


def test_the_steps_run_in_order_and_the_summary_has_the_push(tmp_path, capsys):
    command = _Steps(_args(tmp_path))
    assert run_conversion(command) == 0
    assert command.steps == ["check", "convert", "verify", "summary"]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "converted"
    assert out[1].startswith("done in ") and out[1].endswith(" s (whole command)")  # no verification ran
    assert json.loads((tmp_path / "s.json").read_text()) == {"family": "llama", "verification": None, "push": None}


def test_a_command_without_publishing_has_no_push_entry(tmp_path, capsys):
    command = _Steps(_args(tmp_path))
    command.publishes = False
    run_conversion(command)
    assert "push" not in json.loads((tmp_path / "s.json").read_text())


def test_a_refusal_in_check_comes_before_any_work(tmp_path, capsys):
    command = _Steps(_args(tmp_path), refuse=True)
    with pytest.raises(ValueError, match="refused"):
        run_conversion(command)
    assert command.steps == ["check"] and capsys.readouterr().out == ""
    assert not (tmp_path / "s.json").exists()
