"""Every command against a table of bad inputs (issue #45): each one exits with status 2, prints exactly one line on
stderr (the table lists a distinctive fragment of it), and changes nothing: every input file keeps its bytes, and
OUT (and a ``--json`` file) that did not exist still does not. Plus property tests of the flag parsing
(hypothesis): any string given to ``--max-shard-size``, ``--ratio``, ``--tokens`` or ``--device`` is either
accepted or refused in one line with status 2, never a traceback.

The commands run in-process (:func:`hf_symmetry.cli.main`) on tiny models with a word-level tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_symmetry.cli import main

WORDS = " ".join(str(i % 97) for i in range(3000))


def _tiny(folder: Path, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_symmetry.testing import tiny_model

    tiny_model("llama", dtype=torch.float32, seed=seed).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    return folder


def _variant(root: Path, name: str, edit) -> None:
    shutil.copytree(root / "tiny", root / name)
    edit(root / name)


def _set_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _pickle_only(folder):
    (folder / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The inputs every case reads: good and bad model folders, good and bad texts, a plain file."""
    root = tmp_path_factory.mktemp("bad_inputs")
    _tiny(root / "tiny")
    _tiny(root / "other", seed=1)
    _variant(root, "badjson", lambda f: (f / "config.json").write_text('{"model_type": "llama",'))
    _variant(root, "array", lambda f: (f / "config.json").write_text("[1, 2]"))
    _variant(root, "mismatch", _set_config(hidden_size=60))  # 6 heads of 10: a valid config, the wrong shapes
    _variant(root, "refused", _set_config(hidden_size=64))  # 64 is no multiple of 6 heads: transformers refuses
    _variant(root, "pickle", _pickle_only)
    _variant(root, "noweights", lambda f: (f / "model.safetensors").unlink())
    _variant(root, "truncated", lambda f: os.truncate(f / "model.safetensors", 5000))  # a whole header, cut data
    _variant(root, "fewlayers", _set_config(num_hidden_layers=1))  # the weights hold 2 layers
    _variant(root, "badtokenizer", lambda f: (f / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}'))
    (root / "good.txt").write_text(WORDS)
    (root / "empty.txt").write_text("  \n")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (root / "latin1.txt").write_bytes(("caf\xe9 " * 500).encode("latin-1"))
    (root / "one.txt").write_text("5")
    (root / "short.txt").write_text(" ".join(["7"] * 100))
    (root / "afile").write_text("not a folder")
    (root / "recipe.yaml").write_text("method: average\nmodels: [{model: nope}, {model: nope2}]\n")
    return root


T, OUT, G = "{root}/tiny", "{root}/out", "{root}/good.txt"
VERIFY = ["--text", G, "--tokens", "16", "--ppl-tokens", "32"]
MERGE = ["merge", "--method", "average", T, "{root}/other", OUT]
#: (command, arguments, a fragment of the one stderr line)
CASES = [
    # a model that is not there, or not a model folder
    ("rotate", ["{root}/nope", OUT], "does not exist"),
    ("rotate", ["{root}/afile", OUT], "is a file, not a model folder"),
    ("rotate", ["{root}/badjson", OUT], "config.json is not valid JSON: Expecting"),
    ("rotate", ["{root}/array", OUT], "config.json holds a JSON list, not an object"),
    ("rotate", ["{root}/mismatch", OUT], "has shape [97, 48] in the weights but config.json (hidden_size 60)"),
    ("rotate", ["{root}/refused", OUT], "is not a multiple of the number of attention heads"),
    ("rotate", ["{root}/pickle", OUT], "holds only pickle weights (pytorch_model.bin); hf-symmetry reads safetensors"),
    ("rotate", ["{root}/noweights", OUT], "holds no weights"),
    ("rotate", ["{root}/fewlayers", OUT], "the weights hold 2 decoder layers (indices 0..1) but config.json has"),
    # flags
    ("rotate", [T, OUT, "--device", "banana"], "unknown device 'banana'"),
    ("rotate", ["{root}/badtokenizer", OUT, *VERIFY], "the tokenizer of {root}/badtokenizer does not load"),
    ("rotate", [T, OUT, "--tokens", "-3"], "--tokens must be at least 2"),
    ("rotate", [T, OUT, "--ppl-tokens", "1"], "--ppl-tokens 0 or at least 2"),
    ("rotate", [T, OUT, "--tokens", "many"], "argument --tokens: invalid int value"),
    ("rotate", [T, OUT, "--residual", "sideways"], "argument --residual: invalid choice"),
    ("rotate", [T, OUT, "--max-shard-size", "banana", "--no-verify"], "banana"),
    ("rotate", [T, OUT, "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("rotate", [], "the following arguments are required: out"),
    # texts
    ("rotate", [T, OUT, "--text", "{root}/missing.txt"], "missing.txt' not found"),
    ("rotate", [T, OUT, "--text", "{root}/empty.txt"], "empty.txt is empty"),
    ("rotate", [T, OUT, "--text", "{root}/binary.txt"], "binary.txt is binary (a NUL byte at offset 0)"),
    ("rotate", [T, OUT, "--text", "{root}/latin1.txt"], "latin1.txt is not UTF-8 (byte 0xe9 at offset 3)"),
    ("rotate", [T, OUT, "--text", "{root}/one.txt"], "one.txt has 1 token: --tokens needs at least 2"),
    ("rotate", [T, OUT, "--text", "{root}/short.txt", "--tokens", "300", "--ppl-tokens", "0"], "fewer than the 300"),
    # output files
    ("rotate", [T, OUT, "--json", "{root}/tiny"], "--json {root}/tiny is a folder"),
    ("rotate", [T, OUT, "--json", "{root}/nodir/s.json"], "its folder {root}/nodir does not exist"),
    ("verify", [T, T, "--json", "{root}/tiny", *VERIFY], "--json {root}/tiny is a folder"),
    # verify
    ("verify", [T, "{root}/nope", *VERIFY], "does not exist"),
    ("verify", ["{root}/pickle", T, *VERIFY], "holds only pickle weights"),
    ("verify", [T, "{root}/pickle", *VERIFY], "holds only pickle weights"),
    ("verify", [T, "{root}/mismatch", *VERIFY], "has shape [97, 48] in the weights"),
    ("verify", [T, "{root}/truncated", *VERIFY], "model.safetensors: the file is truncated (5000 bytes, its header"),
    ("verify", [T, "{root}/array", *VERIFY], "holds a JSON list"),
    ("verify", [T, "default", *VERIFY], "{root}/tiny has vocab_size 97 but default has 49152: verify compares"),
    ("verify", [T, T, *VERIFY, "--tolerance", "nan"], "--tolerance must be a finite number >= 0; got nan"),
    ("verify", [T, T, *VERIFY, "--tolerance", "-1"], "--tolerance must be a finite number >= 0"),
    ("verify", [T, T, "--text", "{root}/latin1.txt"], "is not UTF-8"),
    ("verify", [T, T, "--text", "{root}/short.txt", "--ppl-tokens", "200"], "fewer than the 200 that --ppl-tokens"),
    ("verify", [T, T, "--text", "{root}/one.txt"], "has 1 token: --tokens needs at least 2"),
    ("verify", [T, T, *VERIFY, "--device", "tpu"], "unknown device 'tpu'"),
    # eval
    ("eval", ["{root}/pickle", "--text", G], "holds only pickle weights"),
    ("eval", [T, "--text", "{root}/one.txt"], "has 1 token: --max-tokens needs at least 2"),
    ("eval", [T, "--text", "{root}/short.txt", "--max-tokens", "300"], "fewer than the 300 that --max-tokens"),
    ("eval", [T, "--text", "{root}/binary.txt"], "is binary"),
    ("eval", [T, "--text", G, "--max-tokens", "-5"], "--max-tokens must be 0 (the whole text) or at least 2"),
    ("eval", [T, "--text", G, "--max-tokens", "1"], "--max-tokens must be 0 (the whole text) or at least 2; got 1"),
    ("eval", [T, "--text", G, "--json", "{root}/nodir/e.json"], "does not exist"),
    ("eval", [T, "--task-dir", "{root}/nope", "--text", G], "task folder {root}/nope does not exist"),
    ("eval", [T, "--text", G, "--window", "0"], "need 0 < --stride <= --window and --window >= 2; got 256 and 0"),
    ("eval", [T, "--text", G, "--stride", "-4"], "got -4 and 512"),
    # to-tpa
    ("to-tpa", [T, OUT, "--k-rank", "0"], "--k-rank must be positive"),
    ("to-tpa", ["{root}/badjson", OUT], "is not valid JSON"),
    ("to-tpa", [T, OUT, "--k-rank", "1", "--calib", "{root}/latin1.txt"], "--calib: text file"),
    ("to-tpa", [T, OUT, "--k-rank", "1", "--calib", "{root}/short.txt", "--calib-tokens", "101"], "fewer than the 101"),
    # match
    ("match", ["{root}/pickle", T, OUT], "holds only pickle weights"),
    ("match", [T, "{root}/mismatch", OUT], "has shape"),
    ("match", [T, "{root}/other", OUT, "--max-shard-size", "banana", "--no-verify"], "banana"),
    # merge
    ("merge", [*MERGE[1:4], "{root}/pickle", OUT], "holds only pickle weights"),
    ("merge", ["--method", "soup", T, "{root}/other", OUT], "argument --method: invalid choice: 'soup'"),
    ("merge", ["{root}/recipe.yaml", OUT, "--no-verify"], "does not exist"),
    ("merge", [*MERGE[1:], "--calib-text", "{root}/empty.txt"], "--calib-text: text file"),
    # spectra
    ("spectra", ["{root}/array", OUT], "holds a JSON list"),
    ("spectra", [T, OUT, "--calibrate", "{root}/binary.txt"], "--calibrate: text file"),
    ("spectra", [T, OUT, "--tau", "0"], "τ"),
    # farr
    ("farr", [T, OUT], "one of the arguments --tau --params-fraction is required"),
    ("farr", ["{root}/pickle", OUT, "--tau", "0.9"], "holds only pickle weights"),
    ("farr", [T, OUT, "--tau", "0.9", "--calibrate", "{root}/one.txt", *VERIFY], "--calib-tokens needs at least 2"),
    ("compress", [T, OUT, "--calib", "{root}/short.txt", "--calib-tokens", "512"], "fewer than the 512 that --calib"),
    # compress
    ("compress", [T, OUT, "--ratio", "3"], "ratio must be in (0, 1)"),
    ("compress", [T, OUT, "--ratio", "banana"], "argument --ratio: invalid float value"),
    ("compress", [T, OUT, "--structure", "triangle"], "argument --structure: invalid choice: 'triangle'"),
    ("compress", ["{root}/mismatch", OUT], "has shape"),
    ("compress", [T, OUT, "--calib", "{root}/latin1.txt"], "is not UTF-8"),
    # export-gguf
    ("export-gguf", [T, "{root}/out.gguf", "--type", "q9_9"], "argument --type: invalid choice"),
    ("export-gguf", ["{root}/pickle", "{root}/out.gguf"], "holds only pickle weights"),
    ("export-gguf", [T, OUT], "the output is one file ending in .gguf"),
    ("export-gguf", [T, "{root}/out.gguf", "--json-out", "{root}/tiny"], "--json-out {root}/tiny is a folder"),
    # heal
    ("heal", ["{root}/pickle", OUT, "--teacher", T, "--text", G], "holds only pickle weights"),
    ("heal", [T, OUT, "--teacher", "{root}/nope", "--text", G], "does not exist"),
    ("heal", [T, OUT, "--teacher", T, "--text", "{root}/empty.txt"], "is empty"),
    ("heal", [T, OUT, "--teacher", T], "the following arguments are required: --text"),
    # push
    ("push", ["{root}/pickle", "user/x"], "holds only pickle weights"),
    ("push", ["{root}/nope", "user/x"], "does not exist"),
    ("push", [T, "no-namespace"], "repo id must be 'user/name'"),
    ("push", [T, "user/x", "--json", "{root}/tiny"], "is a folder"),
    # families
    ("families", ["--config", "{root}/badjson/config.json"], "is not valid JSON"),
    ("families", ["--config", "{root}/array/config.json"], "not an object"),
    ("families", ["--model-type", "no_such_family"], "no_such_family"),
]


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """``hf-symmetry argv`` in-process: its exit status (argparse's ``SystemExit`` included) and its stderr lines."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(("command", "args", "fragment"), CASES, ids=[f"{c}-{i}" for i, (c, *_) in enumerate(CASES)])
def test_bad_input_one_line_exit_2_nothing_written(command, args, fragment, root, capsys):
    before = digests(root)
    argv = [command, *(a.format(root=root) for a in args)]
    if command not in ("families", "push") and "--quiet" not in argv:
        argv.append("--quiet")
    code, err = run_cli(argv, capsys)
    assert code == 2, (argv, err)
    assert len(err) == 1, err
    assert fragment.format(root=root) in err[0], err[0]
    assert err[0].startswith((f"hf-symmetry {command}: error: ", "hf-symmetry: error: ")), err[0]
    assert digests(root) == before  # no input changed, no OUT, no --json file, no partial folder
    assert not [p for p in root.iterdir() if p.name.startswith(("out", ".out", "nodir"))]


def test_a_short_text_at_the_default_token_counts_is_taken_whole(root, capsys, tmp_path):
    """A flag left at its default takes what the text has (100 tokens < --ppl-tokens' 2048): only a count given on
    the command line asks for that many. The defaults the checks know are the parsers'."""
    from hf_symmetry.cli import build_parser
    from hf_symmetry.commands.inputs import CALIB_TOKENS_DEFAULT

    code, err = run_cli(["verify", str(root / "tiny"), str(root / "tiny"), "--text", str(root / "short.txt")], capsys)
    assert code == 0, err
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert {c: sub[c].get_default("calib_tokens") for c in CALIB_TOKENS_DEFAULT} == CALIB_TOKENS_DEFAULT


def test_an_alias_that_is_also_a_folder_here_is_refused(root, capsys, tmp_path, monkeypatch):
    """``smollm2`` in a directory holding a model folder of that name: one line, exit 2, nothing written (the
    embedded model is not silently taken for the user's folder); ``./smollm2`` is the folder (the control)."""
    shutil.copytree(root / "tiny", tmp_path / "smollm2")
    monkeypatch.chdir(tmp_path)
    before = digests(tmp_path)
    code, err = run_cli(["rotate", "smollm2", "out", "--no-verify", "--quiet"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "smollm2 is both an embedded model and a model folder here: write ./smollm2" in err[0]
    assert digests(tmp_path) == before and not (tmp_path / "out").exists()
    code, err = run_cli(["rotate", "./smollm2", "out", "--no-verify", "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 97  # the folder, not SmolLM2


def test_the_checks_see_a_good_input(root, capsys, tmp_path):
    """The control: the same folder and text the table spoils convert, and the run writes OUT and its JSON."""
    out, summary = tmp_path / "out", tmp_path / "s.json"
    code, err = run_cli(["rotate", str(root / "tiny"), str(out), *[a.format(root=root) for a in VERIFY],
                         "--json", str(summary), "--quiet"], capsys)  # fmt: skip
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and json.loads(summary.read_text())["verification"]


# ------------------------------------------------------------------------------------------------ properties
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
PROPERTY = settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
NOT_EMPTY = "exists and is not empty"


def one_line(argv, capsys) -> str:
    """The one stderr line of a refused ``hf-symmetry argv`` (status 2, never a traceback)."""
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"hf-symmetry {argv[0]}: error: "), (argv, code, err)
    return err[0]


def _full_out(root: Path) -> Path:
    """An OUT that exists and is not empty: a run whose flags are all good stops at the output check."""
    full = root / "full"
    full.mkdir(exist_ok=True)
    (full / "keep").write_text("x")
    return full


@PROPERTY
@given(value=st.one_of(TEXT, st.from_regex(r"\A[0-9]{1,4}(\.[0-9])?\s?[kKmMgG]?[bB]?\Z")))
def test_max_shard_size_any_string_one_line(value, root, capsys):
    """A size :func:`~hf_symmetry.checkpoint_io.parse_size` reads gets as far as the output check; any other is
    refused in one line naming the flag. Nothing is ever written."""
    from hf_symmetry.checkpoint_io import parse_size

    try:
        parses = parse_size(value) > 0
    except ValueError:
        parses = False
    full = _full_out(root)
    line = one_line(["rotate", str(root / "tiny"), str(full), f"--max-shard-size={value}", "--no-verify"], capsys)
    assert (NOT_EMPTY in line) == parses, line
    assert (not parses) == ("--max-shard-size" in line), line
    assert sorted(p.name for p in full.iterdir()) == ["keep"]


def _parses(kind, value) -> bool:
    try:
        kind(value)
        return True
    except ValueError:
        return False


@PROPERTY
@given(value=st.one_of(TEXT, st.floats(allow_nan=True, allow_infinity=True).map(str)))
def test_ratio_any_string_one_line(value, root, capsys):
    """``--ratio``: a string that is no number is refused while parsing, in one line; a number gets as far as the
    (deliberately) missing model."""
    line = one_line(["compress", str(root / "nope"), str(root / "out"), f"--ratio={value}", "--no-verify"], capsys)
    assert ("invalid float value" in line) != _parses(float, value), line
    assert not (root / "out").exists()


@PROPERTY
@given(value=st.one_of(TEXT, st.integers(-10, 10**6).map(str)))
def test_tokens_any_string_one_line(value, root, capsys):
    """``--tokens``: not an integer is refused while parsing; an integer gets as far as the missing model."""
    line = one_line(["verify", str(root / "tiny"), str(root / "nope"), f"--tokens={value}"], capsys)
    assert ("invalid int value" in line) != _parses(int, value), line
    assert ("does not exist" in line) == _parses(int, value), line


@PROPERTY
@given(value=st.one_of(TEXT, st.sampled_from(["cpu", "auto", "cuda", "cuda:0", "cuda:-1", "mps", "CPU", "cuda:x"])))
def test_device_any_string_one_line(value, root, capsys):
    """``--device``: read by :func:`~hf_symmetry.devices.parse_device` alone; a string it refuses is refused in one
    line, one it reads gets as far as the output check."""
    from hf_symmetry.devices import parse_device

    try:
        parse_device(value)
        usable = True
    except ValueError:
        usable = False
    full = _full_out(root)
    line = one_line(["rotate", str(root / "tiny"), str(full), f"--device={value}", "--no-verify"], capsys)
    assert (NOT_EMPTY in line) == usable, line
    assert sorted(p.name for p in full.iterdir()) == ["keep"]


# ------------------------------------------------------------------------------------------------ exit codes
@pytest.fixture(scope="module")
def nan_model(root):
    """The tiny Llama with one NaN weight: every logit it produces is NaN."""
    from safetensors.torch import load_file, save_file

    folder = root.parent / "nan_model"
    shutil.copytree(root / "tiny", folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_verify_fails_on_nan_whatever_the_tolerance(root, nan_model, capsys):
    args = [*(a.format(root=root) for a in VERIFY), "--quiet"]
    code, err = run_cli(["verify", str(root / "tiny"), str(nan_model), *args, "--tolerance", "1e-3"], capsys)
    assert code == 1, err  # NaN > 1e-3 is False: the old comparison passed this checkpoint
    code, err = run_cli(["verify", str(root / "tiny"), str(nan_model), *args], capsys)
    assert code == 1  # no tolerance asked for: a NaN figure still fails
    code, err = run_cli(["verify", str(root / "tiny"), str(root / "tiny"), *args, "--tolerance", "1e-3"], capsys)
    assert code == 0, err  # the control: the same model passes


def test_verify_prints_which_figure_is_not_finite(root, nan_model, capsys):
    args = [*(a.format(root=root) for a in VERIFY), "--quiet", "--tolerance", "1e-3"]
    capsys.readouterr()
    assert main(["verify", str(root / "tiny"), str(nan_model), *args]) == 1
    assert "FAILED: max |Δlogit| is nan" in capsys.readouterr().out


def test_a_conversion_whose_verification_is_nan_exits_1_and_keeps_out(root, nan_model, capsys, tmp_path):
    out = tmp_path / "out"
    args = [*(a.format(root=root) for a in VERIFY), "--quiet"]
    code, err = run_cli(["rotate", str(nan_model), str(out), *args], capsys)
    assert code == 1, err
    assert err == [f"hf-symmetry rotate: error: {out} was written but failed verification: max |Δlogit| is nan, "
                   "the original's perplexity is nan, the converted model's perplexity is nan"]  # fmt: skip
    assert (out / "model.safetensors").is_file()  # OUT stays, for the user to look at


def test_eval_fails_on_a_nan_perplexity(root, nan_model, capsys):
    code, err = run_cli(
        ["eval", str(nan_model), "--text", str(root / "good.txt"), "--max-tokens", "64", "--quiet"], capsys
    )
    assert code == 1, err
    code, err = run_cli(["eval", str(root / "tiny"), "--text", str(root / "good.txt"), "--max-tokens", "64"], capsys)
    assert code == 0, err


def test_a_merge_whose_perplexity_is_nan_exits_1_and_keeps_out(root, nan_model, capsys, tmp_path):
    out = tmp_path / "merged"
    argv = ["merge", "--method", "average", str(root / "tiny"), str(nan_model), str(out), "--quiet"]
    code, err = run_cli([*argv, "--text", str(root / "good.txt"), "--ppl-tokens", "32"], capsys)
    assert code == 1 and err == [f"hf-symmetry merge: error: {out} was written but failed verification: its "
                                 "perplexity is nan"], err  # fmt: skip
    assert (out / "model.safetensors").is_file()
