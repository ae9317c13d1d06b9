"""Knowledge distillation from a teacher causal LM: the loss ``hf-symmetry heal`` trains with.

Per predicted position ``t`` (every position of a packed sequence: each predicts the next token),

    KD_t = T² · KL( softmax(z_teacher,t / T) ‖ softmax(z_student,t / T) )

averaged over the positions of the micro-batch (``T``: temperature; the ``T²`` keeps gradient
magnitudes comparable across temperatures, as in Hinton et al.). With ``lm_weight = λ > 0`` the loss is
``(1 − λ)·KD + λ·LM`` where LM is the ordinary next-token cross-entropy on the text.

The teacher runs alongside the student: :class:`DistillationLoss` holds it (frozen, in eval mode,
outside the Trainer's model so DDP never wraps it) and moves it lazily to the student's device, or
keeps it on ``teacher_device``. Alternatively :func:`build_teacher_cache` runs the teacher once over the
training sequences and writes its **top-k logits** to a safetensors file (``topk_values`` float32
``[n, L, k]``, ``topk_indices`` int32 ``[n, L, k]``); the loss then reads them from the batch
(``teacher_topk_values`` / ``teacher_topk_indices``) and uses the teacher distribution renormalised on
its top k tokens, KL taken on that support (exact when ``k`` is the vocabulary size).

Teacher and student must share the tokenizer: :func:`check_same_tokenizer` compares vocabularies
and special tokens before any work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["DistillationLoss", "kd_kl", "topk_kl", "check_same_tokenizer", "build_teacher_cache",
           "load_teacher_cache", "teacher_samples", "mean_kl"]


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of ``T² KL(p_teacher ‖ p_student)`` at temperature ``T`` (full vocabulary),
    computed in float32 (or float64 if the logits are)."""
    dt = torch.promote_types(student_logits.dtype, torch.float32)
    s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.to(dt) / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return kl.mean() * temperature ** 2


def topk_kl(student_logits: torch.Tensor, topk_values: torch.Tensor, topk_indices: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """Like :func:`kd_kl` with the teacher known only by its top-k logits: the teacher distribution is
    renormalised on those k tokens and the student's full-vocabulary log-probabilities are read there."""
    dt = torch.promote_types(student_logits.dtype, torch.float32)
    s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1).gather(-1, topk_indices.long())
    t = F.log_softmax(topk_values.to(dt) / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature ** 2


@dataclass
class DistillationLoss:
    """``loss(model, inputs) -> (loss, {"kd_part", "lm_part"})`` for :func:`hf_symmetry.training.train`.

    ``teacher`` may be ``None`` when every batch carries cached top-k teacher logits."""
    teacher: torch.nn.Module | None
    temperature: float = 1.0
    lm_weight: float = 0.0
    teacher_device: str | torch.device | None = None

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.lm_weight <= 1.0:
            raise ValueError(f"LM weight must be in [0, 1], got {self.lm_weight}")
        if self.teacher is not None:
            self.teacher.eval()
            self.teacher.requires_grad_(False)

    @torch.no_grad()
    def teacher_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        dev = torch.device(self.teacher_device) if self.teacher_device is not None else input_ids.device
        if next(self.teacher.parameters()).device != dev:
            self.teacher.to(dev)
        return self.teacher(input_ids=input_ids.to(dev), use_cache=False).logits.to(input_ids.device)

    def __call__(self, model, inputs: dict):
        ids = inputs["input_ids"]
        out = model(input_ids=ids, use_cache=False)
        logits = out.logits
        if "teacher_topk_values" in inputs:
            kd = topk_kl(logits, inputs["teacher_topk_values"], inputs["teacher_topk_indices"], self.temperature)
        else:
            if self.teacher is None:
                raise ValueError("no teacher and no cached teacher logits in the batch")
            kd = kd_kl(logits, self.teacher_logits(ids), self.temperature)
        parts = {"kd_part": kd.detach().item()}
        loss = kd
        if self.lm_weight > 0:
            labels = inputs.get("labels", ids)
            lm = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            parts["lm_part"] = lm.detach().item()
            loss = (1 - self.lm_weight) * kd + self.lm_weight * lm
        return loss, parts


@torch.no_grad()
def mean_kl(student, teacher, sequences: torch.Tensor, batch_size: int = 8, temperature: float = 1.0) -> float:
    """Mean per-position ``KL(teacher ‖ student)`` (nats, temperature ``T``, times ``T²``) over
    ``sequences [n, L]`` — the held-out figure the tests and the card report."""
    total, count = 0.0, 0
    for i in range(0, sequences.shape[0], batch_size):
        ids = sequences[i:i + batch_size]
        s = student(input_ids=ids.to(student.device), use_cache=False).logits
        t = teacher(input_ids=ids.to(teacher.device), use_cache=False).logits.to(s.device)
        total += kd_kl(s, t, temperature).item() * ids.numel()
        count += ids.numel()
    return total / max(count, 1)


def _vocab_signature(tok) -> dict:
    return {"vocab": tok.get_vocab(), "special": {k: getattr(tok, k, None) for k in
                                                  ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}}


def check_same_tokenizer(student_tok, teacher_tok, student_vocab_size: int | None = None,
                         teacher_vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` (one line) unless the two tokenizers map every token to the same id and
    agree on special tokens, and the two models' output vocabularies (``config.vocab_size``) match."""
    a, b = _vocab_signature(student_tok), _vocab_signature(teacher_tok)
    if a["vocab"] != b["vocab"]:
        diff = len(set(a["vocab"].items()) ^ set(b["vocab"].items()))
        raise ValueError(f"teacher and student tokenizers differ ({len(b['vocab'])} vs {len(a['vocab'])} tokens, "
                         f"{diff} token/id pairs not shared): distillation needs the same tokenizer")
    if a["special"] != b["special"]:
        raise ValueError(f"teacher and student tokenizers differ in special tokens: {a['special']} vs {b['special']}")
    if student_vocab_size is not None and teacher_vocab_size is not None and student_vocab_size != teacher_vocab_size:
        raise ValueError(f"teacher and student have different output vocabularies ({teacher_vocab_size} vs "
                         f"{student_vocab_size} logits)")


def _fingerprint(sequences: torch.Tensor, k: int, teacher_id: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"k": k, "teacher": teacher_id, "shape": list(sequences.shape)}).encode())
    h.update(sequences.numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def build_teacher_cache(teacher, sequences: torch.Tensor, path: str | Path, k: int = 64, batch_size: int = 8,
                        teacher_id: str = "", device: str | torch.device | None = None,
                        progress: bool = True) -> Path:
    """Run ``teacher`` once over ``sequences [n, L]`` and write its top-``k`` logits per position to
    ``path`` (safetensors: ``topk_values`` float32, ``topk_indices`` int32, ``sequences`` int64 and a
    fingerprint of teacher id, k and sequences in the metadata). An existing file with the same
    fingerprint is reused as is. Written to a temporary name and renamed, so a crash leaves no half file."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    path = Path(path)
    fp = _fingerprint(sequences, k, teacher_id)
    if path.is_file() and _read_fingerprint(path) == fp:
        return path
    teacher.eval()
    dev = torch.device(device) if device is not None else next(teacher.parameters()).device
    teacher.to(dev)
    vocab = None
    vals, idxs = [], []
    for i in tqdm(range(0, sequences.shape[0], batch_size), desc="teacher top-k cache", disable=not progress,
                  unit="batch"):
        logits = teacher(input_ids=sequences[i:i + batch_size].to(dev), use_cache=False).logits.float()
        vocab = logits.shape[-1]
        v, ix = logits.topk(min(k, vocab), dim=-1)
        vals.append(v.cpu())
        idxs.append(ix.to(torch.int32).cpu())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"topk_values": torch.cat(vals).contiguous(), "topk_indices": torch.cat(idxs).contiguous(),
               "sequences": sequences.contiguous()}, str(tmp),
              metadata={"fingerprint": fp, "k": str(k), "teacher": teacher_id, "vocab_size": str(vocab)})
    tmp.replace(path)
    return path


def _read_fingerprint(path: Path) -> str | None:
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("fingerprint")
    except Exception:
        return None


def load_teacher_cache(path: str | Path, sequences: torch.Tensor) -> dict[str, torch.Tensor]:
    """The cached ``{"teacher_topk_values", "teacher_topk_indices"}`` for ``sequences`` (checked equal
    to the cached ones), ready to pass as ``PackedDataset(..., extras=...)``."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    if not torch.equal(data["sequences"], sequences):
        raise ValueError(f"teacher cache {path} was built for other training sequences")
    return {"teacher_topk_values": data["topk_values"], "teacher_topk_indices": data["topk_indices"]}


@torch.no_grad()
def teacher_samples(teacher, tokenizer, n: int, seq_len: int, seed: int = 0, batch_size: int = 8,
                    device: str | torch.device | None = None, progress: bool = True) -> torch.Tensor:
    """``[n, seq_len]`` sequences sampled from the teacher itself (temperature 1, no truncation),
    each starting from the BOS token (EOS when there is none): data-free distillation material.
    Deterministic for a given seed and device."""
    from tqdm.auto import tqdm

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start teacher samples from")
    dev = torch.device(device) if device is not None else next(teacher.parameters()).device
    teacher.eval().to(dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for i in tqdm(range(0, n, batch_size), desc="sampling from the teacher", disable=not progress, unit="batch"):
        b = min(batch_size, n - i)
        ids = torch.full((b, 1), start, dtype=torch.long, device=dev)
        past = None
        step_in = ids
        for _ in range(seq_len - 1):
            o = teacher(input_ids=step_in, past_key_values=past, use_cache=True)
            past = o.past_key_values
            probs = torch.softmax(o.logits[:, -1].float(), -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=gen).to(dev)
            ids = torch.cat([ids, nxt], 1)
            step_in = nxt
        out.append(ids.cpu())
    return torch.cat(out)
