"""Every conversion's card records the output's speed and bytes against its source, measured by the
verification (hf_symmetry/evaluation/speed.py, hub/measure.py: speed_card_entry); a deliberately slowed model
is the negative control that the figures are timings, not constants."""

from __future__ import annotations

import json
import time

import pytest

from hf_symmetry import cli
from hf_symmetry.evaluation import speed
from hf_symmetry.hub.measure import measure_folder

SLEEP_S = 0.1  # per forward of the slowed model: far above a tiny model's forward, even on a loaded machine


def test_the_card_and_the_summary_record_speed_and_bytes_against_the_source(tiny_dir, tmp_path, capsys):
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    assert cli.main(["rotate", str(tiny_dir), str(out), "--ppl-tokens", "0", "--json", str(summary), "--quiet"]) == 0
    printed = capsys.readouterr().out
    entry = json.loads(summary.read_text())["verification"]["speed"]
    assert entry["bytes"] == {"source": measure_folder(tiny_dir)["bytes"], "converted": measure_folder(out)["bytes"]}
    assert entry["bytes_ratio"] == pytest.approx(entry["bytes"]["converted"] / entry["bytes"]["source"])
    assert entry["decode_steps"] == speed.DECODE_STEPS and entry["rounds"] == speed.ROUNDS
    for name in ("source", "converted"):
        assert entry["prefill_s"][name] > 0 and entry["decode_ms"][name] > 0
    assert entry["prefill_speedup"] > 0 and entry["decode_speedup"] > 0
    line = f"prefill {entry['prefill_speedup']:.2f}x, decode {entry['decode_speedup']:.2f}x; weights"
    card = (out / "README.md").read_text()
    assert "Speed against the source on this machine (cpu, " in card and line in card and line in printed
    record = json.loads((out / "hf_symmetry_card.json").read_text())["data"]["speed"]
    assert record == entry


def test_no_verification_no_speed_line(tiny_dir, tmp_path):
    """Timings differ from run to run: a card written without verification holds none (its bytes stay
    deterministic)."""
    out = tmp_path / "out"
    assert cli.main(["rotate", str(tiny_dir), str(out), "--no-verify", "--quiet"]) == 0
    assert "speed against the source" not in (out / "README.md").read_text().lower()
    assert "speed" not in json.loads((out / "hf_symmetry_card.json").read_text())["data"]


@pytest.mark.parametrize("slowed", ["converted", "source"])
def test_a_slowed_model_measures_slower(tiny_dir, monkeypatch, slowed):
    """Negative control: a forward hook that sleeps on one of the two models moves both ratios to its side;
    the same folder on both sides, so nothing else differs."""
    load = speed.load_for_eval
    loaded = []

    def load_and_slow(path, **kw):
        model = load(path, **kw)
        loaded.append(model)
        if len(loaded) == (2 if slowed == "converted" else 1):
            model.register_forward_hook(lambda *a: time.sleep(SLEEP_S))
        return model

    monkeypatch.setattr(speed, "load_for_eval", load_and_slow)
    s = speed.compare_speed(tiny_dir, tiny_dir, "britannica-eval", device="cpu", rounds=5)
    if slowed == "converted":
        assert s.prefill_speedup < 1 and s.decode_speedup < 1
        assert s.decode_ms["converted"] >= 1e3 * SLEEP_S
    else:
        assert s.prefill_speedup > 1 and s.decode_speedup > 1
        assert s.decode_ms["source"] >= 1e3 * SLEEP_S
