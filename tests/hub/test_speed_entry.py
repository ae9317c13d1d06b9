"""Every conversion's card records the output's speed and bytes against its source, measured by the
verification on the two models it loaded (hf_symmetry/evaluation/speed.py, verification.Verifier(speed=True),
hub/measure.py: speed_card_entry); a deliberately slowed model is the negative control that the figures are
timings, not constants, and timings of the very models the verification scored."""

from __future__ import annotations

import json
import time
import weakref

import pytest
import torch

from hf_symmetry import cli
from hf_symmetry.evaluation import speed, verification
from hf_symmetry.evaluation.compare import load_tokenizer
from hf_symmetry.hub.measure import measure_folder
from hf_symmetry.text import tokenize_text

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


def _slowed(model):
    model.register_forward_hook(lambda *a: time.sleep(SLEEP_S))
    return model


@pytest.mark.parametrize("slowed", ["converted", "source"])
def test_a_slowed_model_measures_slower(tiny_dir, slowed):
    """Negative control: a forward hook that sleeps on one of the two models moves both ratios to its side;
    the same folder on both sides, so nothing else differs."""
    models = [verification.load_for_eval(tiny_dir, device="cpu") for _ in range(2)]
    _slowed(models[1 if slowed == "converted" else 0])
    ids = tokenize_text(load_tokenizer(tiny_dir), "1 2 3 " * 40, speed.PREFILL_TOKENS)
    s = speed.compare_loaded(tuple(models), ids, torch.device("cpu"), rounds=5)
    if slowed == "converted":
        assert s.prefill_speedup < 1 and s.decode_speedup < 1
        assert s.decode_ms["converted"] >= 1e3 * SLEEP_S
    else:
        assert s.prefill_speedup > 1 and s.decode_speedup > 1
        assert s.decode_ms["source"] >= 1e3 * SLEEP_S


@pytest.fixture
def loads(monkeypatch):
    """Every model the verification loads, in order; the second (the converted model) slowed; whether the first
    was still alive when the second was loaded, and when the second was scored."""
    load, score = verification.load_for_eval, verification._score
    seen = {"models": [], "first_alive": None, "first_alive_at_scoring": None}

    def counting_load(path, **kw):
        model = load(path, **kw)
        if seen["models"]:
            seen["first_alive"] = seen["models"][0]() is not None
            _slowed(model)
        seen["models"].append(weakref.ref(model))
        return model

    def watched_score(model, *args):
        if len(seen["models"]) == 2:
            seen["first_alive_at_scoring"] = seen["models"][0]() is not None
        return score(model, *args)

    monkeypatch.setattr(verification, "load_for_eval", counting_load)
    monkeypatch.setattr(verification, "_score", watched_score)
    return seen


def test_the_verification_times_the_models_it_loaded(tiny_dir, loads):
    """One load of each model serves the figures and the timing: two loads in all, the first model held
    until the second is loaded and let go before the second is scored (memory never holds two models and a
    perplexity's activations), and the slowed converted model (only the verification's own load is slowed)
    measures slower."""
    v = verification.Verifier(tokens=16, ppl_tokens=0, device="cpu", progress=False, speed=True).run(tiny_dir, tiny_dir)
    assert len(loads["models"]) == 2 and loads["first_alive"] is True and loads["first_alive_at_scoring"] is False
    assert v.speed is not None and v.speed.prefill_speedup < 1 and v.speed.decode_speedup < 1
    assert v.speed.decode_ms["converted"] >= 1e3 * SLEEP_S
    assert "speed" not in v.as_dict()  # (a timing, not an exactness figure)
    assert all(ref() is None for ref in loads["models"])  # both released afterwards


@pytest.mark.parametrize("why", ["not asked", "does not fit"])
def test_without_speed_one_model_at_a_time(tiny_dir, loads, monkeypatch, why):
    """Negative control: without ``speed``, or where the two do not fit the device together, nothing is timed and
    the first model is released before the second is loaded."""
    if why == "does not fit":
        monkeypatch.setattr(verification, "speed_device", lambda *a, **k: None)
    verifier = verification.Verifier(tokens=16, ppl_tokens=0, device="cpu", progress=False, speed=why == "does not fit")
    v = verifier.run(tiny_dir, tiny_dir)
    assert len(loads["models"]) == 2 and loads["first_alive"] is False and loads["first_alive_at_scoring"] is False
    assert v.speed is None and v.max_abs_dlogit == 0
