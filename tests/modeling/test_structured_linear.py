"""The structured linears of ``hf_symmetry.modeling.structured_linear``: declared once (issue 46: one registry
from which the config's types, ``--structure``'s choices, the sizing options and PEFT's targets derive) and
fast (issue 47: every forward equals its ``dense_weight()`` product to the float32 floor, eager and compiled)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from hf_symmetry.conversion.compress import options
from hf_symmetry.modeling import structured_linear as SL
from hf_symmetry.modeling.configuration_compressed_llama import CompressedLlamaConfig
from hf_symmetry.solvers import structures as st
from hf_symmetry.training import peft_targets

#: the state-dict names of each type (checkpoints written before the registry hold exactly these)
STATE_NAMES = {
    "dense": {"weight"},
    "kron": {"kron_a", "kron_b"},
    "gs": {"gs_left", "gs_right"},
    "lowrank": {"lr_u", "lr_v"},
}
SPECS = {
    "dense": {"type": "dense"},
    "kron": {"type": "kron", "rank": 2, "a_shape": [4, 3]},
    "gs": {"type": "gs", "rank": 2, "blocks": [2, 3]},
    "lowrank": {"type": "lowrank", "rank": 5},
}


# ----------------------------------------------------------------------------- one registry (issue 46)
def test_everything_that_names_structures_derives_from_the_registry():
    assert SL.STRUCTURE_TYPES == tuple(SL.LINEAR_CLASSES) == ("dense", "kron", "gs", "lowrank")
    assert set(st.CLASSES) == set(SL.LINEAR_CLASSES)  # every solver class has its module class and back
    assert options.STRUCTURES == ("kron", "gs", "lowrank")  # the structure classes, dense aside
    assert options.STRUCTURE_CHOICES == ("kron", "gs", "lowrank", "slice")  # `compress --help` keeps its order
    fields = {f.name for f in dataclasses.fields(options.CompressOptions)}
    assert set(options._SIZING_OPTIONS.values()) <= fields
    assert set(peft_targets.STRUCTURED_CLASSES) == {c.__name__ for c in SL.LINEAR_CLASSES.values()}


@pytest.mark.parametrize("kind", list(SPECS))
def test_the_factory_builds_each_type_with_its_state_dict_names(kind):
    module = SL.structured_linear(12, 8, {**SPECS[kind], "bias": True})
    assert type(module) is SL.LINEAR_CLASSES[kind] and module.kind == kind
    assert set(module.state_dict()) == STATE_NAMES[kind] | {"bias"}
    module.init_weights(0.02)
    assert module.bias.abs().max() == 0 and module.dense_weight().abs().max() > 0
    assert peft_targets.is_structured_linear(module)


def test_a_class_defined_with_a_kind_is_registered_and_configs_accept_it(monkeypatch):
    monkeypatch.setattr(SL, "LINEAR_CLASSES", dict(SL.LINEAR_CLASSES))  # the registration is undone after

    class Scaled(SL.DenseLinear):
        kind = "scaled_test"

    spec = {"type": "scaled_test"}
    assert type(SL.structured_linear(4, 4, spec)) is Scaled
    SL.check_entry("entry", spec)
    # negative control: a type no class names is refused by the factory and by config validation
    with pytest.raises(ValueError, match="unknown structure type"):
        SL.structured_linear(4, 4, {"type": "nope"})
    with pytest.raises(ValueError, match="'type' in"):
        SL.check_entry("entry", {"type": "nope"})
    with pytest.raises(ValueError, match=r"lacks \['a_shape'\]"):
        CompressedLlamaConfig(embed_structure={"type": "kron", "rank": 2})


def test_peft_matches_a_remote_code_copy_by_name_and_not_an_unrelated_module():
    remote = type("KroneckerLinear", (torch.nn.Module,), {})()  # a class of the same name from another module
    assert peft_targets.is_structured_linear(remote)
    assert not peft_targets.is_structured_linear(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- fast forwards (issue 47)
#: (type, in, out, spec): a reader's Kronecker split (A 1 x q: A first), a writer's (A q x 1: B first), general
#: splits taking each order, GS tiles, low rank and dense, each with a bias
FORWARDS = [
    ("kron_reader", 24, 20, {"type": "kron", "rank": 3, "a_shape": [1, 4]}),
    ("kron_writer", 20, 24, {"type": "kron", "rank": 3, "a_shape": [4, 1]}),
    ("kron_general_a_first", 24, 30, {"type": "kron", "rank": 2, "a_shape": [3, 4]}),
    ("kron_general_b_first", 24, 30, {"type": "kron", "rank": 2, "a_shape": [15, 2]}),
    ("gs", 24, 20, {"type": "gs", "rank": 3, "blocks": [4, 2]}),
    ("gs_one_row_block", 24, 20, {"type": "gs", "rank": 3, "blocks": [1, 3]}),
    ("lowrank", 24, 20, {"type": "lowrank", "rank": 5}),
    ("dense", 24, 20, {"type": "dense"}),
]


def _module(in_features, out_features, spec, seed=0):
    torch.manual_seed(seed)
    module = SL.structured_linear(in_features, out_features, {**spec, "bias": True})
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module.eval()


def _relative_error(forward, module, x) -> tuple[float, float]:
    """(error of ``forward(x)``, error of the dense float32 product) against the float64 product of
    ``dense_weight()``, both relative to the largest output: the second is the float32 floor at this shape."""
    with torch.no_grad():
        W, b = module.dense_weight().double(), module.bias.double()
        ref = x.double() @ W.T + b
        scale = ref.abs().max().item()
        floor = (torch.nn.functional.linear(x, module.dense_weight(), module.bias).double() - ref).abs().max().item()
        got = (forward(x).double() - ref).abs().max().item()
    return got / scale, max(floor / scale, torch.finfo(torch.float32).eps)


def _check_forward(forward, module, x):
    err, floor = _relative_error(forward, module, x)
    assert err <= 16 * floor, f"relative error {err:.2e} against a float32 floor of {floor:.2e}"


@pytest.mark.parametrize("name,n_in,n_out,spec", FORWARDS, ids=[f[0] for f in FORWARDS])
@pytest.mark.parametrize("tokens", [1, 7])
def test_each_forward_equals_its_dense_weight_product_to_the_float32_floor(name, n_in, n_out, spec, tokens):
    module = _module(n_in, n_out, spec)
    if name.startswith("kron"):
        assert module.a_first == name.endswith(("reader", "a_first"))
    x = torch.randn(2, tokens, n_in, generator=torch.Generator().manual_seed(1))
    _check_forward(module, module, x)


def test_a_wrong_factor_order_or_an_unshuffled_gs_fails_the_same_bound():
    """Negative controls: the bound catches a Kronecker forward that reads the input's blocks in the wrong
    order (``x[t, j2, j1]`` for ``x[t, j1, j2]``) and a GS forward without its shuffle."""
    kron = _module(24, 20, FORWARDS[0][3])
    (m1, n1), (m2, n2), r = kron.a_shape, kron.b_shape, kron.rank

    def wrong_order(x):
        x = x.reshape(-1, n2, n1).transpose(1, 2)
        u = torch.matmul(kron.kron_a.reshape(m1 * r, n1), x)
        return torch.nn.functional.linear(u.reshape(-1, r * n2), kron.kron_b.reshape(m2, r * n2), kron.bias)

    gs = _module(24, 20, FORWARDS[4][3])

    def unshuffled(x):
        x = x.reshape(-1, gs.in_features)
        N, kl, kr, b = x.shape[0], gs.kl, gs.kr, gs.rank
        h = torch.bmm(x.view(N, kr, -1).transpose(0, 1), gs.gs_right.transpose(1, 2))  # [kr, N, (i, c)]
        h = h.reshape(kl, N, kr * b)  # the shuffle left out
        return torch.bmm(h, gs.gs_left.transpose(1, 2)).transpose(0, 1).reshape(N, -1) + gs.bias

    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(1))
    for forward, module in ((wrong_order, kron), (unshuffled, gs)):
        with pytest.raises(AssertionError, match="relative error"):
            _check_forward(forward, module, x)


@pytest.mark.parametrize("name,n_in,n_out,spec", FORWARDS, ids=[f[0] for f in FORWARDS])
@pytest.mark.parametrize("lead", [(), (1,), (1, 1)], ids=["vector", "row", "batch_row"])
def test_one_token_forwards_equal_the_dense_weight_product(name, n_in, n_out, spec, lead):
    """One token (decoding: GS's own path, by the input's size) on every leading shape a caller passes."""
    module = _module(n_in, n_out, spec)
    x = torch.randn(*lead, n_in, generator=torch.Generator().manual_seed(1))
    assert module(x).shape == (*lead, n_out)
    _check_forward(module, module, x)


def test_an_unshuffled_one_token_gs_fails_the_same_bound():
    """Negative control of GS's one-token path: its shuffle left out."""
    gs = _module(24, 20, FORWARDS[4][3])

    def unshuffled(x):
        kl, kr, b = gs.kl, gs.kr, gs.rank
        q, p = gs.in_features // kr, gs.out_features // kl
        y1 = torch.mm(gs.gs_right.view(kr * kl * b, q), x.reshape(kr, q).t())
        h = y1.view(kr, kl * b, kr).diagonal(0, 0, 2).reshape(kl, kr * b)  # [(i, c), j] read as [i, (j, c)]
        y2 = torch.mm(gs.gs_left.view(kl * p, kr * b), h.t())
        return y2.view(kl, p, kl).diagonal(0, 0, 2).t().reshape(-1) + gs.bias

    with pytest.raises(AssertionError, match="relative error"):
        _check_forward(unshuffled, gs, torch.randn(24, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", ["kron_reader", "kron_writer", "gs", "gs_one_row_block"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_compiled_forwards_equal_the_dense_weight_product(name, tokens):
    _, n_in, n_out, spec = next(f for f in FORWARDS if f[0] == name)
    module = _module(n_in, n_out, spec)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    _check_forward(compiled, module, torch.randn(1, tokens, n_in, generator=torch.Generator().manual_seed(1)))


@pytest.fixture
def threads():
    """Set torch's thread count for one test (GS's many-token path depends on it), restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


GS_FORWARDS = [f for f in FORWARDS if f[0].startswith("gs")]


@pytest.mark.parametrize("name,n_in,n_out,spec", GS_FORWARDS, ids=[f[0] for f in GS_FORWARDS])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_gs_many_tokens_take_the_accumulated_path_on_one_thread_and_equal_the_dense_product(
    name, n_in, n_out, spec, n_threads, threads
):
    """From ``accumulate_from`` tokens, one CPU thread, several row blocks and no autograd, GS runs its
    accumulated products (no copy), otherwise its batched matmuls; both equal the ``dense_weight()`` product to
    the float32 floor, on a 3-d input, a 2-d one and a non-contiguous one (a column slice)."""
    threads(n_threads)
    module = _module(n_in, n_out, spec)
    tokens = SL.GSLinear.accumulate_from
    x = torch.randn(2, tokens, n_in, generator=torch.Generator().manual_seed(1))
    wide = torch.randn(tokens, 2 * n_in, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert module._accumulates(x) == (n_threads == 1 and module.kl > 1)
        # the accumulated products themselves (the forward adds the bias), whichever path the forward took
        accumulated = module._accumulated(x.reshape(-1, n_in)).view(*x.shape[:-1], -1) + module.bias
        _check_forward(lambda inp: accumulated, module, x)
        assert not module._accumulates(x[:, :1])  # fewer tokens: the batched matmuls
        for inp in (x, x[0], wide[:, 1 : n_in + 1]):
            _check_forward(module, module, inp)
    assert not module._accumulates(x)  # autograd on: the batched matmuls (out= products have no gradient)
    module(x).sum().backward()
    assert module.gs_left.grad is not None and module.gs_right.grad is not None


def _perturbed(module, name):
    """A copy of ``module`` with one entry of its parameter ``name`` moved by 1e-3 (entries are about 1)."""
    changed = copy.deepcopy(module)
    with torch.no_grad():
        getattr(changed, name).view(-1)[0] += 1e-3
    return changed


STRUCTURED = [f for f in FORWARDS if f[0] != "dense"]


@pytest.mark.parametrize("name,n_in,n_out,spec", STRUCTURED, ids=[f[0] for f in STRUCTURED])
@pytest.mark.parametrize("tokens", [1, 7, 256], ids=["one_token", "tokens", "accumulated"])
def test_a_factor_moved_by_1e3_fails_the_bound_on_every_path(name, n_in, n_out, spec, tokens, threads):
    """Negative control of every forward path (one token, a few, GS's accumulated products on one thread):
    each factor moved in one entry by 1e-3 gives an output the float32 bound rejects against the unmoved
    module, so the bound would catch a fast path that dropped or misplaced a term."""
    threads(1)
    module = _module(n_in, n_out, spec)
    x = torch.randn(tokens, n_in, generator=torch.Generator().manual_seed(1))
    if name.startswith("gs"):
        with torch.no_grad():
            assert module._accumulates(x) == (tokens >= SL.GSLinear.accumulate_from and module.kl > 1)
    for factor, _ in module.named_parameters():
        if factor != "bias":
            with pytest.raises(AssertionError, match="relative error"):
                _check_forward(_perturbed(module, factor), module, x)


@pytest.mark.parametrize("name", ["gs", "gs_one_row_block"])
def test_compiled_gs_on_many_tokens_equals_the_dense_weight_product(name, threads):
    """Compiled GS from ``accumulate_from`` tokens on one thread (its batched matmuls: a static branch), with
    the negative control of a moved factor."""
    threads(1)
    _, n_in, n_out, spec = next(f for f in FORWARDS if f[0] == name)
    module = _module(n_in, n_out, spec)
    x = torch.randn(1, SL.GSLinear.accumulate_from, n_in, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _check_forward(torch.compile(module, fullgraph=True, dynamic=False), module, x)
        changed = torch.compile(_perturbed(module, "gs_left"), fullgraph=True, dynamic=False)
        with pytest.raises(AssertionError, match="relative error"):
            _check_forward(changed, module, x)


@pytest.mark.parametrize("blocks", [(1, 3), (4, 2)], ids=["one_row_block", "row_blocks"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gs_rows_are_the_dense_weight_rows(blocks, compiled):
    """Embedding lookups of GS: one row block (an embedding's plan: one product, no selection) and several,
    eager and compiled, equal the rows of ``dense_weight()``; negative control: the one-block product read
    without its transposes (token-major) is caught."""
    gs = _module(24, 20, {"type": "gs", "rank": 3, "blocks": list(blocks)})
    ids = torch.tensor([[0, 7, 19], [3, 3, 11]])
    rows = torch.compile(gs.rows, fullgraph=True, dynamic=False) if compiled else gs.rows
    with torch.no_grad():
        dense = gs.dense_weight()
        assert (rows(ids) - dense[ids]).abs().max() <= 1e-5 * dense.abs().max()
        if blocks[0] == 1:
            left = gs.gs_left[0][ids.reshape(-1)].view(-1, gs.kr, gs.rank).transpose(0, 1)
            wrong = torch.bmm(left, gs.gs_right).reshape(*ids.shape, -1)
            assert (wrong - dense[ids]).abs().max() > 1e-2 * dense.abs().max()


def test_compress_warns_where_a_structure_measured_slower_than_dense_when_decoding():
    from hf_symmetry.commands.compress import decode_speed_warning

    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    wide = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8}
    assert "192x576" in decode_speed_warning("kron", smollm2) and "gs" in decode_speed_warning("gs", smollm2)
    assert decode_speed_warning("lowrank", smollm2) is None  # 192x576 measured at least as fast as dense
    assert decode_speed_warning("kron", wide) is None and decode_speed_warning("gs", wide) is None
    assert decode_speed_warning("slice", smollm2) is None
