"""Equal-parameter T6 / MHA / GQA / MLA configurations (the TPA paper's comparison setup)."""

from __future__ import annotations

import pytest
import torch

from hf_symmetry.training.tpa_paper_configs import (
    ARCHS,
    build_model,
    count_non_embedding_parameters,
    equal_size_configs,
    kv_cache_elements,
    parse_parameter_count,
)


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("size", ["1M", "5M", "10M", "20M", "124M", "350M"])
def test_counts_agree_within_one_percent(size):
    plan = equal_size_configs(size, vocab_size=49152)
    print(plan.table())
    ref = plan.parameters["mha"]
    for arch in ARCHS:
        cfg = plan.configs[arch]
        assert abs(plan.parameters[arch] - ref) / ref <= 0.01, arch
        assert count_non_embedding_parameters(cfg) == plan.parameters[arch]
        # same depth, width and FFN everywhere; d_h = 64 as in the paper
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (
            plan.num_hidden_layers,
            plan.hidden_size,
            plan.configs["mha"].intermediate_size,
        )
        assert cfg.tie_word_embeddings
    assert abs(ref - parse_parameter_count(size)) / parse_parameter_count(size) < 0.3
    c = plan.configs
    assert c["mha"].num_attention_heads * 64 == plan.hidden_size
    assert c["gqa"].num_key_value_heads == 2 and c["gqa"].head_dim == 64
    assert (c["t6"].q_rank, c["t6"].k_rank, c["t6"].v_rank, c["t6"].head_dim) == (6, 2, 2, 64)
    assert c["mla"].qk_rope_head_dim == 32 and c["mla"].first_k_dense_replace == c["mla"].num_hidden_layers
    # what each mechanism caches per token (all layers): MHA is the largest
    kv = {a: kv_cache_elements(c[a]) for a in ARCHS}
    assert kv["mha"] == 2 * plan.hidden_size * plan.num_hidden_layers
    assert max(kv, key=kv.get) == "mha"


def test_counts_are_real_parameter_counts():
    """The count is taken from the instantiated model, not a formula: it equals a materialised model's."""
    plan = equal_size_configs("400k", vocab_size=97)
    for arch in ARCHS:
        model = build_model(plan.configs[arch])
        embed = model.get_input_embeddings().weight.numel()
        assert sum(p.numel() for p in model.parameters()) - embed == plan.parameters[arch]


def test_mla_has_no_moe_and_mtp():
    plan = equal_size_configs("400k", vocab_size=97, archs=("mla",))
    model = build_model(plan.configs["mla"])
    names = [n for n, _ in model.named_modules()]
    assert not any("experts" in n or "gate.weight" in n for n in names)
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"


@pytest.mark.parametrize("bad,match", [("abc", "suffix"), ("5", "too small"), ("20Q", "suffix")])
def test_bad_sizes_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        equal_size_configs(bad, vocab_size=97)


def test_unknown_architecture_and_too_narrow_t6_are_refused():
    with pytest.raises(ValueError, match="unknown architecture"):
        equal_size_configs("1M", vocab_size=97, archs=("mqa",))
    with pytest.raises(ValueError, match="too small for a T6"):
        equal_size_configs("1M", vocab_size=97, hidden_size=128)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_config_overfits_a_fixed_batch(arch):
    plan = equal_size_configs("400k", vocab_size=97, archs=(arch,), max_position_embeddings=64)
    torch.manual_seed(0)
    model = build_model(plan.configs[arch]).train()
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[3] < losses[0] - 0.05, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
