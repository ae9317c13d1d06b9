"""Each symmetry alone and all together preserve the function of every family (float64,
tiny random models); non-symmetries change it and the engine refuses them."""

import pytest
import torch

from hf_symmetry.architectures import Adapter, UnsupportedSymmetry
from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
from hf_symmetry.conversion.stream import DictSink, DictSource, transform_checkpoint
from hf_symmetry.symmetry import HeadLayout, NotASymmetry, actions, groups
from hf_symmetry.testing import TINY_FAMILIES, input_ids, outputs, tiny_model

RMS_FAMILIES = ("llama", "mistral", "smollm3", "qwen2", "qwen3")


def _reload(model, state_dict, config: dict):
    if config["model_type"] != model.config.model_type:  # LayerNorm decoders become the RMS-decoder family
        import transformers

        new = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
        new = new.to(torch.float64).eval()
        result = new.load_state_dict(state_dict, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        return new
    new = type(model)(type(model.config).from_dict(config)).to(torch.float64).eval()
    result = new.load_state_dict(state_dict, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return new


def _max_delta(model, options: RotateOptions) -> float:
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, options)
    ids = input_ids(model.config.vocab_size)
    return (outputs(model, ids) - outputs(_reload(model, sd, cfg), ids)).abs().max().item()


def _apply(model, layer_fn):
    """Run an arbitrary per-layer transform on a model, returning the transformed model."""
    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    sink = DictSink()
    transform_checkpoint(
        DictSource(sd), adapter, sink, lambda i, layer: layer_fn(adapter, layer), lambda g: g, progress=False
    )
    return _reload(model, dict(sink), model.config.to_dict())


def _delta(a, b) -> float:
    ids = input_ids(a.config.vocab_size)
    return (outputs(a, ids) - outputs(b, ids)).abs().max().item()


SINGLE = {
    "qk_rotation": RotateOptions(residual="none", heads="qk", ffn=False),
    "vo_rotation": RotateOptions(residual="none", heads="vo", ffn=False),
    "scaling": RotateOptions(residual="none", heads="none", ffn=False, scaling=True),
    "ffn_permutation": RotateOptions(residual="none", heads="none", ffn=True),
    "residual_rotation": RotateOptions(residual="random", heads="none", ffn=False),
    "residual_hadamard": RotateOptions(residual="hadamard", heads="none", ffn=False),
}


def _supported(family: str, name: str) -> bool:
    """What the capability table says (tests/architectures/test_families.py checks its reasons)."""
    from hf_symmetry.architectures.capabilities import allows
    from hf_symmetry.testing import tiny_config

    return allows(tiny_config(family), "residual_rotation" if name.startswith("residual") else name)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("name", list(SINGLE))
def test_each_symmetry_alone_preserves_function(family, name, exact_rmsnorm):
    model = tiny_model(family)
    if not _supported(family, name):
        with pytest.raises(UnsupportedSymmetry):
            _max_delta(model, SINGLE[name])
        return
    assert _max_delta(model, SINGLE[name]) <= 1e-9


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_all_symmetries_together_preserve_function(family, exact_rmsnorm):
    model = tiny_model(family)
    options = RotateOptions(
        residual="hadamard" if family in RMS_FAMILIES else "none",
        heads="vo" if family == "qwen3" else "random",
        ffn=True,
        scaling=family != "qwen3",
        seed=7,
    )
    assert _max_delta(model, options) <= 1e-9
    # and the weights really changed
    sd, _ = rotate_state_dict(model.state_dict(), model.config, options)
    changed = [
        k for k, v in model.state_dict().items() if k in sd and v.shape == sd[k].shape and not torch.allclose(v, sd[k])
    ]
    assert len(changed) >= len(sd) // 3


def _random_rotations(adapter, make):
    L = adapter.layout
    return [make(L, groups.rng(11, g)) for g in range(L.n_kv_heads)]


def test_generic_orthogonal_on_rope_dims_breaks_the_model_and_is_refused(exact_rmsnorm):
    model = tiny_model("llama")

    def generic(adapter, layer, check=False):
        return actions.rotate_qk(
            layer,
            adapter.layout,
            _random_rotations(adapter, lambda L, g: groups.haar_orthogonal(L.head_dim, g)),
            check=check,
        )

    assert _delta(model, _apply(model, generic)) > 1e-3
    with pytest.raises(NotASymmetry, match="does not commute with RoPE"):
        _apply(model, lambda a, layer: generic(a, layer, check=True))


def test_nope_layer_takes_any_orthogonal_qk_map_and_rope_layer_does_not(exact_rmsnorm):
    """SmolLM3-style NoPE layers: the per-layer layout frees the full O(d_h) on layer 1 (no RoPE),
    while the same map on layer 0 (RoPE) is refused and would change the logits."""
    model = tiny_model("smollm3")
    sd = model.state_dict()
    adapter = Adapter.from_config(model.config.to_dict(), list(sd))
    assert adapter.layer_layout(0) == adapter.layout and adapter.layer_layout(1).rope_layout == "none"

    def generic_on(target: int, check: bool):
        def layer_fn(i, layer):
            if i != target:
                return layer
            L = adapter.layer_layout(i)
            Rs = [groups.haar_orthogonal(L.head_dim, groups.rng(3, g)) for g in range(L.n_kv_heads)]
            return actions.rotate_qk(layer, L, Rs, check=check)

        sink = DictSink()
        transform_checkpoint(DictSource(sd), adapter, sink, layer_fn, lambda g: g, progress=False)
        return _reload(model, dict(sink), model.config.to_dict())

    nope = generic_on(1, check=True)
    assert _delta(model, nope) <= 1e-9
    assert not torch.allclose(
        nope.state_dict()["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.q_proj.weight"]
    )
    with pytest.raises(NotASymmetry, match="does not commute with RoPE"):
        generic_on(0, check=True)
    assert _delta(model, generic_on(0, check=False)) > 1e-3


@pytest.mark.parametrize("family,wrong_layout", [("llama", "interleaved"), ("gptj", "rotate_half")])
def test_wrong_pairing_layout_breaks_the_model(family, wrong_layout, exact_rmsnorm):
    model = tiny_model(family)

    def interleaved_commutant(adapter, layer):
        wrong = HeadLayout(**{**adapter.layout.__dict__, "rope_layout": wrong_layout})
        return actions.rotate_qk(
            layer,
            adapter.layout,
            _random_rotations(adapter, lambda L, g: groups.random_rope_commutant(wrong, g)),
            check=False,
        )

    assert _delta(model, _apply(model, interleaved_commutant)) > 1e-3


def test_reflection_inside_a_rope_pair_breaks_the_model(exact_rmsnorm):
    model = tiny_model("llama")

    def reflect(adapter, layer, check=False):
        L = adapter.layout
        R = torch.eye(L.head_dim, dtype=torch.float64)
        i, j = L.rope_pairs()[0]
        R[[i, j]] = R[[j, i]]  # swap within a pair: orthogonal, det -1 on the pair
        return actions.rotate_qk(layer, L, [R] * L.n_kv_heads, check=check)

    assert _delta(model, _apply(model, reflect)) > 1e-3
    with pytest.raises(NotASymmetry, match="does not commute with RoPE"):
        _apply(model, lambda a, layer: reflect(a, layer, check=True))


def test_qk_rotation_under_qk_norm_is_refused_and_would_break_the_model(exact_rmsnorm):
    model = tiny_model("qwen3")

    def commutant_rotation(adapter, layer, check):
        return actions.rotate_qk(
            layer, adapter.layout, _random_rotations(adapter, groups.random_rope_commutant), check=check
        )

    with pytest.raises(NotASymmetry, match="QK-norm"):
        _apply(model, lambda a, layer: commutant_rotation(a, layer, True))
    assert _delta(model, _apply(model, lambda a, layer: commutant_rotation(a, layer, False))) > 1e-3
    with pytest.raises(UnsupportedSymmetry, match="QK-norm"):
        rotate_state_dict(model.state_dict(), model.config, RotateOptions(residual="none", heads="random"))


def test_rotation_without_norm_fusion_is_refused_and_would_break_the_model(exact_rmsnorm):
    model = tiny_model("llama")
    Q = groups.haar_orthogonal(model.config.hidden_size, groups.rng(0))
    with pytest.raises(NotASymmetry, match="folded"):
        _apply(model, lambda a, layer: actions.rotate_residual_layer(layer, Q))


def test_ffn_rotation_is_not_a_symmetry():
    """Element-wise activations commute with permutations only: a rotation of the FFN hidden
    space (applied like a permutation would be) changes the function."""
    model = tiny_model("gpt2")

    def rotate_hidden(adapter, layer):
        n = layer["up.weight"].shape[0]
        P = groups.haar_orthogonal(n, groups.rng(5))
        out = dict(layer)
        out["up.weight"], out["up.bias"] = P.T @ layer["up.weight"], P.T @ layer["up.bias"]
        out["down.weight"] = layer["down.weight"] @ P
        return out

    assert _delta(model, _apply(model, rotate_hidden)) > 1e-3


@pytest.mark.parametrize("family,message", [("bert", "post-LN"), ("roberta", "post-LN")])
def test_residual_rotation_refused_where_not_a_symmetry(family, message):
    model = tiny_model(family)
    with pytest.raises(UnsupportedSymmetry, match=message):
        rotate_state_dict(model.state_dict(), model.config, RotateOptions(residual="hadamard"))


def test_unsupported_model_type_names_supported_families():
    with pytest.raises(ValueError, match="supports: llama, mistral, qwen2"):
        Adapter.from_config({"model_type": "mamba", "hidden_size": 8})


def test_bf16_round_trip_keeps_dtype():
    model = tiny_model("llama", dtype=torch.bfloat16)
    sd, _ = rotate_state_dict(model.state_dict(), model.config, RotateOptions())
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}


def test_partial_rotary_free_dims_must_not_mix_with_rotary_dims(exact_rmsnorm):
    """GPT-J rotates 6 of 8 head dims: O(2) on the last two is a symmetry (covered above);
    swapping a rotary dim with a free one is not, and the engine refuses it."""
    model = tiny_model("gptj")

    def mix(adapter, layer, check=False):
        L = adapter.layout
        R = torch.eye(L.head_dim, dtype=torch.float64)
        R[[0, L.head_dim - 1]] = R[[L.head_dim - 1, 0]]
        return actions.rotate_qk(layer, L, [R] * L.n_kv_heads, check=check)

    assert _delta(model, _apply(model, mix)) > 1e-3
    with pytest.raises(NotASymmetry, match="does not commute with RoPE"):
        _apply(model, lambda a, layer: mix(a, layer, check=True))
