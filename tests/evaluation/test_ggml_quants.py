"""hf_symmetry/evaluation/ggml_quants.py against llama.cpp's own ``llama-quantize`` (issue 39): for every type it
emulates, with and without an importance matrix, the dequantized weights equal the blocks llama-quantize wrote
for the same tensor, bit for bit (recorded by benchmarks/record_ggml_quants.py with llama.cpp 0c1e57098, x86-64,
``GGML_NATIVE=OFF``; no llama.cpp is needed here)."""

from pathlib import Path

import numpy as np
import pytest

from hf_symmetry.evaluation.ggml_quants import TYPES, roundtrip

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "ggml_llamacpp_quants.safetensors"


def _fixture():
    from safetensors.numpy import load_file

    return load_file(str(FIXTURE))


def _llama_quantize(data, key, qtype):
    import gguf

    return gguf.quants.dequantize(data[key], gguf.GGMLQuantizationType[qtype]).astype(np.float32)


@pytest.mark.parametrize("mode", ["imatrix", "none"])
@pytest.mark.parametrize("qtype", TYPES)
def test_emulation_is_llama_quantize_bit_for_bit(qtype, mode):
    data = _fixture()
    x, imat = data["x"], data["imatrix"]
    want = _llama_quantize(data, f"{mode}.{qtype}", qtype)
    got = roundtrip(x, qtype, imat if mode == "imatrix" else None)
    assert got.dtype == np.float32 and got.shape == x.shape
    differ = int((want.view(np.uint32) != got.view(np.uint32)).sum())
    assert differ == 0, f"{differ} of {x.size} weights differ from llama-quantize's"


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != "Q8_0"])
def test_negative_controls_the_importance_matrix_and_its_values_matter(qtype):
    """The recorded imatrix blocks are not what the unweighted quantizer gives, nor what a slightly different
    importance vector gives (Q8_0 ignores the matrix in llama.cpp, so it is left out)."""
    data = _fixture()
    x, imat = data["x"], data["imatrix"]
    want = _llama_quantize(data, f"imatrix.{qtype}", qtype)
    assert not np.array_equal(roundtrip(x, qtype, None), want)
    bumped = imat.copy()
    bumped[::3] *= 1.5
    assert not np.array_equal(roundtrip(x, qtype, bumped), want)


def test_the_fixture_inputs_are_the_recorders():
    """The stored tensor and importance vector are the ones benchmarks/record_ggml_quants.py makes (so the fixture
    can be recorded again from the same inputs)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from record_ggml_quants import fixture_inputs

    x, imat = fixture_inputs()
    data = _fixture()
    assert np.array_equal(data["x"], x) and np.array_equal(data["imatrix"], imat)
