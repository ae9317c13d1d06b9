"""The distillation loss over the vocabulary in chunks of tokens: no ``[batch, seq, vocab]`` logits.

Over a 49 k vocabulary the logits dominate a distillation step: the student's and the teacher's
``[B, L, V]`` float32 logits, their log-softmaxes and the gradient are each ``B·L·V·4`` bytes (1.6 GB at
16 × 512 tokens). Here the models run without their LM head (:func:`final_hidden`: the head is swapped
for a module that hands back its input), and :func:`chunked_logit_loss` applies the heads to
``chunk_tokens`` positions at a time, takes the log-softmaxes, the KL (or the top-k KL) and the
cross-entropy of each chunk, and adds the chunk's share of the mean: the loss is that of the
unchunked formulas (:func:`~hf_symmetry.training.distill.kd_kl`, ``F.cross_entropy``) to float round-off.

Gradients: :class:`_ChunkedLoss` is an autograd function that, in its forward pass, differentiates each
chunk's loss with respect to the chunk's hidden states and the head's trainable parameters at once
(``torch.autograd.grad``) and keeps only those gradients (``[N, d]`` and the head's size); its backward
pass scales them by the incoming gradient. No chunk's logits outlive the chunk, and nothing is
recomputed (the head runs once forward and once backward per chunk, as unchunked). Any head module
works (plain ``nn.Linear``, a structured head of the compressed family, a trained tied embedding).

A family whose logits are not ``head(final hidden state)`` (logit scaling or soft-capping after the head)
would be distilled wrongly; :func:`head_is_plain` checks that once per model on a few positions and the
caller keeps the unchunked path for such a model.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..devices import to_model

__all__ = ["CHUNK_TOKENS", "LogitHead", "chunked_logit_loss", "final_hidden", "head_is_plain", "output_head"]

CHUNK_TOKENS = 2048  # positions per chunk: 2048 × 49 152 float32 logits = 0.4 GB per tensor


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


class LogitHead:
    """How a model turns its final hidden states into logits, found through PEFT and DDP wrappers:
    the model's own ``logits_from_hidden`` where its class has one (hf_symmetry's compressed family,
    whose tied head is the structured embedding), else its output-embeddings module. Calling it applies
    it; :meth:`swapped` stands a :class:`_Capture` in for it."""

    def __init__(self, model: torch.nn.Module):
        model = _unwrap(model)
        owner = next((m for m in model.modules() if callable(getattr(type(m), "logits_from_hidden", None))), None)
        if owner is not None:
            self.fn, self.slots, self.method = owner.logits_from_hidden, [(owner, "logits_from_hidden")], True
            self.device = next(owner.parameters()).device
            return
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
        self.slots = [
            (parent, name) for parent in model.modules() for name, child in parent.named_children() if child is head
        ]
        if not self.slots:
            raise ValueError(f"{type(model).__name__}: the LM head is not a submodule")
        self.fn, self.method, self.device = head, False, next(head.parameters()).device

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fn(hidden)

    def trainable_parameters(self, model: torch.nn.Module, hidden: torch.Tensor) -> list[torch.nn.Parameter]:
        """The parameters of ``model`` that need a gradient and that the head uses, found by
        differentiating the head's output on ``hidden`` (a final hidden state or a few)."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return []
        with torch.enable_grad():
            out = self.fn(hidden.detach())
            if not out.requires_grad:  # a frozen head (LoRA): nothing of it trains
                return []
            grads = torch.autograd.grad(out.float().sum(), params, allow_unused=True)
        return [p for p, g in zip(params, grads) if g is not None]

    @contextmanager
    def swapped(self, stand_in):
        for owner, name in self.slots:
            if self.method:  # an instance attribute shadows the class's method (not a submodule)
                object.__setattr__(owner, name, stand_in)
            else:
                setattr(owner, name, stand_in)
        try:
            yield
        finally:
            for owner, name in self.slots:
                if self.method:
                    owner.__dict__.pop(name, None)
                else:
                    setattr(owner, name, self.fn)


def output_head(model: torch.nn.Module) -> LogitHead:
    """The :class:`LogitHead` of ``model``."""
    return LogitHead(model)


class _Capture(torch.nn.Module):
    """Stands in for the LM head: records its input and returns it (no vocabulary-sized work)."""

    def __init__(self):
        super().__init__()
        self.hidden = None

    def forward(self, x):
        self.hidden = x
        return x


@contextmanager
def final_hidden(model: torch.nn.Module):
    """Within the block, the model's LM head is replaced by a :class:`_Capture`: a forward pass costs no
    logits and leaves the head's input (the final hidden states) in the yielded ``capture.hidden``."""
    capture = _Capture()
    with output_head(model).swapped(capture):
        yield capture


@torch.no_grad()
def head_is_plain(model: torch.nn.Module, input_ids: torch.Tensor, positions: int = 8) -> bool:
    """Whether ``model``'s logits are its head applied to the final hidden states (no scaling or
    soft-capping after the head), checked on the first ``positions`` tokens of one sequence."""
    ids = to_model(input_ids[:1, :positions], model)
    try:
        head = output_head(model)
    except ValueError:
        return False
    logits = model(input_ids=ids, use_cache=False).logits
    with final_hidden(model) as cap:
        model(input_ids=ids, use_cache=False)
    mine = head(cap.hidden)
    return mine.shape == logits.shape and torch.allclose(mine.float(), logits.float(), rtol=1e-4, atol=1e-4)


def _chunk_loss(z, teacher, labels, temperature: float, kd_weight: float, lm_weight: float, n_kd: int, n_lm: int):
    """This chunk's share of ``kd_weight·KD + lm_weight·LM`` and its (KD, LM) sums, from student logits
    ``z [n, V]``; ``teacher`` is ``("logits", t [n, V])`` or ``("topk", values [n, k], indices [n, k])``."""
    dt = torch.promote_types(z.dtype, torch.float32)
    zt = z.to(dt)
    s = F.log_softmax(zt / temperature, dim=-1)
    if teacher[0] == "logits":
        t = F.log_softmax(teacher[1].to(dt) / temperature, dim=-1)
        kd_sum = (t.exp() * (t - s)).sum() * temperature**2
    else:
        t = F.log_softmax(teacher[1].to(dt) / temperature, dim=-1)
        kd_sum = (t.exp() * (t - s.gather(-1, teacher[2].long()))).sum() * temperature**2
    loss = kd_sum * (kd_weight / n_kd)
    lm_sum = zt.new_zeros(())
    if lm_weight > 0 and n_lm:
        lm_sum = F.cross_entropy(zt, labels, reduction="sum")  # labels -100: ignored
        loss = loss + lm_sum * (lm_weight / n_lm)
    return loss, kd_sum.detach(), lm_sum.detach()


class _ChunkedLoss(torch.autograd.Function):
    """``loss = Σ_chunks share(head(h[chunk]))``; the forward pass computes the gradients chunk by chunk
    (module doc), the backward pass hands them on scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, fixed, *params):
        head, teacher_chunk, labels, chunk, args, want = fixed
        want_h = want and ctx.needs_input_grad[0]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_p = [torch.zeros_like(p) for p in params]
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        kd = total.clone()
        lm = total.clone()
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            with torch.enable_grad():
                h = hidden[a:b].detach().requires_grad_(want_h)
                loss, k, m = _chunk_loss(head(h), teacher_chunk(a, b), labels[a:b], *args)
                wrt = ([h] if want_h else []) + (list(params) if want else [])
                if wrt and loss.requires_grad:
                    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
                    if want_h:
                        grad_h[a:b] = grads[0]
                        grads = grads[1:]
                    for acc, g in zip(grad_p, grads):
                        if g is not None:
                            acc += g
            total += loss.detach()
            kd += k
            lm += m
        ctx.save_for_backward(*([grad_h] if grad_h is not None else []), *grad_p)
        ctx.has_h = grad_h is not None
        ctx.mark_non_differentiable(kd, lm)
        return total, kd, lm

    @staticmethod
    def backward(ctx, g, _kd, _lm):
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) * g if ctx.has_h else None
        return (grad_h, None, *[gp * g for gp in saved])


def chunked_logit_loss(
    student_hidden: torch.Tensor,
    student_head,
    teacher,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    lm_weight: float = 0.0,
    chunk_tokens: int = CHUNK_TOKENS,
    head_params=(),
) -> tuple[torch.Tensor, float, float | None]:
    """``(loss, kd, lm)`` with ``loss = (1 − λ)·KD + λ·LM`` from the student's final hidden states
    ``[B, L, d]`` and head (a :class:`LogitHead` or any module), ``chunk_tokens`` positions at a time (module doc).

    ``teacher``: ``("hidden", states [B, L, d_t], head)`` (the teacher's head is applied per chunk on its
    own device) or ``("topk", values [B, L, k], indices [B, L, k])``. ``labels [B, L]``: the text (-100:
    no target); ``head_params``: the trainable parameters the student's head uses
    (:meth:`LogitHead.trainable_parameters`), which get their gradients; position ``t`` predicts ``labels[:, t + 1]``,
    as ``F.cross_entropy`` over the shifted
    logits. KD is the mean over all ``B·L`` positions, LM over the positions with a target."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    B, L, d = student_hidden.shape
    hidden = student_hidden.reshape(B * L, d)
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    shifted = shifted.reshape(B * L).to(hidden.device)
    n_lm = int((shifted != -100).sum()) if lm_weight > 0 else 0
    if teacher[0] == "hidden":
        t_hidden, t_head = teacher[1].reshape(B * L, -1), teacher[2]
        t_dev = t_head.device if isinstance(t_head, LogitHead) else next(t_head.parameters()).device

        def teacher_chunk(a, b):
            with torch.no_grad():
                return ("logits", t_head(t_hidden[a:b].to(t_dev)).to(hidden.device))
    elif teacher[0] == "topk":
        vals, idx = teacher[1].reshape(B * L, -1).to(hidden.device), teacher[2].reshape(B * L, -1).to(hidden.device)

        def teacher_chunk(a, b):
            return ("topk", vals[a:b], idx[a:b])
    else:
        raise ValueError(f"teacher must be ('hidden', states, head) or ('topk', values, indices), got {teacher[0]!r}")
    want = torch.is_grad_enabled()
    params = tuple(head_params) if want else ()
    fixed = (
        student_head,
        teacher_chunk,
        shifted,
        chunk_tokens,
        (temperature, 1.0 - lm_weight, lm_weight, B * L, n_lm),
        want,
    )
    loss, kd, lm = _ChunkedLoss.apply(hidden, fixed, *params)
    return loss, float(kd) / (B * L), (float(lm) / n_lm if n_lm else None)
