"""The flat remote-code families copy a few blocks from transformers (marked ``# Copied from
transformers.<path>``). These tests fail when a copy drifts from its source: every marker must name an
object the installed transformers still has, and each copied function computes what its source computes."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from transformers.models.llama import modeling_llama

from hf_symmetry.modeling import modeling_rms_decoder, modeling_tpa

MODELING = Path(modeling_tpa.__file__).parent
MARKER = re.compile(r"#\s*Copied from (transformers\.[\w.]+)")


def _markers() -> list[tuple[str, str]]:
    found = []
    for path in [*sorted(MODELING.glob("modeling_*.py")), Path(__file__).resolve().parents[1] / "conftest.py"]:
        for target in MARKER.findall(path.read_text()):
            found.append((path.name, target.rstrip(".")))
    return found


def test_there_are_marked_copies():
    names = {f for f, _ in _markers()}
    assert {"modeling_tpa.py", "modeling_rms_decoder.py", "modeling_farr.py"} <= names


@pytest.mark.parametrize("file,target", _markers())
def test_every_copied_from_marker_names_an_existing_transformers_object(file, target):
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):  # longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{file}: {target} no longer exists in transformers"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{file}: cannot import any module of {target}")


# a marker right above a top-level class/def, or above a method (indented, named Class.method)
HF_MARKER = re.compile(
    r"^([ \t]*)#\s*Copied from (hf_symmetry\.modeling\.[\w.]+)\n(?:[ \t]*@.*\n)*[ \t]*(?:class|def) (\w+)", re.M
)


def _hf_symmetry_copies() -> list[tuple[str, str, str]]:
    """(file, marked source, name defined right after the marker: ``Class.method`` for a method) of every
    block copied between families."""
    found = []
    for path in sorted(MODELING.glob("modeling_*.py")):
        text = path.read_text()
        for m in HF_MARKER.finditer(text):
            indent, target, name = m.groups()
            if indent:  # a method: the top-level class above the marker holds it
                name = re.findall(r"^class (\w+)", text[: m.start()], re.M)[-1] + "." + name
            found.append((path.name, target, name))
    return found


def _object(module: str, dotted: str):
    obj = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_structured_linears_are_written_once_and_not_copied():
    """Both compressed families take the structured linears from ``structured_linear`` (issue 46): no family
    carries a copy of them, and the RMS decoder's forward is still a marked copy."""
    from hf_symmetry.modeling import modeling_compressed_llama, structured_linear

    copied = {name for file, _, name in _hf_symmetry_copies()}
    shared = {"StructuredLinear", "_StructuredLinear", *structured_linear.__all__}
    assert not copied & shared, f"copies of shared blocks: {sorted(copied & shared)}"
    assert "RMSDecoderForCausalLM.forward" in copied
    for family in (modeling_compressed_llama, modeling_rms_decoder):
        assert family.OrthogonalSkip is structured_linear.OrthogonalSkip
        assert family.structured_linear is structured_linear.structured_linear
        text = Path(family.__file__).read_text()
        assert "class KroneckerLinear" not in text and "def cayley_decode" not in text


def test_a_drifted_method_copy_is_caught(monkeypatch):
    """Negative control of the method markers: a marked method whose source differs is reported."""
    copies = [c for c in _hf_symmetry_copies() if c[2] == "RMSDecoderForCausalLM.forward"]
    assert copies, "the RMS decoder's forward carries no marker"
    cls = modeling_rms_decoder.RMSDecoderForCausalLM
    monkeypatch.setattr(cls, "forward", modeling_rms_decoder.RMSDecoderModel.forward)
    with pytest.raises(AssertionError, match="drifted"):
        _check_copy(*copies[0])


@pytest.mark.parametrize("file,target,name", _hf_symmetry_copies())
def test_every_copy_of_an_hf_symmetry_block_is_identical_to_its_source(file, target, name):
    """Blocks copied from one flat family into another (``# Copied from hf_symmetry.modeling.<file>.<name>``)
    must be the marked object's source, character for character, and defined right after the marker."""
    _check_copy(file, target, name)


def _check_copy(file: str, target: str, name: str) -> None:
    import inspect

    parts = target.split(".")
    module = ".".join(parts[:3])  # hf_symmetry.modeling.<file>
    source_name = ".".join(parts[3:])
    assert name.split(".")[-1] == source_name.split(".")[-1], f"{file}: the marker names {target} but {name} follows it"
    original = inspect.getsource(_object(module, source_name))
    copy = inspect.getsource(_object(f"hf_symmetry.modeling.{file[:-3]}", name))
    assert copy == original, f"{file}: {name} drifted from {target}"


def test_copied_rms_norm_and_rotate_half_compute_what_their_source_computes():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    ours, theirs = modeling_tpa.TPARMSNorm(16, eps=1e-5), modeling_llama.LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(16)
        ours.weight.copy_(w), theirs.weight.copy_(w)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    torch.testing.assert_close(modeling_tpa.rotate_half(x), modeling_llama.rotate_half(x), rtol=0, atol=0)


def test_copied_eager_attention_computes_what_llamas_computes_with_one_kv_head_per_query_head():
    # float32: Llama's softmax always runs in float32, the copies keep float64 exact (their one change)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    mask = torch.triu(torch.full((7, 7), float("-inf")), 1)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups = 1
    module.eval()
    want, want_w = modeling_llama.eager_attention_forward(module, q, k, v, mask, scaling=0.3)
    for copy in (modeling_rms_decoder.eager_attention_forward, modeling_tpa.eager_attention_forward):
        got, got_w = copy(module, q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)


def test_the_tests_float64_rmsnorm_computes_what_its_source_computes_in_float32():
    from conftest import _exact_rmsnorm_forward

    torch.manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(_exact_rmsnorm_forward(norm, x), norm(x), rtol=0, atol=1e-6)
    x64 = x.double()
    assert _exact_rmsnorm_forward(norm.double(), x64).dtype == torch.float64
