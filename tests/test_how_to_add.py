"""docs/internals.md's "How to add …" kept true: each addition it lists is made, in a copy of the package, by editing
only the files the list says it touches, and a fresh Python on that copy checks that everything the list says
derives from them does:

* a compression structure (a GS variant under a new name, sized by ``--gs-blocks``): ``STRUCTURE_TYPES``,
  ``compress --structure``'s choices, its sizing option among the settings a card lists, PEFT's LoRA targets, and a
  real ``compress`` whose output holds the new module (loaded with hf_symmetry and, through the remote code it
  ships, without it) and computes what the GS output computes;
* a merge method (a scaled average with a parameter of its own): ``merge --method``'s choices, the parameter's
  flag, the recipe's check of it, and a real ``merge`` whose weights are the scaled average;
* a source family (Ministral, a model type transformers has and hf_symmetry does not): ``families`` lists it and a
  tiny model of it (its ``testing.py`` entry) rotates exactly.

The unmodified package is the negative control: none of the three names is known to it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_symmetry
from hf_symmetry.architectures.spec import SUPPORTED_MODEL_TYPES
from hf_symmetry.conversion.merge.methods import MERGE_METHODS
from hf_symmetry.modeling.structured_linear import STRUCTURE_TYPES

PACKAGE = Path(hf_symmetry.__file__).parent
INTERNALS = PACKAGE.parent / "docs" / "internals.md"

#: the additions, each as (file, the line before which its text goes, the text, the registration edit)
STRUCTURE = {
    "solvers/structures.py": (
        r"^(#: .*\n)?CLASSES\b",
        '@dataclass(frozen=True)\nclass Toy(GS):\n    """GS under another name (tests/test_how_to_add.py)."""\n\n'
        '    kind = "toy"\n\n\n',
        (r"(CLASSES\b.*for cls in \([^)]*)\)", r"\1, Toy)"),
    ),
    "modeling/structured_linear.py": (
        r"^(#: .*\n)?STRUCTURE_TYPES\b",
        'class ToyLinear(GSLinear):\n    kind = "toy"\n\n\n',
        None,
    ),
}
MERGE_METHOD = {
    "conversion/merge/methods.py": (
        r"^MERGE_METHODS\b",
        "class Toy(MergeMethod):\n"
        '    """The weighted average times ``toy_scale`` (tests/test_how_to_add.py)."""\n\n'
        '    name = "toy"\n    title = "toy"\n    paper = "none"\n'
        '    parameters = (Parameter("toy_scale", float, 1.0, "toy: scale of the average (default 1)"),)\n\n'
        "    def parameter_error(self, params):\n"
        '        ok = params["toy_scale"] > 0\n'
        "        return None if ok else f\"toy_scale must be positive; got {params['toy_scale']}\"\n\n"
        "    def combine(self, models, base, entries, params, fishers):\n"
        '        return params["toy_scale"] * weighted_average(models, [e.weight for e in entries])\n\n\n',
        (r"(for m in \([^)]*)\)", r"\1, Toy)"),
    ),
}
FAMILY = {
    "architectures/spec.py": (
        r"^SPECS\b",
        'MINISTRAL = _llama_like("ministral", ("ministral",), window_attr="sliding_window")\n\n',
        (r"(SPECS\b[^=]*= \(\n)", r"\1    MINISTRAL,\n"),
    ),
    "testing.py": (
        r"^def tiny_config\b",
        "def _ministral(family: str, overrides: dict):\n"
        "    kw = dict(_COMMON, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=128)\n"
        "    return T.MinistralConfig(**{**kw, 'rope_parameters': dict(_ROPE), **overrides})\n\n\n"
        '_TINY_CONFIGS["ministral"] = _ministral\n\n\n',
        None,
    ),
}
ADDITIONS = {"a compression structure": STRUCTURE, "a merge method": MERGE_METHOD, "a source family": FAMILY}

CHECKS = r"""
import argparse, json, sys
from pathlib import Path
import torch
import hf_symmetry
from hf_symmetry import cli

assert Path(hf_symmetry.__file__).parent == Path(PACKAGE), hf_symmetry.__file__  # the edited copy, not the tree
out = {}
parser = cli.build_parser()
commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

def flag(command, name):
    return next((a for a in commands[command]._actions if name in a.option_strings), None)

def structure():
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from hf_symmetry.conversion.compress.options import CompressOptions
    from hf_symmetry.conversion.compress.routes import CALIBRATION
    from hf_symmetry.modeling.structured_linear import STRUCTURE_TYPES
    from hf_symmetry.testing import input_ids, run_without_hf_symmetry
    from hf_symmetry.training.peft_targets import lora_plan

    root = Path(WORK)
    outs = {}
    for kind in ("gs", "toy"):
        outs[kind] = root / kind
        argv = ["compress", str(TINY), str(outs[kind]), "--structure", kind, "--stage", "none", "--ratio", "0.5"]
        assert cli.main(argv + ["--gs-blocks", "2,2", "--keep-embeddings", "--no-verify", "--quiet"]) == 0
    toy = AutoModelForCausalLM.from_pretrained(outs["toy"]).eval()
    gs = AutoModelForCausalLM.from_pretrained(outs["gs"]).eval()
    ids = input_ids(toy.config.vocab_size, batch=1, length=12)
    with torch.no_grad():
        logits = toy(input_ids=ids).logits
        same = torch.equal(logits, gs(input_ids=ids).logits)
    plan = lora_plan(toy, 2)
    config = json.loads((outs["toy"] / "config.json").read_text())
    tensors = {kind: load_file(folder / "model.safetensors") for kind, folder in outs.items()}
    (root / "remote").mkdir()
    remote = run_without_hf_symmetry(
        "import torch\nfrom transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True).eval()\n"
        "with torch.no_grad():\n    y = m(input_ids=torch.tensor(IDS)).logits\n"
        "print(json.dumps({'classes': sorted({type(x).__name__ for x in m.modules()}), 'logits': y.tolist()}))\n",
        root / "remote", OUT=str(outs["toy"]), IDS=ids.tolist(),
    )
    return {
        "structure_types": list(STRUCTURE_TYPES),
        "choices": list(flag("compress", "--structure").choices),
        "settings": CompressOptions(structure="toy", gs_blocks=(2, 2)).applicable(CALIBRATION),
        "modules": sorted({type(m).__name__ for m in toy.modules()}),
        "types": sorted({e["type"] for layer in config["layer_structures"] for e in layer.values()}),
        "same_tensors": tensors["toy"].keys() == tensors["gs"].keys()
        and all(torch.equal(tensors["toy"][k], tensors["gs"][k]) for k in tensors["gs"]),
        "same_logits": same,
        "lora_parameters": [p for p in plan.target_parameters if p.endswith(("gs_left", "gs_right"))],
        "ships": "class ToyLinear" in (outs["toy"] / "structured_linear.py").read_text(),
        "remote_classes": remote["classes"],
        "remote_matches": torch.allclose(torch.tensor(remote["logits"]), logits, rtol=0, atol=1e-5),
    }

def merge_method():
    from safetensors.torch import load_file
    root = Path(WORK)
    flags = {name: flag("merge", name) is not None for name in ("--toy-scale",)}
    merged = {}
    for scale in ("0.5", "1"):
        merged[scale] = root / f"merged{scale}"
        argv = ["merge", "--method", "toy", "--toy-scale", scale, str(TINY), str(OTHER), str(merged[scale])]
        assert cli.main(argv + ["--no-verify", "--quiet"]) == 0
    try:
        refused = cli.main(["merge", "--method", "toy", "--toy-scale", "-1", str(TINY), str(OTHER), str(root / "no")])
    except SystemExit as e:
        refused = e.code
    a, b = load_file(Path(TINY) / "model.safetensors"), load_file(Path(OTHER) / "model.safetensors")
    half, one = load_file(merged["0.5"] / "model.safetensors"), load_file(merged["1"] / "model.safetensors")
    expected = {k: (0.5 * (a[k].double() + b[k].double()) / 2).float() for k in a}
    return {
        "choices": list(flag("merge", "--method").choices),
        "flags": flags,
        "scaled": all(torch.allclose(half[k], expected[k], rtol=1e-6, atol=0) for k in expected),
        "parameter_reaches_the_method": any(not torch.allclose(half[k], one[k]) for k in half),
        "refused": refused,
        "written_when_refused": (root / "no").exists(),
    }

def family():
    from hf_symmetry.architectures import capabilities
    from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
    from hf_symmetry.testing import input_ids, outputs, tiny_model
    from transformers.models.ministral import modeling_ministral

    def exact_rmsnorm(self, x):  # (transformers' RMSNorm computes in float32: keep float64, as tests/conftest.py)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    modeling_ministral.MinistralRMSNorm.forward = exact_rmsnorm
    model = tiny_model("ministral")
    options = RotateOptions(residual="hadamard", heads="random", ffn=True, seed=7)
    sd, config = rotate_state_dict(model.state_dict(), model.config, options)
    new = type(model)(type(model.config).from_dict(config)).to(torch.float64).eval()
    new.load_state_dict(sd, strict=True)
    ids = input_ids(model.config.vocab_size)
    before = model.state_dict()
    changed = [k for k, v in before.items() if k in sd and v.shape == sd[k].shape and not torch.allclose(v, sd[k])]
    return {
        "text": capabilities.families_text("ministral"),
        "markdown_row": any(line.startswith("| ministral |") for line in capabilities.families_markdown().splitlines()),
        "cli": cli.main(["families", "--model-type", "ministral"]),
        "max_delta": (outputs(model, ids) - outputs(new, ids)).abs().max().item(),
        "changed": len(changed),
        "tensors": len(sd),
    }

out = {"a compression structure": structure, "a merge method": merge_method, "a source family": family}[ADDITION]()
print(json.dumps(out))
"""


def touched(addition: str) -> list[str]:
    """The files docs/internals.md says ``addition`` touches: the backticked paths between "touches" and the colon
    that ends the bullet's first clause."""
    section = INTERNALS.read_text().split("## How to add", 1)[1].split("\n## ", 1)[0]
    bullet = re.search(rf"^- \*\*{re.escape(addition)}\*\*(.*?)(?=^- |\Z)", section, re.M | re.S)
    assert bullet, f"docs/internals.md's How to add has no bullet for {addition!r}"
    clause = re.search(r"touches (.*?):\s", bullet.group(1), re.S)
    assert clause, f"the bullet for {addition!r} does not say which files it touches ('touches `a`, `b`: ...')"
    return re.findall(r"`([^`]+\.py)`", clause.group(1))


def add(root: Path, edits: dict) -> None:
    """Make an addition in the package copy at ``root``: each file's text inserted before its anchor line, and its
    registration edit (where the registry is a list written out) applied."""
    for rel, (anchor, text, registration) in edits.items():
        path = root / rel
        source = path.read_text()
        found = re.search(anchor, source, re.M)
        assert found, f"{rel}: no line matching {anchor!r} to add the class before"
        source = source[: found.start()] + text + source[found.start() :]
        if registration is not None:
            source, n = re.subn(registration[0], registration[1], source, count=1, flags=re.S)
            assert n == 1, f"{rel}: the registry {registration[0]!r} is not where the test expects it"
        path.write_text(source)


def _folder(path: Path, seed: int) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_symmetry.testing import tiny_model

    tiny_model("llama", dtype=torch.float32, seed=seed, tie_word_embeddings=False).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("how_to_add")
    return _folder(root / "a", 0), _folder(root / "b", 1)


def run_addition(addition: str, tmp_path: Path, folders) -> dict:
    """A copy of the package with ``addition`` made, and CHECKS run on it in a fresh Python."""
    copy = tmp_path / "copy"
    shutil.copytree(PACKAGE, copy / "hf_symmetry", ignore=shutil.ignore_patterns("__pycache__"))
    edits = ADDITIONS[addition]
    assert sorted(edits) == sorted(touched(addition)), "docs/internals.md and this test disagree on the files"
    add(copy / "hf_symmetry", edits)
    work = tmp_path / "work"
    work.mkdir()
    consts = dict(PACKAGE=str(copy / "hf_symmetry"), WORK=str(work), ADDITION=addition)
    consts.update(TINY=str(folders[0]), OTHER=str(folders[1]))
    script = "".join(f"{k} = {v!r}\n" for k, v in consts.items()) + CHECKS
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(  # (run in ``work``: a Python started in the repository would import the tree's package)
        [sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_names_are_new():
    """Negative control: the unmodified package knows none of the three additions."""
    assert "toy" not in STRUCTURE_TYPES and "toy" not in MERGE_METHODS and "ministral" not in SUPPORTED_MODEL_TYPES


def test_a_compression_structure(tmp_path, folders):
    r = run_addition("a compression structure", tmp_path, folders)
    assert "toy" in r["structure_types"] and "toy" in r["choices"]
    assert r["settings"]["gs_blocks"] == "2,2"  # its sizing option, from the class's ``sizing``
    assert "ToyLinear" in r["modules"] and "toy" in r["types"] and r["ships"]
    assert r["same_tensors"] and r["same_logits"]  # the GS variant computes what GS computes
    assert r["lora_parameters"], "PEFT's targets do not include the new module's factors"
    assert "ToyLinear" in r["remote_classes"] and r["remote_matches"]


def test_a_merge_method(tmp_path, folders):
    r = run_addition("a merge method", tmp_path, folders)
    assert "toy" in r["choices"] and r["flags"] == {"--toy-scale": True}
    assert r["scaled"] and r["parameter_reaches_the_method"]
    assert r["refused"] == 2 and not r["written_when_refused"]  # the recipe checks the parameter from its data


def test_a_source_family(tmp_path, folders):
    r = run_addition("a source family", tmp_path, folders)
    assert r["cli"] == 0 and r["markdown_row"] and r["text"].startswith("ministral\n")
    assert r["changed"] >= r["tensors"] // 3  # the rotation changed the weights ...
    assert r["max_delta"] <= 1e-9  # ... and not the function (float64, as tests/symmetry/test_symmetries.py)
