"""``rotate --for-quantization`` tells the truth (issue 39): the ``applied:`` list it prints and the model card's
transforms and options are the ones that really changed weights, checked against the tensors themselves."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
from hf_symmetry.testing import tiny_model

SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
SITES = ("attn_in", "ffn_in", "o_in", "down_in")
#: each scaling -> the tensors (of layer L) it moves; a transform is applied iff its tensors changed
MOVES = {
    "attn_norm_scaling": ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj"),
    "ffn_norm_scaling": ("post_attention_layernorm", "mlp.gate_proj"),
    "vo_scaling": ("self_attn.o_proj",),
    "ffn_scaling": ("mlp.down_proj",),
}


def _model():
    model = tiny_model("llama", **SHAPE)
    with torch.no_grad():  # outlier input channels, as real models have, so that the search scales them
        for layer in model.model.layers:
            layer.input_layernorm.weight[3] *= 20
            layer.post_attention_layernorm.weight[11] *= 20
    return model


def _stats(model, flat=()):
    """Planted per-layer second moments: outlier channels on every site, except ``flat`` sites (identity: every
    channel alike, so no scale can differ from 1 there)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in model.model.layers:
        st = {}
        for site, n in zip(SITES, (64, 64, 64, 96)):
            if site in flat:
                st[site] = torch.eye(n, dtype=torch.float64)
            else:
                x = torch.randn(256, n, generator=g, dtype=torch.float64)
                x[:, 5] *= 30
                st[site] = x.T @ x / 256
        out.append(st)
    return out


def changed_transforms(before: dict, after: dict, layers: int = 2) -> set[str]:
    """Which scalings moved weights, read off the tensors (any layer)."""
    done = set()
    for name, tensors in MOVES.items():
        for i in range(layers):
            if all(
                not torch.equal(before[f"model.layers.{i}.{t}.weight"], after[f"model.layers.{i}.{t}.weight"])
                for t in tensors
            ):
                done.add(name)
    return done


@pytest.mark.parametrize("flat", [(), ("o_in", "down_in"), ("attn_in",)])
def test_applied_is_what_changed_the_weights(flat):
    """The applied list names exactly the scalings whose tensors moved; a site whose statistics are flat gets no
    scale (α is irrelevant there) and is neither moved nor listed (the negative control of each scaling)."""
    model = _model()
    before = model.state_dict()
    info = {}
    options = RotateOptions(residual="none", for_quantization=True, scales="Q4_0", vo_hadamard=False)
    sd, _ = rotate_state_dict(before, model.config, options, calibration=_stats(model, flat), info=info)
    moved = changed_transforms(before, sd)
    assert set(info["applied"]) == moved
    expected = {"attn_in": "attn_norm_scaling", "ffn_in": "ffn_norm_scaling", "o_in": "vo_scaling"}
    expected["down_in"] = "ffn_scaling"
    assert moved == {name for site, name in expected.items() if site not in flat}
    old_claim = set(options.symmetries())  # what the command printed before issue 39
    assert old_claim != moved, "the check cannot tell the old list from the truth"


def _tiny_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "src"
    _model().float().save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    text = tmp_path / "calib.txt"
    g = torch.Generator().manual_seed(1)
    text.write_text(" ".join(str(int(t)) for t in torch.randint(0, 97, (600,), generator=g)))
    return folder, text


def test_cli_prints_and_records_what_it_applied(tmp_path, capsys):
    """``rotate --for-quantization``: the printed ``applied:`` list, the JSON report and the card's transforms are the
    scalings whose tensors moved (not the old ``vo_scaling`` alone), and the card's parameters are the options in
    force: no ``heads``/``ffn``/``scaling`` (the preset ignores them), the quantizer and the calibration instead."""
    from hf_symmetry.cli import main

    src, text = _tiny_folder(tmp_path)
    out = tmp_path / "out"
    argv = ["rotate", str(src), str(out), "--for-quantization", "--calibration-text", str(text)]
    argv += ["--calibration-tokens", "512", "--no-verify", "--quiet", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    printed = next(line for line in capsys.readouterr().out.splitlines() if "applied:" in line)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    moved = changed_transforms(before, after)
    assert moved == {"attn_norm_scaling", "ffn_norm_scaling", "vo_scaling", "ffn_scaling"}
    listed = printed.split("applied:")[1].split("(seed")[0].strip().split(", ")
    assert set(listed) == moved
    assert set(json.loads((tmp_path / "r.json").read_text())["applied"]) == moved
    card = json.loads((out / "hf_symmetry_card.json").read_text())["data"]
    assert set(card["extra"]["applied"]) == moved
    params = card["parameters"]
    assert not {"heads", "ffn", "scaling", "learn", "balance_alpha"} & set(params), params
    assert params["scales"] == "Q4_0" and params["residual"] == "none" and params["calibration_tokens"] == 512
    readme = (out / "README.md").read_text()
    assert "attn norm scaling" in readme and "QK rotations" not in readme and "| heads |" not in readme


def test_plain_rotate_card_keeps_its_symmetries():
    """Without ``--for-quantization`` the options in force are the rotation's own, and nothing of the preset."""
    from hf_symmetry.conversion.rotate import rotate_card_data

    data = rotate_card_data("a", "b", RotateOptions(seed=1), "llama", False)
    assert data["parameters"] == {"residual": "hadamard", "heads": "random", "ffn": True, "scaling": False}
    assert data["extra"]["applied"] == ["residual_rotation", "qk_rotation", "vo_rotation", "ffn_permutation"]
