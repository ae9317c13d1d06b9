"""Conversions derive what they may do from the family capabilities and reach tensors through the
adapter: no conversion module names a source model_type or a source module path (grep-level, on
the parsed source: string constants, f-string parts and attribute chains; comments do not count)."""

import ast
from pathlib import Path

from hf_symmetry.architectures.spec import SPECS

CONVERSION = Path(__file__).resolve().parents[1] / "hf_symmetry" / "conversion"
# Modules that may still offend, each with its reason (the test fails both on a new offender and on a
# stale entry). None today: to-tpa reads its source through the adapter and writes the TPA family's names
# from modeling_tpa; compress writes the compressed family's names from modeling_compressed_llama.
NOT_YET: dict[str, str] = {}


def _source_facts():
    model_types = {t for s in SPECS for t in s.model_types if not t.startswith("hf_symmetry_")}
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
        elif isinstance(node, ast.Attribute) and node.attr == "layers" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "model":
            found.append(f"line {node.lineno}: module attribute .model.layers")
    return found


def test_no_conversion_module_names_a_model_type_or_a_module_path():
    offenders = {}
    for path in sorted(CONVERSION.rglob("*.py")):
        found = _offences(path)
        if found:
            offenders[path.relative_to(CONVERSION).as_posix()] = found
    new = {k: v for k, v in offenders.items() if k not in NOT_YET}
    assert not new, f"conversion modules that name a model_type or module path: {new}"
    stale = set(NOT_YET) - set(offenders)
    assert not stale, f"fixed: remove from NOT_YET: {sorted(stale)}"


def test_the_check_catches_what_it_claims_to(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('if config["model_type"] == "mistral":\n    x = "model.layers.0.self_attn.q_proj"\n'
                   'y = model.model.layers[0].self_attn\nz = f"transformer.h.{i}.attn"\n')
    found = _offences(bad)
    assert len(found) == 5, found
