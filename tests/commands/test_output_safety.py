"""Issue #45 (never lose the user's data), part A: ``--overwrite`` replaces only what hf-symmetry wrote (never an
input, a folder holding or inside one, the current folder, or a folder with files of the user's); a full or
read-only disk, SIGTERM and SIGHUP end in one line with OUT as it was; what a killed run left is removed by the next
command; a second writer of the same OUT is refused while the first runs; an interrupted verification says OUT was
written. Every refusal is checked with the input hashed file by file before and after."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hf_symmetry import checkpoint_io
from hf_symmetry.checkpoint_io import MANIFEST, atomic_output_dir, output_lock
from hf_symmetry.cli import main
from hf_symmetry.commands import rotate
from hf_symmetry.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--no-verify", "--quiet"]
COMPRESS = ["--structure", "lowrank", "--stage", "none", "--ratio", "0.5"]


def _hashes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones and those in sub-folders included) with its sha256."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _model(folder: Path, seed: int = 0) -> Path:
    tiny_model("llama", dtype=torch.float32, seed=seed).save_pretrained(folder)
    return folder


def _refused(capsys, argv: list[str], *words: str) -> str:
    """Run the command line; it must exit with 2 and say one error line holding ``words`` (after a command's own
    warnings, if any: compress warns about lowrank on a tiny model), no traceback."""
    capsys.readouterr()  # (what came before: save_pretrained's progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if ": error: " in line]
    assert len(errors) == 1 and errors == err[-1:] and all(w in err[-1] for w in words), err
    assert all(line.startswith("hf-symmetry") for line in err), err
    return err[-1]


@pytest.mark.parametrize("command", [["rotate"], ["compress", *COMPRESS], ["to-tpa"]])
def test_out_that_is_the_input_is_refused_and_the_input_survives(tmp_path, capsys, command):
    m = _model(tmp_path / "m")
    before = _hashes(m)
    _refused(capsys, [*command[:1], str(m), str(m), *command[1:], "--overwrite", *QUIET], "is the input")
    link = tmp_path / "link"
    link.symlink_to(m)  # the same folder by another name, and by a relative path
    _refused(capsys, [*command[:1], str(m), str(link), *command[1:], "--overwrite", *QUIET], "is the input")
    _refused(capsys, [*command[:1], str(m), f"{tmp_path}/x/../m", *command[1:], "--overwrite", *QUIET], "is the input")
    assert _hashes(m) == before and sorted(p.name for p in tmp_path.iterdir()) == ["link", "m"]


def test_out_that_contains_the_input_or_lies_inside_it_is_refused(tmp_path, capsys):
    proj = tmp_path / "proj"
    base = _model(proj / "base")
    before = _hashes(proj)
    _refused(capsys, ["to-tpa", str(base), str(proj), "--overwrite", *QUIET], "contains the input")
    _refused(capsys, ["rotate", str(base), str(base / "rotated"), *QUIET], "lies inside the input")
    assert _hashes(proj) == before and not (base / "rotated").exists()


def test_an_out_that_is_a_symbolic_link_is_refused(tmp_path, capsys):
    """A dangling link, or one to a folder that holds the input or to another folder (the swap would replace the
    link itself): one line, and the link and its target keep their bytes (a NotADirectoryError traceback before)."""
    m = _model(tmp_path / "m")
    before = _hashes(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    _refused(capsys, ["rotate", str(m), str(tmp_path / "dangling"), "--overwrite", *QUIET], "is a symbolic link")
    (tmp_path / "up").symlink_to(tmp_path)
    _refused(capsys, ["to-tpa", str(m), str(tmp_path / "up"), "--overwrite", *QUIET], "contains the input")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "there").symlink_to(tmp_path / "elsewhere")
    _refused(capsys, ["rotate", str(m), str(tmp_path / "there"), *QUIET], "is a symbolic link (to ")
    _refused(capsys, ["export-gguf", str(m), str(tmp_path / "dangling"), "--overwrite", "--quiet"], "symbolic link")
    assert _hashes(tmp_path) == before and not any((tmp_path / "elsewhere").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "elsewhere", "m", "there", "up"]


def test_every_writer_checks_its_out_against_every_input(tmp_path, capsys):
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b", seed=1)
    before = {**_hashes(a), **{f"b/{k}": v for k, v in _hashes(b).items()}}
    _refused(capsys, ["merge", "--method", "average", str(a), str(b), str(b), "--overwrite", *QUIET], "is the input")
    _refused(capsys, ["match", str(a), str(b), str(a), "--overwrite", *QUIET], "is the input")
    _refused(capsys, ["farr", str(a), str(a), "--tau", "0.9", "--vo", "--overwrite", *QUIET], "is the input")
    _refused(capsys, ["spectra", str(a), str(a / "spectra"), "--quiet"], "lies inside the input")
    assert {**_hashes(a), **{f"b/{k}": v for k, v in _hashes(b).items()}} == before


def test_the_current_folder_and_its_ancestors_are_refused(tmp_path, capsys, monkeypatch):
    _model(tmp_path / "m")
    scratch = tmp_path / "scratch" / "work"
    (scratch / ".git").mkdir(parents=True)
    (scratch / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (scratch / "notes.txt").write_text("my notes\n")
    before = _hashes(tmp_path)
    monkeypatch.chdir(scratch)
    _refused(capsys, ["rotate", "../../m", ".", "--overwrite", *QUIET], "is the current folder")
    _refused(capsys, ["rotate", "../../m", "..", "--overwrite", *QUIET], "above the current one")
    assert _hashes(tmp_path) == before


def test_overwrite_refuses_a_folder_with_files_hf_symmetry_did_not_write(tmp_path, capsys):
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    assert main(["rotate", str(m), str(out), *QUIET]) == 0
    (out / "notes.txt").write_text("my notes\n")  # a file of the user's in a folder hf-symmetry wrote
    before = _hashes(out)
    _refused(capsys, ["rotate", str(m), str(out), "--overwrite", *QUIET], "'notes.txt'", "did not write")
    repo = tmp_path / "repo"  # an HF model folder in a git checkout
    _model(repo)
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    _refused(capsys, ["rotate", str(m), str(repo), "--overwrite", *QUIET], "'.git'")
    assert _hashes(out) == before and (repo / ".git" / "HEAD").is_file()


def test_overwrite_replaces_what_hf_symmetry_wrote_and_an_hf_model_folder(tmp_path, capsys):
    """The negative controls: these are replaced (the manifest lists what was written, byte-deterministic)."""
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    assert main(["rotate", str(m), str(out), "--seed", "1", *QUIET]) == 0
    first = _hashes(out)
    listed = (out / MANIFEST).read_text().splitlines()
    assert listed == sorted(p for p in first if p != MANIFEST) and "model.safetensors" in listed
    assert main(["rotate", str(m), str(out), "--seed", "2", "--overwrite", *QUIET]) == 0
    second = _hashes(out)
    assert second["model.safetensors"] != first["model.safetensors"] and second[MANIFEST] == first[MANIFEST]
    hf = _model(tmp_path / "hf", seed=3)  # a plain HF model folder (no manifest) named as OUT
    old = _hashes(hf)
    assert main(["rotate", str(m), str(hf), "--overwrite", *QUIET]) == 0
    assert _hashes(hf)["model.safetensors"] != old["model.safetensors"] and (hf / MANIFEST).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial, old or lock left


def test_export_gguf_replaces_only_a_gguf_file(tmp_path, capsys):
    m = _model(tmp_path / "m")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    _refused(capsys, ["export-gguf", str(m), str(notes), "--overwrite", "--quiet"], "not a .gguf file")
    assert notes.read_text() == "my notes\n"
    named = tmp_path / "named.gguf"  # a name is not a format: the user's file keeps its bytes
    named.write_text("my notes\n")
    _refused(capsys, ["export-gguf", str(m), str(named), "--overwrite", "--quiet"], "not a .gguf file")
    assert named.read_text() == "my notes\n"


def test_a_bad_max_shard_size_names_the_flag_and_the_forms(tmp_path, capsys):
    m = _model(tmp_path / "m")
    _refused(capsys, ["rotate", str(m), str(tmp_path / "o"), "--max-shard-size", "banana", *QUIET], "2GB", "500MB")
    _refused(capsys, ["rotate", str(m), str(tmp_path / "o"), "--max-shard-size", "0", *QUIET], "must be positive")
    assert checkpoint_io.parse_size("1.5GB") == 1_500_000_000 and checkpoint_io.parse_size("64kb") == 64_000
    assert not (tmp_path / "o").exists()


def test_too_little_free_space_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    m = _model(tmp_path / "m")
    need = sum(p.stat().st_size for p in m.glob("*.safetensors"))
    real = checkpoint_io.shutil.disk_usage
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    _refused(capsys, ["rotate", str(m), str(tmp_path / "o"), *QUIET], "not enough free space", "GB free")
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    monkeypatch.setattr(checkpoint_io.os, "access", lambda p, mode: False)  # a read-only disk (root writes 0o555)
    _refused(capsys, ["rotate", str(m), str(tmp_path / "o"), *QUIET], "read-only or not writable")
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    assert main(["rotate", str(m), str(tmp_path / "o"), *QUIET]) == 0  # the control: exactly enough


@pytest.mark.parametrize(("code", "words"), [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only")])
def test_a_full_or_read_only_disk_gives_one_line_and_keeps_out(tmp_path, capsys, monkeypatch, code, words):
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    assert main(["rotate", str(m), str(out), *QUIET]) == 0
    before = _hashes(out)
    real_add = checkpoint_io.ShardedWriter.add

    def add(self, tensors):  # the disk refuses once some bytes were written
        real_add(self, tensors)
        raise OSError(code, os.strerror(code), str(self.folder / "shard-00000.tmp"))

    monkeypatch.setattr(checkpoint_io.ShardedWriter, "add", add)
    line = _refused(capsys, ["rotate", str(m), str(out), "--overwrite", *QUIET], words, "shard-00000.tmp")
    assert "Traceback" not in line and _hashes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]  # the partial folder was removed


def test_a_failed_swap_puts_the_previous_out_back(tmp_path, monkeypatch):
    """The rename dance: when the new folder cannot take OUT's place, the previous OUT is put back (no
    ``.OUT.old-*`` left)."""
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("first\n")
    real = os.replace
    calls = []

    def replace(src, dst):
        calls.append(Path(src).name)
        if Path(src).name.startswith(".out.partial-"):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        real(src, dst)

    monkeypatch.setattr(checkpoint_io.os, "replace", replace)
    with pytest.raises(OSError, match="not empty"), atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("second\n")
    assert calls[0] == "out" and (out / "a.txt").read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_DRIVER = textwrap.dedent(
    """
    import pathlib, sys, time
    from hf_symmetry import checkpoint_io, cli
    add = checkpoint_io.ShardedWriter.add
    def slow(self, tensors):  # the first tensors written, then a long pause: the run is mid-write
        add(self, tensors)
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(120)
    checkpoint_io.ShardedWriter.add = slow
    sys.exit(cli.main(sys.argv[2:]))
    """
)


def _start_writer(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    """The real command line in a child process, paused in the middle of writing OUT (its first tensors
    written into the partial folder); returns once it is there."""
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(ready), *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the child never started writing"
        time.sleep(0.1)
    return proc, ready


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_like_ctrl_c(tmp_path, sig):
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    assert main(["rotate", str(m), str(out), *QUIET]) == 0
    before = _hashes(out)
    proc, ready = _start_writer(tmp_path, ["rotate", str(m), str(out), "--seed", "5", "--overwrite", *QUIET])
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]  # mid-run: the partial folder
    assert (tmp_path / ".out.lock").is_file()
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1].strip().splitlines()
    assert proc.returncode == 128 + sig and err == [f"hf-symmetry: stopped by {signal.Signals(sig).name}"]
    assert _hashes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", "out", ready.name])  # nothing left behind


def test_a_second_writer_is_refused_while_the_first_runs(tmp_path, capsys):
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    proc, _ = _start_writer(tmp_path, ["rotate", str(m), str(out), *QUIET])
    try:
        line = _refused(capsys, ["rotate", str(m), str(out), "--overwrite", *QUIET], "another hf-symmetry run")
        assert f"(pid {proc.pid})" in line and not out.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert main(["rotate", str(m), str(out), *QUIET]) == 0  # the control: once it is gone, OUT can be written
    capsys.readouterr()


def test_sigkill_leftovers_are_removed_by_the_next_command(tmp_path, capsys):
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    proc, ready = _start_writer(tmp_path, ["rotate", str(m), str(out), *QUIET])
    proc.kill()
    proc.communicate(timeout=60)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))
    assert len(left) == 2 and left[0] == ".out.lock" and left[1].startswith(f".out.partial-{proc.pid}-")
    keep = tmp_path / f".other.partial-{os.getpid()}-x"  # a live process's: never touched
    keep.mkdir()
    assert main(["rotate", str(m), str(tmp_path / "other"), *QUIET]) == 0  # another command, same parent folder
    err = capsys.readouterr().err
    assert f"removed {left[1]}" in err and f"(pid {proc.pid})" in err and "removed .out.lock" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", "other", keep.name, ready.name])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_swap_and_killed_asset_builds_are_cleaned_at_any_command_start(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    monkeypatch.setenv("HF_SYMMETRY_CACHE", str(cache))
    dead = _dead_pid()
    build = cache / "models" / f".build-{dead}-abc"
    (build / "sub").mkdir(parents=True)
    (build / "sub" / "model.safetensors").write_bytes(b"x" * 1000)
    pkg = cache / f".pkg-{dead}-abc"
    pkg.mkdir()
    live = cache / "models" / f".build-{os.getpid()}-abc"
    live.mkdir()
    no_pid = cache / "models" / ".build-abc"  # an older build's name: not ours to judge
    no_pid.mkdir()
    work = tmp_path / "work"
    old = work / f".out.old-{dead}"  # killed between moving OUT aside and moving the new one in
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}\n")
    assert main(["families"]) == 0  # a command that writes nothing
    err = capsys.readouterr().err
    assert f"removed .build-{dead}-abc" in err and f"removed .pkg-{dead}-abc" in err
    assert not build.exists() and not pkg.exists() and live.is_dir() and no_pid.is_dir()
    stale = work / f".merged.partial-{dead}-abc"
    stale.mkdir()
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b", seed=1)
    capsys.readouterr()
    # a command refused (OUT, put back, is not empty) still cleans up first; merge's OUT is its last argument
    assert main(["merge", "--method", "average", str(a), str(b), str(work / "out"), *QUIET]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "is not empty" in err[2]
    assert {err[0].split(" ")[1], err[1].split(" ")[1]} == {"put", "removed"} and stale.name in " ".join(err)
    assert (work / "out" / "config.json").read_text() == "{}\n" and not old.exists() and not stale.exists()


def test_an_interrupted_verification_says_out_was_written(tmp_path, capsys, monkeypatch):
    def interrupted(self, report, lines):
        raise KeyboardInterrupt

    monkeypatch.setattr(rotate.Rotate, "verify", interrupted)
    m = _model(tmp_path / "m")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["rotate", str(m), str(out), *QUIET]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"hf-symmetry: {out} was written and is complete; the verification was interrupted, so its card lacks the "
        "verification figures",
        "hf-symmetry: interrupted",
    ]
    assert (out / "model.safetensors").is_file() and (out / MANIFEST).is_file()
    assert not (tmp_path / ".out.lock").exists()


def test_the_lock_is_taken_over_from_a_dead_process_and_nests(tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    lock.write_text(f"{_dead_pid()}\n")  # left by a killed run: nobody holds it
    with output_lock(out), output_lock(out):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()
