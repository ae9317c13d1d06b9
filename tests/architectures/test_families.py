"""Family capabilities: every symmetry the capability table allows is exact on a tiny float64
model of every family, every refusal carries its structural reason, and for each new family a
refused (or non-) symmetry, forced through, really changes the function."""

import pytest
import torch

from hf_symmetry.architectures import Adapter, UnsupportedSymmetry, capabilities
from hf_symmetry.architectures.capabilities import allows, reason, require, sliding_window_layers
from hf_symmetry.conversion.match import MatchOptions, match_state_dict
from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
from hf_symmetry.conversion.stream import DictSink, DictSource, transform_checkpoint
from hf_symmetry.symmetry import NotASymmetry, actions, groups
from hf_symmetry.testing import NEW_TINY_FAMILIES, input_ids, outputs, tiny_config, tiny_model


# --------------------------------------------------------------------------- float64-exact modules


def _rms(self, x):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rms_1p(self, x):
    return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    from transformers.models.gemma2.modeling_gemma2 import repeat_kv

    scaling = module.head_dim**-0.5 if scaling is None else scaling
    k, v = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


@pytest.fixture
def exact(monkeypatch, exact_rmsnorm):
    """transformers computes these norms and Gemma's eager attention in float32 whatever the input;
    keep float64 so exactness is measured at float64 round-off."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.phi3 import modeling_phi3

    monkeypatch.setattr(modeling_gemma2.Gemma2RMSNorm, "forward", _rms_1p)
    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", _rms_1p)
    monkeypatch.setattr(modeling_phi3.Phi3RMSNorm, "forward", _rms)
    monkeypatch.setattr(modeling_olmo2.Olmo2RMSNorm, "forward", _rms)
    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", _eager)
    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", _eager)


def _reload(model, state_dict, config: dict):
    new = type(model)(type(model.config).from_dict(config)).to(torch.float64).eval()
    result = new.load_state_dict(state_dict, strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "embed_scale" not in k]
    return new


def _delta(a, b) -> float:
    ids = input_ids(a.config.vocab_size, length=24)
    return (outputs(a, ids) - outputs(b, ids)).abs().max().item()


def _apply(model, layer_fn, globals_fn=lambda g: g):
    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    sink = DictSink()
    transform_checkpoint(
        DictSource(sd), adapter, sink, lambda i, layer: layer_fn(adapter, layer), globals_fn, progress=False
    )
    return _reload(model, dict(sink), model.config.to_dict())


SINGLE = {
    "qk_rotation": RotateOptions(residual="none", heads="qk", ffn=False),
    "vo_rotation": RotateOptions(residual="none", heads="vo", ffn=False),
    "scaling": RotateOptions(residual="none", heads="none", ffn=False, scaling=True),
    "ffn_permutation": RotateOptions(residual="none", heads="none", ffn=True),
    "residual_rotation": RotateOptions(residual="random", heads="none", ffn=False),
}


# --------------------------------------------------------------------------- the table is the truth


@pytest.mark.parametrize("family", NEW_TINY_FAMILIES)  # the older ones: tests/symmetry/test_symmetries.py
@pytest.mark.parametrize("what", list(SINGLE))
def test_every_allowed_symmetry_is_exact_and_every_refusal_names_its_reason(family, what, exact):
    model = tiny_model(family)
    why = reason(model.config, what)
    if why is not None:
        with pytest.raises(UnsupportedSymmetry) as err:
            rotate_state_dict(model.state_dict(), model.config, SINGLE[what])
        assert why in str(err.value)
        return
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, SINGLE[what])
    if cfg.get("model_type") != model.config.model_type:  # LayerNorm decoders become a new family
        pytest.skip("covered by tests/conversion/test_rms_decoder.py")
    rotated = _reload(model, sd, cfg)
    assert _delta(model, rotated) <= 1e-9
    changed = [k for k, v in model.state_dict().items() if k in sd and not torch.equal(v, sd[k])]
    assert changed, "the symmetry moved no weight"


@pytest.mark.parametrize("family", NEW_TINY_FAMILIES)
def test_all_allowed_symmetries_together_on_new_families(family, exact):
    model = tiny_model(family)
    cfg = model.config
    options = RotateOptions(
        residual="hadamard" if allows(cfg, "residual_rotation") else "none",
        heads="random" if allows(cfg, "qk_rotation") else "vo",
        scaling=allows(cfg, "scaling"),
        ffn=True,
        seed=3,
    )
    sd, new_cfg = rotate_state_dict(model.state_dict(), cfg, options)
    if new_cfg["model_type"] != cfg.model_type:  # a LayerNorm decoder (GPT-NeoX), centred into the RMS-decoder family
        from hf_symmetry.modeling.configuration_rms_decoder import RMSDecoderConfig
        from hf_symmetry.modeling.modeling_rms_decoder import RMSDecoderForCausalLM

        new = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(new_cfg)).to(torch.float64).eval()
        new.load_state_dict(sd, strict=True)
        assert _delta(model, new) <= 1e-9
        return
    assert _delta(model, _reload(model, sd, new_cfg)) <= 1e-9


@pytest.mark.parametrize("family", NEW_TINY_FAMILIES)
def test_match_recovers_a_rotated_copy_of_new_families(family, exact):
    """match (auto heads: VO only under QK-norm) moves a rotated copy back onto the original,
    function preserved."""
    model = tiny_model(family)
    heads = "random" if allows(model.config, "qk_rotation") else "vo"
    sd, _ = rotate_state_dict(model.state_dict(), model.config, RotateOptions(residual="none", heads=heads, seed=5))
    result = match_state_dict(model.state_dict(), sd, model.config, MatchOptions())
    summary = result.distances.summary()
    assert summary["total"]["relative_after"] < 1e-6 < summary["total"]["relative_before"]
    assert _delta(model, _reload(model, result.state_dict, result.config)) <= 1e-9


def test_capability_messages_name_the_structure():
    cfg = tiny_config("gemma3")
    with pytest.raises(UnsupportedSymmetry, match="residual rotation: gemma3_text normalises each sublayer's output"):
        require(cfg, "residual_rotation")
    with pytest.raises(UnsupportedSymmetry, match="QK rotation: olmo2 applies QK-norm over all heads"):
        require(tiny_config("olmo2"), "qk_rotation")
    with pytest.raises(UnsupportedSymmetry, match="post-LN"):
        require(tiny_config("bert"), "residual_rotation")
    # QK-norm does not touch the residual stream: qwen3's residual rotation is allowed
    assert allows(tiny_config("qwen3"), "residual_rotation")
    assert not allows(tiny_config("qwen3"), "qk_rotation") and allows(tiny_config("qwen3"), "vo_rotation")
    # one reading of sliding windows: the families without per-layer windows refuse, FaRR's has them
    mistral = tiny_config("mistral", sliding_window=16)
    for conversion in ("compress", "slicegpt", "to_tpa"):
        assert "sliding-window attention on 2 of 2 layers (window 16)" in reason(mistral, conversion)
    assert allows(mistral, "farr_vo")
    with pytest.raises(ValueError, match="unknown symmetry or conversion"):
        reason(cfg, "rotate_everything")


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("mistral", dict(sliding_window=8)),  # every layer
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),  # layer 1 only
    ],
)
def test_farr_keeps_per_layer_sliding_windows_exactly(family, overrides, exact):
    """FaRR's decoder family has per-layer sliding windows: a sliding-window source converts
    exactly (lossless ranks), and the windows really act (the full-attention twin differs)."""
    from hf_symmetry.conversion.farr import FarrOptions, build_farr_model, farr_state_dict

    model = tiny_model(family, **overrides)
    sd, farr_config, _ = farr_state_dict(model.state_dict(), model.config, FarrOptions(tau=1.0))
    assert "sliding_attention" in farr_config.layer_types and farr_config.sliding_window == 8
    farr_model = build_farr_model(sd, farr_config, torch.float64)
    assert _delta(model, farr_model) <= 1e-9
    assert _delta(model, tiny_model(family)) > 1e-3


def test_sliding_window_is_read_once_and_the_same_from_objects_and_dicts():
    import transformers as T

    cases = [
        (T.MistralConfig(num_hidden_layers=3), (4096, 4096, 4096)),
        (T.MistralConfig(num_hidden_layers=3, sliding_window=None), (None, None, None)),
        (T.Qwen2Config(num_hidden_layers=3), (None, None, None)),  # use_sliding_window=False
        (T.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1), (None, 4096, 4096)),
        (T.Gemma2Config(num_hidden_layers=4), (4096, None, 4096, None)),
        (T.Phi3Config(num_hidden_layers=2), (None, None)),
        (T.Phi3Config(num_hidden_layers=2, sliding_window=2047), (2047, 2047)),
    ]
    for cfg, expected in cases:
        assert sliding_window_layers(cfg) == expected, cfg.model_type
        assert sliding_window_layers(cfg.to_dict()) == expected, cfg.model_type
        raw = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}  # an older config.json
        assert sliding_window_layers(raw) == expected, cfg.model_type


# --------------------------------------------------------------------------- negative controls


def _force_residual(model, Q, fold_inputs: bool):
    """Rotate the residual stream as if it were a symmetry: fold the input norms (where they
    are the sublayers' inputs) and the final norm, then rotate readers, writers, embeddings and
    head, leaving any norm on a sublayer's output alone."""

    def layer_fn(adapter, layer):
        if fold_inputs:
            layer = actions.fold_layer_norms(layer)
        else:  # OLMo 2's canonical norms are the output norms: pretend they were folded
            layer = dict(layer)
            saved = {k: layer[k] for k in ("attn_norm.weight", "ffn_norm.weight")}
            layer.update({k: torch.ones_like(v) for k, v in saved.items()})
        layer = actions.rotate_residual_layer(layer, Q)
        if not fold_inputs:
            layer.update(saved)
        return layer

    def globals_fn(g):
        g = dict(g)
        g.setdefault("lm_head.weight", g["embed.weight"].clone())
        g = actions.fold_final_norm(g)
        if "final_norm.bias" in g:
            del g["final_norm.bias"]
        return actions.rotate_residual_globals(g, Q)

    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    sink = DictSink()
    transform_checkpoint(
        DictSource(sd), adapter, sink, lambda i, layer: layer_fn(adapter, layer), globals_fn, progress=False
    )
    cfg = {**model.config.to_dict(), "tie_word_embeddings": False}
    return _reload(model, dict(sink), cfg)


@pytest.mark.parametrize("family,fold_inputs", [("gemma2", True), ("gemma3", True), ("olmo2", False)])
def test_residual_rotation_through_output_norms_changes_the_function(family, fold_inputs, exact):
    model = tiny_model(family)
    hidden = model.config.hidden_size
    identity = _force_residual(model, torch.eye(hidden, dtype=torch.float64), fold_inputs)
    assert _delta(model, identity) <= 1e-9  # the forced path itself is exact ...
    Q = groups.haar_orthogonal(hidden, groups.rng(1))
    assert _delta(model, _force_residual(model, Q, fold_inputs)) > 1e-3  # ... the rotation is not
    with pytest.raises(UnsupportedSymmetry, match="normalises each sublayer's output"):
        rotate_state_dict(model.state_dict(), model.config, RotateOptions(residual="random", heads="vo"))


def test_residual_rotation_of_layernorm_without_centring_changes_the_function(exact):
    """GPT-NeoX: folding LayerNorm's γ/β and rotating is exact for Q = I but not for a rotation
    (LayerNorm subtracts the mean, which a rotation does not commute with)."""
    model = tiny_model("gpt_neox")
    hidden = model.config.hidden_size
    with torch.no_grad():  # GPT-NeoX's head has no bias to take the final LayerNorm's β
        model.gpt_neox.final_layer_norm.bias.zero_()

    def forced(Q):
        def layer_fn(adapter, layer):
            return actions.rotate_residual_layer(actions.fold_layer_norms(layer), Q)

        def globals_fn(g):
            g = actions.fold_final_norm(dict(g))
            assert not g.pop("lm_head.bias").any()
            return actions.rotate_residual_globals(g, Q)

        return _apply(model, layer_fn, globals_fn)

    assert _delta(model, forced(torch.eye(hidden, dtype=torch.float64))) <= 1e-9
    assert _delta(model, forced(groups.haar_orthogonal(hidden, groups.rng(2)))) > 1e-3
    # centred first (into the RMS-decoder family) it is exact: tests/conversion/test_rms_decoder.py
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, RotateOptions(residual="random"))
    assert cfg["model_type"] == "hf_symmetry_rms_decoder"


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_qk_rotation_and_scaling_under_qk_norm_change_the_function(family, exact):
    model = tiny_model(family)

    def rot(adapter, layer):
        L = adapter.layout
        return actions.rotate_qk(
            layer, L, [groups.random_rope_commutant(L, groups.rng(4, g)) for g in range(L.n_kv_heads)], check=False
        )

    def scale(adapter, layer):
        # QK-norm divides the scale out again, up to its ε: a scale small enough to meet ε shows it
        return actions.scale_qk(layer, adapter.layout, torch.full((adapter.layout.n_kv_heads,), 1e-3), check=False)

    assert _delta(model, _apply(model, rot)) > 1e-3
    assert _delta(model, _apply(model, scale)) > 1e-3
    for what in ("qk", "random"):
        with pytest.raises(UnsupportedSymmetry, match="QK-norm"):
            rotate_state_dict(model.state_dict(), model.config, RotateOptions(residual="none", heads=what))


@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_mixing_rotary_and_free_dims_of_partially_rotary_heads_changes_the_function(family, exact):
    """Phi-3 (6 of 8 dims rotary) and GPT-NeoX (4 of 8) allow QK rotations, but only inside the
    RoPE commutant: swapping a rotary dim with a free one is refused and would change the logits."""
    model = tiny_model(family)

    def mix(adapter, layer, check=False):
        L = adapter.layout
        assert 0 < L.rotary_dim < L.head_dim
        R = torch.eye(L.head_dim, dtype=torch.float64)
        R[[0, L.head_dim - 1]] = R[[L.head_dim - 1, 0]]
        return actions.rotate_qk(layer, L, [R] * L.n_kv_heads, check=check)

    assert _delta(model, _apply(model, mix)) > 1e-3
    with pytest.raises(NotASymmetry, match="does not commute with RoPE"):
        _apply(model, lambda a, layer: mix(a, layer, check=True))


def test_gpt_neox_fused_qkv_is_per_head_and_block_reading_breaks_vo_rotation(exact):
    """The adapter reads GPT-NeoX's query_key_value as [q_h k_h v_h] per head; reading it as
    [q | k | v] blocks (Phi-3's layout) would make a VO rotation change the function."""
    import dataclasses

    model = tiny_model("gpt_neox")
    sd = model.state_dict()

    def vo(adapter, layer):
        L = adapter.layout
        return actions.rotate_vo(
            layer, L, [groups.haar_orthogonal(L.head_dim, groups.rng(6, g)) for g in range(L.n_kv_heads)]
        )

    assert _delta(model, _apply(model, vo)) <= 1e-9
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    wrong = dataclasses.replace(
        adapter,
        spec=dataclasses.replace(
            adapter.spec, attention=dataclasses.replace(adapter.spec.attention, qkv_layout="blocks")
        ),
    )
    sink = DictSink()
    transform_checkpoint(DictSource(sd), wrong, sink, lambda i, layer: vo(wrong, layer), lambda g: g, progress=False)
    assert _delta(model, _reload(model, dict(sink), model.config.to_dict())) > 1e-3


def test_gemma_one_plus_gamma_norms_round_trip_exactly():
    """Gemma stores w = γ - 1: canonical norms are γ, and writing them back restores w."""
    model = tiny_model("gemma2")
    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    layer = adapter.read_layer(0, sd)
    assert torch.allclose(layer["attn_norm.weight"], 1.0 + sd["model.layers.0.input_layernorm.weight"])
    back = adapter.write_layer(0, layer, sd)
    assert torch.allclose(
        back["model.layers.0.input_layernorm.weight"], sd["model.layers.0.input_layernorm.weight"], rtol=0, atol=1e-15
    )
    bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}  # (w + 1) - 1 is exact for bfloat16 w
    back = adapter.write_layer(0, adapter.read_layer(0, bf16), bf16)
    assert torch.equal(back["model.layers.0.input_layernorm.weight"], bf16["model.layers.0.input_layernorm.weight"])


# --------------------------------------------------------------------------- the table


def test_table_covers_every_model_type_and_column_and_is_stable():
    from hf_symmetry.architectures.spec import SUPPORTED_MODEL_TYPES

    md = capabilities.families_markdown()
    assert md == capabilities.families_markdown()
    lines = md.strip().splitlines()
    assert len(lines) == 2 + len(SUPPORTED_MODEL_TYPES)
    for line, model_type in zip(lines[2:], SUPPORTED_MODEL_TYPES):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert cells[0] == model_type and len(cells) == 1 + len(capabilities.COLUMNS)
        assert all(c == "yes" or c.startswith("no: ") for c in cells[1:])
    for _, header in capabilities.COLUMNS:
        assert header in lines[0]


def test_readme_table_is_the_generated_one():
    from pathlib import Path

    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text(encoding="utf-8")
    start, end = "<!-- families-table:start -->", "<!-- families-table:end -->"
    if start not in text:
        pytest.skip("README has no generated families table yet")
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == capabilities.families_markdown().strip(), "regenerate with `hf-symmetry families --markdown`"


def test_families_command_prints_the_table(capsys):
    from hf_symmetry.cli import main

    assert main(["families"]) == 0
    out = capsys.readouterr().out
    assert "gemma3_text" in out and "normalises each sublayer's output" in out
    assert main(["families", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == capabilities.families_markdown().strip()
    assert main(["families", "--model-type", "qwen3"]) == 0
    out = capsys.readouterr().out
    assert "qwen3" in out and "gemma2" not in out
    assert main(["families", "--model-type", "nope"]) == 2


def test_compress_runs_exactly_on_phi3_whose_capability_allows_it(exact):
    """Phi-3 (fused qkv and gate_up, read through the adapter) compresses: full-rank structures at
    random per-segment rotations reproduce the logits."""
    from test_compressed_llama import _exact_compression

    model = tiny_model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert allows(model.config, "compress") and not allows(tiny_config("phi3"), "compress")  # partial rotary: no
    compressed, _ = _exact_compression(model, "kron")
    assert _delta(model, compressed) <= 1e-9
