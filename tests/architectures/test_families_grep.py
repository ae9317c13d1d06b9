"""Family knowledge lives in ``architectures/`` (and ``modeling/``, for hf_symmetry's own families):
no other module of the package names a model_type (a source family's or one of hf_symmetry's own) or
a source module path; they read what they need from the family's spec, the adapter or the config
class (grep-level, on the parsed source: string constants, f-string parts and attribute chains;
comments do not count)."""

import ast
import importlib
import pkgutil
from pathlib import Path

from hf_symmetry.architectures.spec import SPECS

PACKAGE = Path(__file__).resolve().parents[2] / "hf_symmetry"
#: where family knowledge lives
HOMES = ("architectures/", "modeling/")
#: modules outside them that name families by design, with the reason
EXEMPT = {
    "testing.py": "the tiny-model zoo for tests: one hand-written config per family, as tests name families",
    "gguf_pretokenizer.py": "llama.cpp's table of pre-tokenizer names (tokenizer.ggml.pre): its "
    "'qwen2' names a tokenizer, not a model_type",
}
# Modules that may still offend, each with its reason (the test fails both on a new offender and on a
# stale entry: the list only shrinks).
NOT_YET: dict[str, str] = {}


def _own_model_types() -> set[str]:
    """The model_type of every configuration class in ``hf_symmetry.modeling``."""
    from transformers import PretrainedConfig

    from hf_symmetry import modeling

    own = set()
    for info in pkgutil.iter_modules(modeling.__path__):
        if info.name.startswith("configuration_"):
            module = importlib.import_module(f"{modeling.__name__}.{info.name}")
            own |= {
                v.model_type
                for v in vars(module).values()
                if isinstance(v, type) and issubclass(v, PretrainedConfig) and getattr(v, "model_type", "")
            }
    return own


def _source_facts():
    model_types = {t for s in SPECS for t in s.model_types} | _own_model_types()
    prefixes = {s.layers for s in SPECS if not s.model_types[0].startswith("hf_symmetry_")}
    return model_types, prefixes


def _offences(path: Path) -> list[str]:
    model_types, prefixes = _source_facts()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in model_types:
                found.append(f"line {node.lineno}: model_type {node.value!r}")
            elif any(node.value.startswith(p + ".") or f".{p}." in node.value for p in prefixes):
                found.append(f"line {node.lineno}: module path {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in ("self_attn", "mlp", "embed_tokens"):
            found.append(f"line {node.lineno}: module attribute .{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "layers"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "model"
        ):
            found.append(f"line {node.lineno}: module attribute .model.layers")
    return found


def test_no_module_outside_architectures_names_a_model_type_or_a_module_path():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(HOMES) or rel in EXEMPT:
            continue
        found = _offences(path)
        if found:
            offenders[rel] = found
    new = {k: v for k, v in offenders.items() if k not in NOT_YET}
    assert not new, f"modules that name a model_type or module path: {new}"
    stale = set(NOT_YET) - set(offenders)
    assert not stale, f"fixed: remove from NOT_YET: {sorted(stale)}"


def test_the_scan_covers_every_module_outside_the_homes():
    scanned = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert {
        "cli.py",
        "devices.py",
        "training/heal/pipeline.py",
        "hub/cards.py",
        "evaluation/compare.py",
        "conversion/rotate.py",
    } <= scanned
    assert set(EXEMPT) <= scanned


def test_the_check_catches_what_it_claims_to(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        'if config["model_type"] == "mistral":\n    x = "model.layers.0.self_attn.q_proj"\n'
        'y = model.model.layers[0].self_attn\nz = f"transformer.h.{i}.attn"\n'
    )
    found = _offences(bad)
    assert len(found) == 5, found
    own = tmp_path / "own.py"  # hf_symmetry's own families count too (the heal bug: a hand-written list)
    own.write_text('CAUSAL = ("hf_symmetry_tpa", "hf_symmetry_compressed_llama")\nSMOKE = "hf_symmetry_smoke"\n')
    assert len(_offences(own)) == 2, _offences(own)
