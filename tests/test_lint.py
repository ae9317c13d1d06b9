"""The code passes ruff (lint and format, configured in pyproject.toml); ruff comes with the ``test`` extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    found = str(exe) if exe.exists() else shutil.which("ruff")
    assert found, "ruff is missing: install the test extra (pip install -e '.[test]')"
    return [found]


@pytest.mark.parametrize("args", [["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]])
def test_ruff_passes(args):
    res = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


def test_ruff_catches_a_planted_fault(tmp_path):
    """Negative control: the same configuration fails on an unused import and on unformatted code."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\nx = {  'a':1 }\n")
    lint = subprocess.run([*_ruff(), "check", "--no-cache", "."], cwd=tmp_path, capture_output=True, text=True)
    fmt = subprocess.run(
        [*_ruff(), "format", "--check", "--no-cache", "."], cwd=tmp_path, capture_output=True, text=True
    )
    assert lint.returncode == 1 and "F401" in lint.stdout
    assert fmt.returncode == 1
