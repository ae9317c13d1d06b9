"""The structured linears of ``hf_symmetry.modeling.structured_linear``: declared once (issue 46: one registry
from which the config's types, ``--structure``'s choices, the sizing options and PEFT's targets derive) and
fast (issue 47: every forward equals its ``dense_weight()`` product to the float32 floor, eager and compiled)."""

from __future__ import annotations

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
    assert options.STRUCTURES == ("kron", "gs", "lowrank", "slice")  # `compress --help` keeps its order
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
    SL.check_spec("entry", spec)
    # negative control: a type no class names is refused by the factory and by config validation
    with pytest.raises(ValueError, match="unknown structure type"):
        SL.structured_linear(4, 4, {"type": "nope"})
    with pytest.raises(ValueError, match="'type' in"):
        SL.check_spec("entry", {"type": "nope"})
    with pytest.raises(ValueError, match=r"lacks \['a_shape'\]"):
        CompressedLlamaConfig(embed_structure={"type": "kron", "rank": 2})


def test_peft_matches_a_remote_code_copy_by_name_and_not_an_unrelated_module():
    remote = type("KroneckerLinear", (torch.nn.Module,), {})()  # a class of the same name from another module
    assert peft_targets.is_structured_linear(remote)
    assert not peft_targets.is_structured_linear(torch.nn.Linear(2, 2))
