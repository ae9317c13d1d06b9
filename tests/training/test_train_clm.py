"""examples/train_clm.py through its own entry point: a tiny T6 / MLA run, checkpoint + resume equals an
uninterrupted run, two processes (gloo, CPU) equal one process at the same global batch, the saved T6
folder loads as remote code without hf_symmetry, and bad input fails with one line before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_symmetry.testing import run_without_hf_symmetry

pytestmark = pytest.mark.slow  # SmolLM2's tokenizer (a real-model asset); the two-process test runs torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_clm.py"
SMALL = [
    "--hidden-size",
    "192",
    "--layers",
    "1",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--lr",
    "3e-3",
    "--validation-fraction",
    "0.2",
    "--quiet",
    "--cpu",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_clm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few hundred tokens of real prose in paragraphs (the embedded Britannica article)."""
    from hf_symmetry.assets import text_path

    text = text_path("britannica").read_text(encoding="utf-8")[:30000]
    path = tmp_path_factory.mktemp("corpus") / "britannica.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(n)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _run(corpus, out, arch="t6", steps=6, *extra, callbacks=()):
    argv = [
        "--arch",
        arch,
        "--params",
        "1M",
        "--text",
        str(corpus),
        "--max-steps",
        str(steps),
        "--out",
        str(out),
        *SMALL,
        *extra,
    ]
    return _load_script().main(argv, callbacks=callbacks)


def test_interrupted_run_resumed_equals_uninterrupted(corpus, tmp_path):
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise KeyboardInterrupt

    assert _run(corpus, tmp_path / "a", "t6", 6, "--save-steps", "2", "--eval-steps", "3") == 0
    with pytest.raises(KeyboardInterrupt):
        _run(corpus, tmp_path / "b", "t6", 6, "--save-steps", "2", "--eval-steps", "3", callbacks=[Interrupt()])
    assert not (tmp_path / "b" / "model.safetensors").exists()
    assert _run(corpus, tmp_path / "b", "t6", 6, "--save-steps", "2", "--eval-steps", "3", "--resume") == 0
    res = json.loads((tmp_path / "b" / "train_results.json").read_text())
    assert res["resumed_from"].endswith("checkpoint-4") and res["global_step"] == 6
    full = json.loads((tmp_path / "a" / "train_results.json").read_text())
    assert [c["step"] for c in full["eval_curve"]] == [3, 6]
    assert full["eval_curve"][-1]["eval_loss"] < full["eval_curve"][0]["eval_loss"] + 1.0
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
    # and training did something
    assert abs(full["train_curve"][-1]["loss"] - full["train_curve"][0]["loss"]) > 1e-3


def test_two_processes_give_the_weights_of_one_process(corpus, tmp_path):
    args = ["--arch", "mla", "--params", "1M", "--text", str(corpus), "--max-steps", "3", *SMALL]
    assert _load_script().main(args + ["--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "29531",
            str(SCRIPT),
            *args,
            "--out",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "train_results.json").read_text())
    two = json.loads((tmp_path / "two" / "train_results.json").read_text())
    assert (one["processes"], two["processes"]) == (1, 2) and one["train_tokens"] == two["train_tokens"]
    cfg = json.loads((tmp_path / "two" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]
    from transformers import AutoConfig

    from hf_symmetry.training.tpa_paper_configs import build_model

    torch.manual_seed(0)  # the script's initialisation (seed 0), to measure how far training moved each tensor
    init = build_model(AutoConfig.from_pretrained(tmp_path / "one")).state_dict()
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        moved = (a[k] - init[k]).norm()
        assert moved > 0, k
        # float32 all-reduce order differs from one process's sum; Adam's first steps normalise every
        # element, so the comparison is against the training update itself (a wrong batch split moves O(1))
        assert (a[k] - b[k]).norm() <= 1e-3 * moved, (k, ((a[k] - b[k]).norm() / moved).item())


LOADER = textwrap.dedent("""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True)
    ids = tok("The plays of Shakespeare", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    print(json.dumps({"module": type(model).__module__, "loss": loss, "ids": ids.tolist()}))
""")


def test_saved_t6_folder_loads_as_remote_code_without_hf_symmetry(corpus, tmp_path):
    folder = tmp_path / "t6"
    assert _run(corpus, folder, "t6", 2) == 0
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_tpa.TPAForCausalLM"
    got = run_without_hf_symmetry(LOADER, tmp_path, FOLDER=str(folder))
    assert got["module"].startswith("transformers_modules.")
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(got["ids"])
    with torch.no_grad():
        assert abs(local(ids, labels=ids).loss.item() - got["loss"]) < 1e-5


@pytest.mark.parametrize("case", ["missing_text", "bad_params", "out_not_empty", "bad_batch"])
def test_bad_input_fails_with_one_line_before_any_work(corpus, tmp_path, capsys, case):
    out = tmp_path / "out"
    argv = ["--arch", "gqa", "--params", "1M", "--text", str(corpus), "--max-steps", "2", "--out", str(out), *SMALL]
    if case == "missing_text":
        argv[argv.index(str(corpus))] = str(tmp_path / "nope.txt")
    elif case == "bad_params":
        argv[argv.index("1M")] = "lots"
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    else:
        argv[argv.index("--batch-size") + 1] = "0"
    with pytest.raises(SystemExit) as e:
        _load_script().main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_clm.py: error:"), err
    assert not out.exists() or [p.name for p in out.iterdir()] == ["keep.txt"]
