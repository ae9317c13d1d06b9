"""Negative controls of tests/modeling/test_conformance.py: each check, run on a model with the defect it is there
to catch planted (a mask built from ``arange`` positions, a dropped attention map, an ignored
``return_dict`` or padding mask, a cache that does not reorder, crop or store, an unsaved buffer,
checkpointing that does nothing, a changed attention scale, the data-pointer cache that defeated
``torch.compile`` and ``torch.export``, a stale skip matrix after loading, a head left out of resizing,
an embedding lookup that bypasses accelerate's hooks), fails."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from transformers import cache_utils

import test_conformance as C
from conformance_models import family_model
from hf_symmetry.modeling import modeling_compressed_llama, modeling_rms_decoder


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _wrap_forward(model, change):
    """``model.forward`` with its keyword arguments passed through ``change`` first (signature kept, as
    ``generate`` inspects it)."""
    real = model.forward

    @functools.wraps(real)
    def forward(*args, **kwargs):
        return real(*args, **change(kwargs))

    model.forward = forward
    return model


def _old_skip_matrix(self):
    """OrthogonalSkip.matrix before issue 37: S cached on the parameters' data pointers and versions."""
    key = (self.skip_k.data_ptr(), self.skip_k._version, self.skip_signs.data_ptr(), self.skip_signs._version)
    if getattr(self, "_old_cache", None) is None or self._old_cache[0] != key:
        with torch.no_grad():
            self._old_cache = (key, modeling_compressed_llama.cayley_decode(self.skip_k.detach(), self.skip_signs))
    return self._old_cache[1]


def test_outputs_check_catches_a_dropped_attention_map_and_an_ignored_return_dict():
    model = family_model("rms-opt", attn="eager")
    attn = model.model.layers[0].self_attn
    real = attn.forward
    attn.forward = lambda *a, **k: (real(*a, **k)[0], None)  # the layer drops its weights
    with pytest.raises(AssertionError, match="attention map"):
        C.check_outputs(model)
    del attn.forward
    _wrap_forward(model, lambda kw: {k: v for k, v in kw.items() if k != "return_dict"})
    with pytest.raises(AssertionError, match="return_dict=False"):
        C.check_outputs(model)


@pytest.mark.parametrize("family", ["llama", "rms-opt"])
def test_packed_check_catches_a_mask_built_from_arange_positions(family, monkeypatch):
    model = family_model(family)
    module_globals = inspect.unwrap(type(model.model).forward).__globals__
    real = module_globals["create_causal_mask"]

    def from_arange(config, inputs_embeds, attention_mask, cache, position_ids=None, **kwargs):
        arange = torch.arange(inputs_embeds.shape[1])[None]  # what the RMS decoder did
        return real(config, inputs_embeds, attention_mask, cache, arange, **kwargs)

    monkeypatch.setitem(module_globals, "create_causal_mask", from_arange)
    with pytest.raises(AssertionError, match="packed"):
        C.check_packed(model)


@pytest.mark.parametrize("family", ["llama", "rms-opt"])
def test_left_padding_check_catches_a_model_that_ignores_the_mask(family):
    model = _wrap_forward(family_model(family), lambda kw: {**kw, "attention_mask": None})
    with pytest.raises(AssertionError, match="batched greedy differs|prompt"):
        C.check_left_padded_greedy(model)


def test_beam_check_catches_a_cache_that_is_not_reordered(monkeypatch):
    monkeypatch.setattr(cache_utils.DynamicLayer, "reorder_cache", lambda self, beam_idx: None)
    with pytest.raises(AssertionError, match="beam"):
        C.check_beam_search(family_model("rms-opt", attn="eager"))


def test_assisted_check_catches_a_cache_that_keeps_rejected_tokens(monkeypatch):
    monkeypatch.setattr(cache_utils.DynamicLayer, "crop", lambda self, tokens_to_remove: None)
    with pytest.raises(AssertionError, match="assisted"):
        C.check_assisted(family_model("rms-opt", attn="eager"), family_model("rms-opt", attn="eager", seed=3))


def test_round_trip_check_catches_a_buffer_that_is_not_saved(tmp_path):
    model = family_model("rms-opt")
    skip = model.model.layers[1].attn_skip
    with torch.no_grad():
        skip.skip_signs.copy_(torch.tensor([(-1.0) ** (i % 3 == 0) for i in range(skip.dim)]))
    skip._non_persistent_buffers_set.add("skip_signs")  # the signs would be lost on saving
    with pytest.raises(AssertionError, match="reloaded logits"):
        C.check_round_trip(model, tmp_path)


def test_checkpointing_check_catches_checkpointing_that_does_nothing():
    model = family_model("rms-opt")
    model.activation_checkpointing_enable = model.gradient_checkpointing_enable = lambda *a, **k: None
    with pytest.raises(AssertionError, match="not recomputed"):
        C.check_gradient_checkpointing(model)


def test_eager_sdpa_check_catches_a_different_attention_scale():
    sdpa = family_model("rms-opt", attn="sdpa")
    sdpa.model.layers[0].self_attn.scaling *= 1.05
    with pytest.raises(AssertionError, match="eager vs sdpa"):
        C.check_eager_matches_sdpa(family_model("rms-opt", attn="eager"), sdpa)


def test_static_cache_check_catches_a_cache_that_drops_values(monkeypatch):
    real = cache_utils.StaticLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        return real(self, key_states, torch.zeros_like(value_states), *args, **kwargs)

    monkeypatch.setattr(cache_utils.StaticLayer, "update", update)
    with pytest.raises(AssertionError, match="static vs dynamic"):
        C.check_static_cache(family_model("rms-opt"))


@pytest.mark.parametrize("module", [modeling_compressed_llama, modeling_rms_decoder], ids=["compressed", "rms-opt"])
def test_compile_and_export_checks_catch_the_data_pointer_skip_cache(module, monkeypatch, tmp_path):
    monkeypatch.setattr(module.OrthogonalSkip, "matrix", _old_skip_matrix)
    family = "compressed" if module is modeling_compressed_llama else "rms-opt"
    with pytest.raises(Exception, match="(?i)data.?p(tr|ointer)"):
        C.check_compiled_decoding(family_model(family))
    with pytest.raises(Exception, match="(?i)data.?p(tr|ointer)"):
        C.check_export(family_model(family), tmp_path)


def test_export_check_catches_a_skip_matrix_left_stale_by_loading(monkeypatch, tmp_path):
    model = family_model("compressed")
    model(input_ids=C.ids(1, 4))  # the eager reference forms its matrices
    monkeypatch.setattr(modeling_compressed_llama.OrthogonalSkip, "refresh", lambda self: None)
    with pytest.raises(AssertionError, match="exported logits"):
        C.check_export(model, tmp_path)


def test_resize_check_catches_a_head_left_out(tmp_path):
    model = family_model("rms-neox")
    model.get_output_embeddings = lambda: None
    with pytest.raises(AssertionError, match="outputs"):
        C.check_resize(model, tmp_path)


def test_offload_check_catches_an_embedding_lookup_that_bypasses_the_hooks(monkeypatch, tmp_path):
    monkeypatch.setattr(modeling_rms_decoder.StructuredEmbedding, "forward", lambda self, ids: self.matrix.rows(ids))
    with pytest.raises(NotImplementedError, match="meta"):
        C.check_disk_offload(family_model("rms-opt"), tmp_path)
