"""Residual rotation of LayerNorm decoders (OPT, GPT-2): mean-centring turns every LayerNorm into
a weightless RMSNorm, the result is the RMS-decoder family, and it computes the original's logits
(float64), reloads with remote code where hf_symmetry is not installed, and generates."""

import json
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from hf_symmetry.architectures import UnsupportedSymmetry
from hf_symmetry.architectures.capabilities import allows, reason
from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint, rotate_state_dict
from hf_symmetry.modeling.configuration_rms_decoder import RMSDecoderConfig
from hf_symmetry.modeling.modeling_rms_decoder import RMSDecoderForCausalLM
from hf_symmetry.symmetry import actions
from hf_symmetry.testing import input_ids, outputs, tiny_config, tiny_model, run_without_hf_symmetry

ALL = RotateOptions(residual="random", heads="random", ffn=True, scaling=True, seed=2)


def _as_rms_decoder(state_dict, config: dict):
    model = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(config)).to(torch.float64).eval()
    result = model.load_state_dict(state_dict, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model


LAYER_NORM_DECODERS = {
    "opt": {},
    "gpt2": {},
    "gpt_neox": {},
    "gpt_neox-sequential": {"use_parallel_residual": False},
    "gptj": {},
}


@pytest.mark.parametrize("family", list(LAYER_NORM_DECODERS))
@pytest.mark.parametrize("residual", ["random", "hadamard"])
def test_centred_and_rotated_layer_norm_decoder_reproduces_the_logits(family, residual, exact_rmsnorm):
    """OPT and GPT-2 (learned positions), GPT-NeoX (partial rotate-half RoPE, parallel or sequential block,
    fused per-head qkv) and GPT-J (partial interleaved RoPE, parallel block on one LayerNorm, head bias)."""
    model = tiny_model(family.split("-")[0], **LAYER_NORM_DECODERS[family])
    assert allows(model.config, "residual_rotation")
    options = RotateOptions(residual=residual, heads="random", ffn=True, scaling=True, seed=2)
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, options)
    assert cfg["model_type"] == "hf_symmetry_rms_decoder" and not any("norm" in k for k in sd)
    new = _as_rms_decoder(sd, cfg)
    ids = input_ids(model.config.vocab_size, length=40)
    assert (outputs(model, ids) - outputs(new, ids)).abs().max().item() <= 1e-9
    # the residual stream really was rotated: embedding rows are no longer zero-mean (as centring left them)
    assert sd["model.embed_tokens.weight"].mean(dim=1).abs().max() > 1e-3


def test_left_padded_batches_match_opt_positions():
    """OPT counts positions over the attention mask; the RMS-decoder family does the same."""
    model = tiny_model("opt")
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, ALL)
    new = _as_rms_decoder(sd, cfg)
    ids = input_ids(model.config.vocab_size, length=12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = new(input_ids=ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max().item() <= 1e-9


def test_centring_without_rotation_is_exact_and_skipping_it_is_not():
    """Negative control: fold LayerNorm's γ/β, drop the mean subtraction (weightless RMSNorm)
    without centring the writers: the function changes. With centring it does not."""
    from hf_symmetry.conversion import rotate as rot

    model = tiny_model("gpt2")
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, ALL)

    original = actions.centre_writers
    try:
        rot.actions.centre_writers = lambda layer: layer
        original_rows = actions.centre_rows
        rot.actions.centre_rows = lambda W: W
        bad_sd, bad_cfg = rotate_state_dict(model.state_dict(), model.config, ALL)
    finally:
        rot.actions.centre_writers = original
        rot.actions.centre_rows = original_rows
    ids = input_ids(model.config.vocab_size)
    assert (outputs(model, ids) - outputs(_as_rms_decoder(bad_sd, bad_cfg), ids)).abs().max().item() > 1e-3
    assert (outputs(model, ids) - outputs(_as_rms_decoder(sd, cfg), ids)).abs().max().item() <= 1e-9


def test_rotary_and_parallel_blocks_are_what_make_gpt_neox_and_gptj_exact(exact_rmsnorm):
    """Negative controls: the same rotated weights in a sequential block, without rotary embeddings, or
    (GPT-J) without re-pairing its interleaved RoPE dims as rotate-half, give other functions."""
    from hf_symmetry.conversion import rotate as rot

    ids = input_ids()
    for family in ("gpt_neox", "gptj"):
        model = tiny_model(family)
        sd, cfg = rotate_state_dict(model.state_dict(), model.config, ALL)
        assert cfg["rotary"] and cfg["parallel_block"]
        assert (outputs(model, ids) - outputs(_as_rms_decoder(sd, cfg), ids)).abs().max().item() <= 1e-9
        for change in ({"parallel_block": False}, {"rotary": False, "position_offset": 0}):
            wrong = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict({**cfg, **change})).to(torch.float64).eval()
            wrong.load_state_dict(sd, strict=False)
            assert (outputs(model, ids) - outputs(wrong, ids)).abs().max().item() > 1e-3, (family, change)
    original = actions.interleaved_to_half
    try:
        rot.actions.interleaved_to_half = lambda layer, layout: layer
        bad_sd, bad_cfg = rotate_state_dict(model.state_dict(), model.config, ALL)
    finally:
        rot.actions.interleaved_to_half = original
    assert (outputs(model, ids) - outputs(_as_rms_decoder(bad_sd, bad_cfg), ids)).abs().max().item() > 1e-3


def test_layer_norm_decoders_that_the_family_cannot_express_are_refused():
    for family in ("gptj", "gpt_neox", "opt", "gpt2"):
        assert reason(tiny_config(family), "residual_rotation") is None
    with pytest.raises(UnsupportedSymmetry, match="post-LN"):
        rotate_state_dict(
            tiny_model("opt", do_layer_norm_before=False).state_dict(),
            tiny_config("opt", do_layer_norm_before=False),
            ALL,
        )
    with pytest.raises(ValueError, match="scale_attn"):
        rotate_state_dict(
            tiny_model("gpt2", scale_attn_by_inverse_layer_idx=True).state_dict(),
            tiny_config("gpt2", scale_attn_by_inverse_layer_idx=True),
            ALL,
        )


def test_the_rms_decoder_family_rotates_again_exactly():
    """The output is a supported family itself: its residual stream rotates without centring."""
    model = tiny_model("opt")
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, ALL)
    first = _as_rms_decoder(sd, cfg)
    sd2, cfg2 = rotate_state_dict(sd, cfg, RotateOptions(residual="hadamard", heads="vo", seed=9))
    assert cfg2["model_type"] == "hf_symmetry_rms_decoder"
    second = _as_rms_decoder(sd2, cfg2)
    ids = input_ids(model.config.vocab_size)
    assert (outputs(first, ids) - outputs(second, ids)).abs().max().item() <= 1e-9


_REMOTE_SCRIPT = textwrap.dedent("""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    ref = load_file(FOLDER + "/expected.safetensors")
    result = {}
    for name in ("opt", "gpt2", "gpt_neox"):
        model = AutoModelForCausalLM.from_pretrained(FOLDER + "/" + name, trust_remote_code=True, dtype=torch.float64)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ref["ids"]).logits
        generated = model.generate(ref["ids"][:, :8], max_new_tokens=6, do_sample=False)
        result[name] = [type(model).__name__, (logits - ref[name]).abs().max().item(),
                        generated[0, 8:].tolist()]
    print(json.dumps(result))
""")


def test_rotated_checkpoint_loads_with_remote_code_and_generates(tmp_path):
    """``rotate --residual`` on OPT/GPT-2/GPT-NeoX folders writes the RMS-decoder family with its code; it
    loads with trust_remote_code where hf_symmetry is not importable, reproduces the original's
    logits, and greedy generation gives the original's tokens."""
    from transformers import AutoModelForCausalLM

    ids = input_ids(batch=1, length=16)
    expected = {"ids": ids}
    tokens = {}
    for family in ("opt", "gpt2", "gpt_neox"):
        src = tmp_path / f"src-{family}"
        model = tiny_model(family)
        model.save_pretrained(src)
        out = tmp_path / "rotated" / family
        rotate_checkpoint(src, out, ALL, progress=False)
        files = {p.name for p in out.iterdir()}
        assert {"config.json", "configuration_rms_decoder.py", "modeling_rms_decoder.py"} <= files
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "hf_symmetry_rms_decoder" and "AutoModelForCausalLM" in config["auto_map"]
        native = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()  # registered by hf_symmetry
        assert (outputs(model, ids) - outputs(native, ids)).abs().max().item() <= 1e-9
        expected[family] = outputs(model, ids).contiguous()
        with torch.no_grad():
            tokens[family] = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)[0, 8:].tolist()
            assert native.generate(ids[:, :8], max_new_tokens=6, do_sample=False)[0, 8:].tolist() == tokens[family]
    save_file(expected, str(tmp_path / "rotated" / "expected.safetensors"))

    result = run_without_hf_symmetry(_REMOTE_SCRIPT, tmp_path, FOLDER=str(tmp_path / "rotated"))
    for family in ("opt", "gpt2", "gpt_neox"):
        name, delta, generated = result[family]
        assert name == "RMSDecoderForCausalLM" and delta <= 1e-9
        assert generated == tokens[family]
