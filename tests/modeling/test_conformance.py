"""Conformance of every causal-LM family with what transformers users rely on, with a stock
``LlamaForCausalLM`` as the control (issue 37): recorded outputs (attentions, hidden states, tuples),
packed sequences, left-padded batches, beam search and assisted decoding, save/load, gradient
checkpointing, eager vs SDPA, static vs dynamic cache, a fullgraph-compiled decode, ``torch.export``,
``resize_token_embeddings`` and a CPU+disk device map. Each check is a function that raises
``AssertionError``; tests/modeling/test_conformance_controls.py plants the defect each one is there to catch and
shows that the check fails on it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conformance_models import FAMILIES, PAD, V, family_model, ids, left_pad
from hf_symmetry.modeling import cache_field

GEN = dict(do_sample=False, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True)


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    """One intra-op thread: the tiny models gain nothing from two, and the machine is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close(a, b, atol=1e-5, what=""):
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    err = (a.float() - b.float()).abs().max().item()
    assert err <= atol, f"{what}: max |difference| {err:.3g} > {atol}"


def _same_generation(got, want, what: str, atol: float = 1e-4) -> None:
    assert torch.equal(got.sequences, want.sequences), f"{what}: {got.sequences.tolist()} != {want.sequences.tolist()}"
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)), f"{what}: step {step} masks other tokens"
        _close(a[finite], b[finite], atol, f"{what}, scores of step {step}")


# ------------------------------------------------------------------------------------------------- checks
def check_outputs(model) -> None:
    """``output_attentions`` / ``output_hidden_states`` give one causal, padding-aware attention map per
    layer and the ``L + 1`` hidden states (each layer's input, then the final normed state);
    ``return_dict=False`` gives the tuple, loss first when labels are given."""
    L, x = model.config.num_hidden_layers, ids(2, 7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    seen: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
        for layer in model.model.layers
    ]
    first = model.model.layers[0]
    hooks.append(
        first.register_forward_pre_hook(
            lambda m, a, kw: seen.insert(0, a[0] if a else kw["hidden_states"]), with_kwargs=True
        )
    )
    try:
        with torch.no_grad():
            out = model(
                input_ids=x, attention_mask=mask, output_attentions=True, output_hidden_states=True, use_cache=False
            )
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        base = model.model(input_ids=x, attention_mask=mask, use_cache=False).last_hidden_state
        tup = model(input_ids=x, attention_mask=mask, use_cache=False, return_dict=False)
        with_loss = model(input_ids=x, labels=x, use_cache=False, return_dict=False)
    assert out.attentions is not None and len(out.attentions) == L, "no attention map per layer"
    for i, a in enumerate(out.attentions):
        assert a.shape == (2, model.config.num_attention_heads, 7, 7), f"layer {i}: attention shape {tuple(a.shape)}"
        _close(a.sum(-1), torch.ones_like(a.sum(-1)), 1e-5, f"layer {i}: attention rows")
        real = a[0, :, 2:, 2:]  # row 0 starts with two pads, row 1 has none
        assert a[1].triu(1).abs().max() == 0 and real.triu(1).abs().max() == 0, f"layer {i}: attends to the future"
        assert a[0, :, 2:, :2].abs().max() == 0, f"layer {i}: attends to padding"
    assert out.hidden_states is not None and len(out.hidden_states) == L + 1, "no L + 1 hidden states"
    for i in range(L):  # the input of layer i, as the layer saw it
        _close(out.hidden_states[i], seen[i], 0, f"hidden state {i}")
    _close(out.hidden_states[-1], base, 0, "last hidden state")
    assert isinstance(tup, tuple), f"return_dict=False gave {type(tup).__name__}"
    _close(tup[0], out.logits, 0, "return_dict=False logits")
    assert isinstance(with_loss, tuple) and with_loss[0].ndim == 0 and with_loss[1].shape == out.logits.shape


def check_packed(model) -> None:
    """Sequences packed in one row with restarting ``position_ids`` (``DataCollatorWithFlattening``) give
    the logits of the same sequences right-padded in a batch."""
    seqs = [ids(1, 5, seed=1)[0], ids(1, 8, seed=2)[0], ids(1, 3, seed=3)[0]]
    packed = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    n = max(len(s) for s in seqs)
    padded = torch.full((len(seqs), n), PAD)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        got = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0]
        want = model(input_ids=padded, attention_mask=mask, use_cache=False).logits
    _close(got, torch.cat([want[i, : len(s)] for i, s in enumerate(seqs)]), 1e-5, "packed vs padded logits")


def check_left_padded_greedy(model) -> None:
    """Greedy generation of a left-padded batch gives each prompt's own continuation and scores."""
    seqs = [ids(1, 4, seed=3)[0], ids(1, 9, seed=4)[0]]
    batch, mask = left_pad(seqs)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=6, **GEN)
        for i, s in enumerate(seqs):
            alone = model.generate(
                s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), max_new_tokens=6, **GEN
            )
            assert torch.equal(out.sequences[i, -6:], alone.sequences[0, -6:]), f"prompt {i}: batched greedy differs"
            for step, (a, b) in enumerate(zip(out.scores, alone.scores)):
                _close(a[i], b[0], 1e-4, f"prompt {i}, step {step}")


def check_beam_search(model) -> None:
    """Beam search with the cache equals beam search without it, and returns per-step attentions and
    hidden states when asked (eager attention)."""
    x, L = ids(1, 6, seed=5), model.config.num_hidden_layers
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=5, **GEN)
    with torch.no_grad():
        cached = model.generate(x, output_attentions=True, output_hidden_states=True, **kw)
        uncached = model.generate(x, use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences), "beam search with the cache differs"
    _close(cached.sequences_scores, uncached.sequences_scores, 1e-4, "beam scores")
    assert cached.attentions is not None and len(cached.attentions) == 5, "no attentions per generated token"
    assert all(len(step) == L and all(a is not None for a in step) for step in cached.attentions)
    assert cached.hidden_states is not None and all(len(step) == L + 1 for step in cached.hidden_states)


def check_assisted(model, assistant) -> None:
    """Assisted decoding (an assistant of the same family that is often wrong) gives the greedy text,
    also when attentions and hidden states are requested."""
    x, L = ids(1, 6, seed=6), model.config.num_hidden_layers
    with torch.no_grad():
        greedy = model.generate(x, max_new_tokens=8, **GEN)
        assisted = model.generate(
            x, assistant_model=assistant, max_new_tokens=8, output_attentions=True, output_hidden_states=True, **GEN
        )
    assert torch.equal(assisted.sequences, greedy.sequences), "assisted decoding differs from greedy"
    assert assisted.attentions is not None and all(len(step) == L for step in assisted.attentions)
    assert assisted.hidden_states is not None and all(len(step) == L + 1 for step in assisted.hidden_states)


def check_round_trip(model, folder) -> None:
    """``save_pretrained`` then ``AutoModelForCausalLM.from_pretrained`` gives the same logits."""
    x = ids(2, 9, seed=7)
    model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        _close(loaded(input_ids=x).logits, model(input_ids=x).logits, 0, "reloaded logits")


def check_gradient_checkpointing(model) -> None:
    """With gradient checkpointing each layer runs again in the backward pass and the gradients are
    those of the ordinary backward pass."""
    x = ids(2, 8, seed=8)
    model.train()

    def grads():
        model.zero_grad()
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads()
    # transformers 5.24 renamed gradient checkpointing to activation checkpointing
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    enable()
    # entries into a module inside each layer (the layer's own hooks stay outside the checkpoint, and the
    # recompute stops once it has what backward needs: a forward hook may never fire)
    calls = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda *a: calls.append(1)) for layer in model.model.layers]
    try:
        got = grads()
    finally:
        for h in hooks:
            h.remove()
        disable()
        model.eval()
    assert len(calls) == 2 * len(model.model.layers), f"{len(calls)} layer calls: not recomputed in backward"
    assert got.keys() == want.keys()
    for name in want:
        _close(got[name], want[name], 1e-5, f"gradient of {name}")


def check_eager_matches_sdpa(eager, sdpa) -> None:
    """The same weights under eager and SDPA attention give the same logits, with and without padding."""
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    batch, mask = left_pad([ids(1, 5, seed=9)[0], ids(1, 9, seed=10)[0]])
    with torch.no_grad():
        for m in (None, mask):
            a = eager(input_ids=batch, attention_mask=m).logits
            b = sdpa(input_ids=batch, attention_mask=m).logits
            keep = torch.ones_like(batch, dtype=torch.bool) if m is None else m.bool()
            _close(a[keep], b[keep], 1e-5, "eager vs sdpa logits")


def check_static_cache(model) -> None:
    """``cache_implementation="static"`` (a compileable cache) generates what the dynamic cache does."""
    batch, mask = left_pad([ids(1, 5, seed=11)[0], ids(1, 8, seed=12)[0]])
    with torch.no_grad():
        dynamic = model.generate(batch, attention_mask=mask, max_new_tokens=6, **GEN)
        static = model.generate(batch, attention_mask=mask, max_new_tokens=6, cache_implementation="static", **GEN)
    cache = getattr(static, cache_field())
    assert cache is not None and cache.is_compileable, f"{type(cache).__name__} is not a compileable cache"
    _same_generation(static, dynamic, "static vs dynamic cache")


def check_compiled_decoding(model) -> None:
    """The model's forward compiled with ``fullgraph=True`` (dynamo traces all of it: no graph break)
    decodes with the static cache as the eager forward does."""
    assert type(model)._can_compile_fullgraph, "_can_compile_fullgraph is False"
    batch, mask = left_pad([ids(1, 5, seed=13)[0], ids(1, 8, seed=14)[0]])
    with torch.no_grad():
        want = model.generate(batch, attention_mask=mask, max_new_tokens=4, **GEN)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        try:
            got = model.generate(batch, attention_mask=mask, max_new_tokens=4, cache_implementation="static", **GEN)
        finally:
            del model.forward
            torch._dynamo.reset()
    _same_generation(got, want, "compiled static-cache decoding vs eager")


def check_export(model, folder) -> None:
    """``torch.export`` of a freshly loaded model (nothing run eagerly before) computes its logits."""
    batch, mask = left_pad([ids(1, 5, seed=15)[0], ids(1, 8, seed=16)[0]])
    with torch.no_grad():
        want = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
    model.save_pretrained(folder)
    fresh = AutoModelForCausalLM.from_pretrained(folder).eval()
    kwargs = dict(input_ids=batch, attention_mask=mask, use_cache=False)
    with torch.no_grad():
        program = torch.export.export(fresh, args=(), kwargs=kwargs)
        got = program.module()(**kwargs)
    _close(got.logits if hasattr(got, "logits") else got[0], want, 1e-5, "exported logits")


def check_resize(model, folder) -> None:
    """``resize_token_embeddings`` grows the vocabulary of the embedding and the head (tied or not),
    keeps every old logit, and the resized model saves and reloads."""
    x = ids(2, 6, seed=17)
    with torch.no_grad():
        before = model(input_ids=x).logits
    model.resize_token_embeddings(V + 8, mean_resizing=False)
    assert model.config.vocab_size == V + 8
    with torch.no_grad():
        after = model(input_ids=x).logits
        new = model(input_ids=torch.tensor([[V + 3, 5, V + 7]])).logits
    assert after.shape[-1] == V + 8 and new.shape[-1] == V + 8, f"head has {after.shape[-1]} outputs"
    _close(after[..., :V], before, 0, "old tokens' logits after resizing")
    check_round_trip(model, folder)


def check_disk_offload(model, folder) -> None:
    """Loaded with a device map that puts the embedding and the first layer on disk (accelerate
    offload), the model computes its logits and generates its greedy text."""
    model.save_pretrained(folder / "model")
    device_map = {}
    for name, child in model.named_children():
        if name == "model":
            for sub, module in child.named_children():
                keys = [f"model.{sub}.{i}" for i in range(len(module))] if sub == "layers" else [f"model.{sub}"]
                device_map.update(dict.fromkeys(keys, "cpu"))
        else:
            device_map[name] = "cpu"
    # the first layer and the embedding on disk (and the head: it may be tied to the embedding)
    device_map.update({"model.embed_tokens": "disk", "model.layers.0": "disk"})
    device_map.update({name: "disk" for name in ("lm_head", "head_mix") if name in device_map})
    offloaded = AutoModelForCausalLM.from_pretrained(
        folder / "model", device_map=device_map, offload_folder=folder / "offload"
    ).eval()
    assert "disk" in set(offloaded.hf_device_map.values())
    x = ids(1, 6, seed=18)
    with torch.no_grad():
        _close(offloaded(input_ids=x).logits, model(input_ids=x).logits, 1e-6, "offloaded logits")
        got, want = offloaded.generate(x, max_new_tokens=4, **GEN), model.generate(x, max_new_tokens=4, **GEN)
    _same_generation(got, want, "offloaded generation")


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_attentions_hidden_states_and_tuples(family):
    check_outputs(family_model(family, attn="eager"))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_equal_padded(family):
    check_packed(family_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batched_greedy_equals_unbatched(family):
    check_left_padded_greedy(family_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search(family):
    check_beam_search(family_model(family, attn="eager"))


@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_decoding(family):
    check_assisted(family_model(family, attn="eager"), family_model(family, attn="eager", seed=3))


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip(family, tmp_path):
    check_round_trip(family_model(family), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing(family):
    check_gradient_checkpointing(family_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_matches_sdpa(family):
    check_eager_matches_sdpa(family_model(family, attn="eager"), family_model(family, attn="sdpa"))


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_equals_dynamic(family):
    check_static_cache(family_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_fullgraph_compiled_decoding(family):
    check_compiled_decoding(family_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_export(family, tmp_path):
    check_export(family_model(family), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_resize_token_embeddings(family, tmp_path):
    # the compressed family's embedding is a structured matrix, which has no rows to append: resized dense
    dense = {"embed_structure": {"type": "dense"}} if family == "compressed" else {}
    check_resize(family_model(family, **dense), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_causal_lm_class_names_generation_mixin(family):
    """transformers' rule (its test_inherits_generation_mixin): a generative class lists GenerationMixin
    among its own bases rather than getting it through a parent."""
    from transformers import GenerationMixin

    assert GenerationMixin in type(family_model(family)).__bases__


def test_fullgraph_compiled_forward_with_a_group_and_shuffle_embedding():
    """A GS embedding's row lookup groups the tokens by block (data-dependent shapes) in eager mode; compiled,
    it takes every block's rows and picks (one graph, the same logits)."""
    model = family_model("compressed", embed_structure={"type": "gs", "rank": 4, "blocks": [4, 2]})
    x = ids(2, 9, seed=19)
    with torch.no_grad():
        want = model(input_ids=x, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        try:
            got = compiled(input_ids=x, use_cache=False).logits
        finally:
            torch._dynamo.reset()
    _close(got, want, 1e-5, "compiled logits of a GS embedding")


def test_resizing_a_structured_embedding_is_refused_clearly():
    model = family_model("compressed")
    with pytest.raises(AttributeError, match="needs a dense embedding"):
        model.resize_token_embeddings(V + 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_and_disk_device_map(family, tmp_path):
    check_disk_offload(family_model(family), tmp_path)


def test_learned_position_rms_decoders_carry_no_rope_parameters_and_read_the_old_configs(tmp_path):
    """An RMS decoder with learned positions has no RoPE (so nothing offers to scale one); configs written
    before issue 37 carry a default ``rope_parameters`` all the same, which loading drops (same logits)."""
    model = family_model("rms-opt")
    assert not hasattr(model.config, "rope_parameters")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in config
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}  # as the code before wrote it
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not hasattr(loaded.config, "rope_parameters")
    x = ids(1, 7)
    with torch.no_grad():
        _close(loaded(input_ids=x).logits, model(input_ids=x).logits, 0, "logits of the old config")
    rotary = family_model("rms-neox").config.rope_parameters  # a rotary one keeps its own
    assert rotary == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
