"""The distillation loss in chunks of tokens (hf_symmetry.training.logit_loss, issue 28): the same loss
and gradients as the unchunked formulas, in float64, for every family heal trains; no [B, L, V] logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from heal_models import FAMILIES, tiny

from hf_symmetry.training.distill import DistillationLoss
from hf_symmetry.training.logit_loss import chunked_logit_loss, final_hidden, head_is_plain, output_head

VOCAB, B, L = 257, 2, 40


def _models(family: str, seed: int = 3):
    teacher = tiny("llama", VOCAB, seed=0, init_std=0.1).double().eval()
    student = tiny(family, VOCAB, seed=seed).double().eval()
    student.requires_grad_(True)
    return student, teacher


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(student, loss_fn, inputs):
    student.zero_grad(set_to_none=True)
    loss, parts = loss_fn(student, inputs)
    loss.backward()
    return loss.detach(), parts, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lm_weight,temperature", [(0.0, 1.0), (0.5, 2.0)])
def test_chunked_loss_and_gradients_equal_the_unchunked_ones(family, lm_weight, temperature):
    student, teacher = _models(family)
    ids = _ids()
    labels = ids.clone()
    labels[0, 7] = -100  # a position without a target counts in neither
    inputs = {"input_ids": ids, "labels": labels}
    whole = DistillationLoss(teacher, temperature, lm_weight, chunk_tokens=None)
    chunked = DistillationLoss(teacher, temperature, lm_weight, chunk_tokens=7)  # 80 positions: 11 uneven chunks
    l0, p0, g0 = _loss_and_grads(student, whole, inputs)
    l1, p1, g1 = _loss_and_grads(student, chunked, inputs)
    assert chunked._plain_heads and all(chunked._plain_heads.values())  # the chunked path ran
    assert torch.allclose(l1, l0, rtol=1e-12, atol=0)
    assert abs(p1["kd_part"] - p0["kd_part"]) < 1e-12 * abs(p0["kd_part"])
    if lm_weight:
        assert abs(p1["lm_part"] - p0["lm_part"]) < 1e-12 * abs(p0["lm_part"])
    assert g0.keys() == g1.keys() and chunked._head_params[id(student)]  # the head's weights train too
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=1e-9, atol=1e-13), n
    # negative control: another teacher gives a clearly different loss and head gradient
    other = tiny("llama", VOCAB, seed=5, init_std=0.1).double().eval()
    l2, _, g2 = _loss_and_grads(student, DistillationLoss(other, temperature, lm_weight, chunk_tokens=7), inputs)
    assert abs(l2 - l0) > 1e-3 * abs(l0)
    name = next(n for n in g0 if "embed" in n or "lm_head" in n)
    assert (g2[name] - g0[name]).abs().max() > 1e-3 * g0[name].abs().max()


def test_cached_top_k_teacher_chunked_equals_unchunked():
    student, teacher = _models("llama")
    ids = _ids()
    with torch.no_grad():
        v, i = teacher(input_ids=ids).logits.topk(16, dim=-1)
    inputs = {"input_ids": ids, "teacher_topk_values": v, "teacher_topk_indices": i.to(torch.int32)}
    l0, _, g0 = _loss_and_grads(student, DistillationLoss(None, 1.0, 0.3, chunk_tokens=None), inputs)
    l1, _, g1 = _loss_and_grads(student, DistillationLoss(None, 1.0, 0.3, chunk_tokens=9), inputs)
    assert torch.allclose(l1, l0, rtol=1e-12, atol=0)
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=1e-9, atol=1e-13), n


def test_no_vocabulary_sized_tensor_of_all_positions_is_kept_for_backward():
    """The tensors autograd saves: with chunks, none as large as [B·L, V]; unchunked, the logits are."""
    student, teacher = _models("llama")
    ids = _ids()

    def largest_saved(chunk):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        rows = []
        handle = student.get_output_embeddings().register_forward_hook(
            lambda m, a, o: rows.append(a[0].reshape(-1, a[0].shape[-1]).shape[0])
        )
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = DistillationLoss(teacher, 1.0, 0.5, chunk_tokens=chunk)(student, {"input_ids": ids})
        handle.remove()
        loss.backward()
        return max(sizes), max(rows[1:] if chunk else rows)  # rows[0]: the one-off plain-head check

    n_v = B * L * VOCAB
    assert largest_saved(None)[0] >= n_v  # the control: unchunked keeps the logits
    saved, rows = largest_saved(8)
    # the largest kept: the head weight's gradient [V, d] (and nothing of the B·L positions times V)
    assert saved <= VOCAB * student.config.hidden_size < n_v / 2 and rows <= 8


def test_a_head_followed_by_scaling_keeps_the_unchunked_path():
    student, teacher = _models("llama")
    ids = _ids()

    class Scaled(torch.nn.Module):  # logits = 2 · head(h): not the head's output
        def __init__(self, m):
            super().__init__()
            self.m = m

        def get_output_embeddings(self):
            return self.m.get_output_embeddings()

        def forward(self, **kw):
            out = self.m(**kw)
            out.logits = out.logits * 2
            return out

    scaled = Scaled(student)
    assert head_is_plain(student, ids) and not head_is_plain(scaled, ids)
    lf = DistillationLoss(teacher, 1.0, 0.0, chunk_tokens=8)
    l0, _ = DistillationLoss(teacher, 1.0, 0.0, chunk_tokens=None)(scaled, {"input_ids": ids})
    l1, _ = lf(scaled, {"input_ids": ids})
    assert lf._plain_heads[id(scaled)] is False and torch.allclose(l1, l0, rtol=1e-12)


def test_final_hidden_restores_the_head_and_direct_use_matches():
    student, teacher = _models("llama")
    ids = _ids()
    module = student.get_output_embeddings()
    with final_hidden(student) as cap:
        student(input_ids=ids)
        assert student.get_output_embeddings() is not module
    head = output_head(student)
    assert student.get_output_embeddings() is module and cap.hidden.shape == (B, L, student.config.hidden_size)
    with final_hidden(teacher) as tcap:
        teacher(input_ids=ids)
    loss, kd, lm = chunked_logit_loss(
        cap.hidden, head, ("hidden", tcap.hidden, output_head(teacher)), ids, lm_weight=0.0, chunk_tokens=13
    )
    ref, _ = DistillationLoss(teacher, 1.0, 0.0, chunk_tokens=None)(student, {"input_ids": ids})
    assert torch.allclose(loss, ref, rtol=1e-12) and lm is None and abs(kd - float(ref)) < 1e-12 * float(ref)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logit_loss(cap.hidden, head, ("hidden", tcap.hidden, output_head(teacher)), ids, chunk_tokens=0)


def test_cli_passes_the_logit_chunk_and_a_negative_one_is_refused(monkeypatch):
    import hf_symmetry.commands.heal as heal_module  # where the heal command looks HealRun up
    from hf_symmetry.cli import main as cli
    from hf_symmetry.training.heal import HealOptions

    seen = {}

    def fake(job):
        seen["options"] = job.options
        raise ValueError("stop here")

    monkeypatch.setattr(heal_module, "HealRun", fake)
    # the inputs named below are never read (HealRun is faked): the up-front input checks are skipped
    monkeypatch.setattr("hf_symmetry.cli.check_inputs", lambda args: None)
    monkeypatch.setattr("hf_symmetry.commands.runner.resolve_model", Path)
    assert cli(["heal", "in", "out", "--teacher", "t", "--text", "x.txt", "--logit-chunk", "512", "--quiet"]) == 2
    assert seen["options"].logit_chunk == 512 and HealOptions().logit_chunk == 2048
    with pytest.raises(ValueError, match="--logit-chunk"):
        HealOptions(logit_chunk=-1).validate()


def test_teacher_samples_take_their_share_of_the_token_budget():
    from hf_symmetry.training.heal import HealOptions

    o = HealOptions(tokens=4096, seq_len=128, teacher_samples=8)
    assert o.text_tokens() == 4096 - 8 * 128 and o.steps() == HealOptions(tokens=4096, seq_len=128).steps()
    assert HealOptions(tokens=256, seq_len=128, teacher_samples=8).text_tokens() == 128  # at least one sequence
