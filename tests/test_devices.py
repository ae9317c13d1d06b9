"""``--device`` / ``--calib-dtype``: one clear error before any work, nothing written; and killed
runs' partial output folders are removed by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_symmetry.devices import DeviceError, default_placement, parse_device, resolve


def test_auto_is_cuda_when_present_else_cpu():
    assert parse_device("auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve("cpu", "bfloat16").dtype == torch.bfloat16
    assert resolve("cpu", "float32").label == "cpu (float32)"


def test_one_reading_of_device_for_calibration_verification_and_heal():
    """``--device`` is read by ``parse_device`` alone: ``auto`` is one device everywhere (the current CUDA
    device, else the CPU); only whether it was ``auto`` tells verification to let accelerate spread a
    whole model (``device_map="auto"``: :attr:`DeviceRequest.spread`), and a request already read passes
    through unchanged."""
    from hf_symmetry.evaluation.verification import load_for_eval

    auto = parse_device("auto")
    assert auto.auto and auto.spread and auto.device == resolve("auto").device
    assert parse_device(None) == parse_device(" AUTO ") == parse_device(auto) == auto
    assert parse_device("auto").device_map == parse_device(None).device_map == auto.device_map == "auto"
    named = parse_device("cpu")
    assert not named.auto and not named.spread and named.device == torch.device("cpu")
    assert parse_device(named) is named and named.device_map == "cpu" and resolve(named).device == named.device
    # negative control: a device that names no device here is refused by the same reading on every path
    for read in (parse_device, resolve, lambda d: load_for_eval("default", device=d)):
        with pytest.raises(DeviceError, match="unknown device 'tpu'"):
            read("tpu")
    # the library's default placement, named once
    assert default_placement() == resolve("cpu", "float32")
    assert default_placement("float64") == resolve("cpu", "float64")


@pytest.mark.parametrize(
    "device, dtype, message",
    [
        ("tpu", "float32", "unknown device 'tpu'"),
        ("cuda:x", "float32", "unknown device"),
        ("cpu", "float16", "unknown calibration dtype 'float16'"),
    ]
    + (
        [("cuda", "float32", "CUDA is not available"), ("cuda:1", "float32", "CUDA is not available")]
        if not torch.cuda.is_available()
        else [("cuda:99", "float32", "CUDA device")]
    ),
)
def test_bad_devices_and_dtypes_are_refused(device, dtype, message):
    with pytest.raises(DeviceError, match=message):
        resolve(device, dtype)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_absent_is_refused():
    with pytest.raises(DeviceError, match="MPS backend is not available"):
        resolve("mps")


@pytest.mark.parametrize(
    "argv",
    [
        ["to-tpa", "{model}", "{out}", "--k-rank", "1", "--calib", "britannica-calib", "--device", "tpu"],
        [
            "farr",
            "{model}",
            "{out}",
            "--tau",
            "0.9",
            "--calibrate",
            "britannica-calib",
            "--device",
            "cuda:7" if not torch.cuda.is_available() else "cuda:99",
        ],
        ["spectra", "{model}", "{out}", "--calibrate", "britannica-calib", "--calib-dtype", "float16"],
        ["merge", "--method", "regmean", "{model}", "{model}", "{out}", "--device", "quantum"],
    ],
)
def test_cli_refuses_a_bad_device_with_one_line_and_writes_nothing(argv, tmp_path, capsys):
    from hf_symmetry.cli import main
    from hf_symmetry.testing import tiny_model

    model = tmp_path / "model"
    tiny_model("llama", dtype=torch.float32).save_pretrained(model)
    out = tmp_path / "out"
    argv = [a.format(model=model, out=out) for a in argv]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals (a --calib-dtype outside its choices)
        code = exc.code
    assert code not in (0, None)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and ("device" in errors[0] or "dtype" in errors[0]), errors  # argparse adds usage
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


_KILLED_RUN = textwrap.dedent("""
    import sys, time
    from hf_symmetry.checkpoint_io import atomic_output_dir
    with atomic_output_dir(sys.argv[1]) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        print(tmp.name, flush=True)
        time.sleep(60)
""")


def test_a_run_killed_by_sigkill_leaves_out_untouched_and_the_next_run_cleans_up(tmp_path, capfd):
    from hf_symmetry.checkpoint_io import atomic_output_dir

    out = tmp_path / "OUT"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(out)], stdout=subprocess.PIPE, text=True)
    partial = tmp_path / proc.stdout.readline().strip()
    assert partial.is_dir() and partial.name.startswith(f".OUT.partial-{proc.pid}-")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and partial.is_dir()  # killed: OUT untouched, the partial folder left
    # a live run's partial folder must survive the cleanup (here: this test's own pid)
    live = tmp_path / f".OUT.partial-{os.getpid()}-live"
    live.mkdir()
    capfd.readouterr()
    with atomic_output_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    err = capfd.readouterr().err
    assert not partial.exists() and live.is_dir() and (out / "config.json").is_file()
    assert err.count("\n") == 1 and partial.name in err and f"pid {proc.pid}" in err
    # nothing stale left: the next run says nothing
    with atomic_output_dir(out, overwrite=True):
        pass
    assert capfd.readouterr().err == ""
