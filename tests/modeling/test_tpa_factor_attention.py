"""Factor-space TPA attention for prefill and training: every score route ("p" via ``P = B_Q B_K^T``, "q"
via the composed query, "k" via composed K) and value route ("factor", "v") gives the same logits and the
same gradients as materialised Q/K/V attention, in float64, for every TPA variant, with and without padding."""

from __future__ import annotations

import math

import pytest
import torch

from hf_symmetry import TPAConfig, TPAForCausalLM

V = 53
BASE = dict(
    vocab_size=V,
    hidden_size=24,
    num_attention_heads=3,
    head_dim=6,
    num_hidden_layers=2,
    q_rank=5,
    k_rank=3,
    v_rank=2,
    intermediate_size=32,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VARIANTS = {
    "contextual": {},
    "noncontextual": dict(contextual_a=False),
    "kv_only": dict(q_rank=None),
    "kv_only_noncontextual": dict(q_rank=None, contextual_a=False),
    "bias_partial_rope": dict(
        attention_bias=True,
        attention_out_bias=True,
        head_dim=8,
        q_rank=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    ),
}
ROUTES = [("p", "factor"), ("p", "v"), ("q", "factor"), ("q", "v"), ("k", "factor")]


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(variant: str, attn: str) -> TPAForCausalLM:
    """A float64 TPA model with O(1) random weights (so differences are meaningful)."""
    torch.manual_seed(0)
    model = TPAForCausalLM._from_config(TPAConfig(**{**BASE, **VARIANTS[variant]}), attn_implementation=attn)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(("k_a", "v_a", "q_a")):
                p.copy_(noise)
            elif "embed" in name:
                p.copy_(0.6 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.1 * noise)
    return model.double().train()


def _force(model: TPAForCausalLM, plan: tuple[str, str] | None) -> TPAForCausalLM:
    for layer in model.model.layers:
        attn = layer.self_attn
        if plan is None:
            attn.config.tpa_decode_path = "materialize"
        else:
            attn.attention_plan = lambda T, S, plan=plan: plan
    return model


def _loss_and_grads(model, ids, mask):
    """Next-token loss over real positions only (rows of left padding see no key at all, so their
    outputs are arbitrary and must not reach the loss)."""
    logits = model(ids, attention_mask=mask).logits
    pairs = (mask[:, :-1] * mask[:, 1:]).bool()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][pairs], ids[:, 1:][pairs])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("padded", [False, True])
def test_factor_space_training_equals_materialized_attention_and_gradients(variant, padded):
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # left padding: every route must honour a real (non-causal-only) mask
    ref_logits, ref_loss, ref_grads = _loss_and_grads(_force(_model(variant, "sdpa"), None), ids, mask)
    keep = mask.bool()
    routes = ROUTES if VARIANTS[variant].get("q_rank", 5) is not None else [r for r in ROUTES if r[0] != "p"]
    for plan in routes:
        logits, loss, grads = _loss_and_grads(_force(_model(variant, "eager"), plan), ids, mask)
        assert (logits - ref_logits)[keep].abs().max().item() <= 1e-10, plan
        assert abs(loss.item() - ref_loss.item()) <= 1e-10, plan
        assert grads.keys() == ref_grads.keys()
        worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
        assert worst <= 1e-10, (plan, worst)
        assert max(g.abs().max().item() for g in grads.values()) > 1e-3  # gradients are not trivially zero


def test_a_wrong_factor_route_is_detected():
    """Negative control: dropping the 1/R_K normalisation in the P route changes logits and gradients."""
    ids = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ref_logits, _, ref_grads = _loss_and_grads(_force(_model("contextual", "sdpa"), None), ids, mask)
    bad = _force(_model("contextual", "eager"), ("p", "v"))
    for layer in bad.model.layers:
        layer.self_attn.scaling *= BASE["k_rank"]
    logits, _, grads = _loss_and_grads(bad, ids, mask)
    assert (logits - ref_logits).abs().max().item() > 1e-3
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) > 1e-3


@pytest.mark.parametrize("path", ["auto", "factor"])
def test_whole_sequence_training_step_matches_materialized(path):
    """One optimizer step with the model's own path choice equals the materialised step (float64)."""
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(4))
    models = [_force(_model("contextual", "sdpa"), None), _model("contextual", "eager")]
    models[1].config.tpa_decode_path = path
    after = []
    for m in models:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(ids, labels=ids).loss.backward()
        opt.step()
        after.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert (after[0] - after[1]).abs().max().item() <= 1e-10


def test_auto_plan_uses_factor_space_where_it_is_cheaper():
    """T6 shapes (paper small: 34 heads, d_h 64, R = 6/2/2): decoding and short chunks against a long
    cache run from the factors; whole-sequence prefill/training materialises (cheaper in wall time here:
    its score route is one large matrix multiply, see ``route_costs``)."""
    cfg = TPAConfig(
        vocab_size=V,
        hidden_size=64,
        num_attention_heads=34,
        head_dim=64,
        num_hidden_layers=1,
        q_rank=6,
        k_rank=2,
        v_rank=2,
    )
    attn = TPAForCausalLM(cfg).model.layers[0].self_attn
    assert attn.attention_plan(1, 4096)[1] == "factor" and attn.attention_plan(1, 4096)[0] in ("p", "q")
    assert attn.use_factor_path(16, 4096)
    assert attn.attention_plan(512, 512) == ("k", "v") and not attn.use_factor_path(512, 512)
    attn.config.tpa_decode_path = "factor"
    assert attn.attention_plan(512, 512)[1] == "factor" and attn.attention_plan(512, 512)[0] != "k"
