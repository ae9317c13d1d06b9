"""heal's ``--save-adapter`` folder is byte-deterministic across processes: peft writes ``target_modules`` (a set)
in Python's hash order, which changes with ``PYTHONHASHSEED``; :func:`save_adapter_folder` writes it sorted. Each
process below saves the same LoRA adapter both ways under its own hash seed; the negative control is peft's own
file, which differs between the seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SAVE_BOTH = r"""
import sys, tempfile, pathlib, torch
from peft import LoraConfig, get_peft_model
from hf_symmetry.testing import tiny_model
from hf_symmetry.training.heal.output import save_adapter_folder
torch.manual_seed(0)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = get_peft_model(tiny_model("llama", dtype=torch.float32, seed=0), LoraConfig(r=2, target_modules=targets))
with tempfile.TemporaryDirectory() as d:
    ours, theirs = pathlib.Path(d) / "ours", pathlib.Path(d) / "peft"
    save_adapter_folder(model, ours)
    model.save_pretrained(theirs)
    print((ours / "adapter_config.json").read_text())
    print("\x00")
    print((theirs / "adapter_config.json").read_text())
"""


def _saved(seed: int) -> tuple[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", SAVE_BOTH], env=env, capture_output=True, text=True, check=True)
    ours, theirs = out.stdout.split("\x00")
    return ours.strip(), theirs.strip()


def test_the_adapter_config_is_the_same_bytes_whatever_the_hash_seed():
    runs = [_saved(seed) for seed in (1, 2, 3)]
    ours = {r[0] for r in runs}
    assert len(ours) == 1
    config = json.loads(ours.pop())
    assert config["target_modules"] == sorted(config["target_modules"]) and len(config["target_modules"]) == 7
    # negative control: peft's own file orders the set by the hash seed (the same modules, another order)
    theirs = {r[1] for r in runs}
    assert len(theirs) > 1
    assert all(sorted(json.loads(t)["target_modules"]) == config["target_modules"] for t in theirs)
