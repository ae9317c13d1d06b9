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

**Layer targets** (``layer_map`` and ``layer_weight > 0``): the student's decoder-layer outputs are
also pulled towards the teacher's, mapped into the student's basis by the conversion's layer map
(:class:`hf_symmetry.conversion.layer_map.LayerMap`: identity for TPA/FaRR, the residual rotation cut
to the kept width for compression). Per layer ``l`` and position ``t``, with ``y = map_l(h_teacher)``,
the error is ``‖s_t − y_t‖² / (‖y_t‖² + ‖s_t‖²)`` (``s_t`` not differentiated in the denominator):
relative, so that the few positions with massive activations do not outweigh the rest, and bounded
by 2, so that a position where the student has a massive activation the teacher lacks cannot either;
:func:`layer_state_loss` averages it over positions and layers, and the
loss becomes ``(1 − λ)·KD + λ·LM + w·layer``. At zero distortion (full-width slicing, full-rank TPA)
it is 0 to float round-off.

**Teacher samples** (:func:`cached_teacher_samples`): sequences sampled from the teacher on its
device in batches, deterministic for a seed (and device), cached as token files under the
hf_symmetry cache and reused; the cache key holds a fingerprint of the teacher (config and weights
files' names, sizes and modification times), so a changed teacher samples anew.

Teacher and student must share the tokenizer: :func:`check_same_tokenizer` compares vocabularies
and special tokens before any work.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..assets import cache_dir
from ..devices import module_device, to_model
from ..modeling import cache_field
from .logit_loss import chunked_logit_loss, final_hidden, head_is_plain, output_head

__all__ = [
    "DistillationLoss",
    "build_teacher_cache",
    "cached_teacher_samples",
    "check_same_tokenizer",
    "decoder_layers",
    "kd_kl",
    "layer_outputs",
    "layer_state_loss",
    "load_teacher_cache",
    "mean_kl",
    "teacher_fingerprint",
    "teacher_samples",
    "topk_kl",
]


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of ``T² KL(p_teacher ‖ p_student)`` at temperature ``T`` (full vocabulary),
    computed in float32 (or float64 if the logits are)."""
    dt = torch.promote_types(student_logits.dtype, torch.float32)
    s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.to(dt) / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return kl.mean() * temperature**2


def topk_kl(
    student_logits: torch.Tensor, topk_values: torch.Tensor, topk_indices: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Like :func:`kd_kl` with the teacher known only by its top-k logits: the teacher distribution is
    renormalised on those k tokens and the student's full-vocabulary log-probabilities are read there."""
    dt = torch.promote_types(student_logits.dtype, torch.float32)
    s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1).gather(-1, topk_indices.long())
    t = F.log_softmax(topk_values.to(dt) / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature**2


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM, through PEFT and DDP wrappers: the first ``ModuleList``
    named ``layers`` (``h`` for GPT-2-style models)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h") and len(module):
            return module
    raise ValueError(f"{type(model).__name__}: no decoder layers found (a ModuleList named 'layers')")


@contextmanager
def layer_outputs(model: torch.nn.Module):
    """Within the block, the list filled by each forward pass of ``model`` with every decoder
    layer's output hidden state (``[B, L, width]``), in layer order."""
    layers = decoder_layers(model)
    states: list = [None] * len(layers)

    def hook(i):
        def store(module, args, output):
            states[i] = output[0] if isinstance(output, (tuple, list)) else output

        return store

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


def layer_state_loss(student_states, teacher_states, layer_map, eps: float = 1e-12) -> torch.Tensor:
    """Mean over layers and positions of ``‖s − y‖² / (‖y‖² + ‖s‖²)``, ``y = map_l(h)`` (float32; the
    denominator is not differentiated; 0 for a perfect match, at most 2): the student's layer-``l``
    states ``s`` against the teacher's ``h`` mapped into the student's basis by ``layer_map.target(l, h)``."""
    if len(student_states) != len(teacher_states):
        raise ValueError(f"student has {len(student_states)} decoder layers, teacher {len(teacher_states)}")
    total = 0.0
    for i, (s, h) in enumerate(zip(student_states, teacher_states)):
        y = layer_map.target(i, h.to(device=s.device, dtype=torch.float32))
        s = s.float()
        err = (s - y).pow(2).sum(-1)
        scale = (y.pow(2).sum(-1) + s.detach().pow(2).sum(-1)).clamp_min(eps)
        total = total + (err / scale).mean()
    return total / len(student_states)


@dataclass
class DistillationLoss:
    """``loss(model, inputs) -> (loss, {"kd_part", "lm_part"})`` for :func:`hf_symmetry.training.train`.

    ``teacher`` may be ``None`` when every batch carries cached top-k teacher logits (and no layer
    targets are asked for). ``layer_map``/``layer_weight``: the layer targets (module doc)."""

    teacher: torch.nn.Module | None
    temperature: float = 1.0
    lm_weight: float = 0.0
    teacher_device: str | torch.device | None = None
    layer_map: object | None = None
    layer_weight: float = 0.0
    chunk_tokens: int | None = 2048  # positions per chunk of the logits (.logit_loss); 0/None: all at once

    def __post_init__(self):
        self._plain_heads, self._head_params = {}, {}
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.lm_weight <= 1.0:
            raise ValueError(f"LM weight must be in [0, 1], got {self.lm_weight}")
        if self.layer_weight < 0:
            raise ValueError(f"layer-loss weight must be >= 0, got {self.layer_weight}")
        if self.teacher is not None:
            self.teacher.eval()
            self.teacher.requires_grad_(False)

    @property
    def uses_layers(self) -> bool:
        return self.layer_weight > 0 and self.layer_map is not None

    @torch.no_grad()
    def teacher_forward(self, input_ids: torch.Tensor, states: bool = False):
        """``(logits, layer states or None)`` of the teacher on ``input_ids``, on the student's device."""
        if self.teacher is None:
            raise ValueError("no teacher and no cached teacher logits in the batch")
        dev = torch.device(self.teacher_device) if self.teacher_device is not None else input_ids.device
        if next(self.teacher.parameters()).device != dev:
            self.teacher.to(dev)

        if not states:
            return self.teacher(input_ids=to_model(input_ids, self.teacher), use_cache=False).logits.to(
                input_ids.device
            ), None
        with layer_outputs(self.teacher) as hs:
            logits = self.teacher(input_ids=to_model(input_ids, self.teacher), use_cache=False).logits.to(
                input_ids.device
            )
        return logits, [h.to(input_ids.device) for h in hs]

    def teacher_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.teacher_forward(input_ids)[0]

    def _plain(self, model: torch.nn.Module, ids: torch.Tensor) -> bool:
        """Whether the chunked path applies to ``model`` (its logits are its head's output; checked once)."""
        key = id(model)
        if key not in self._plain_heads:
            was = model.training
            model.eval()
            try:
                self._plain_heads[key] = head_is_plain(model, ids)
            finally:
                model.train(was)
        return self._plain_heads[key]

    def __call__(self, model, inputs: dict):
        ids = inputs["input_ids"]
        cached = "teacher_topk_values" in inputs
        if self.chunk_tokens and self._plain(model, ids) and (cached or self._plain(self.teacher, ids)):
            return self._chunked(model, inputs)
        layers = self.uses_layers
        if layers:
            with layer_outputs(model) as student_states:
                out = model(input_ids=ids, use_cache=False)
        else:
            out = model(input_ids=ids, use_cache=False)
        logits = out.logits
        teacher_states = None
        if cached:
            kd = topk_kl(logits, inputs["teacher_topk_values"], inputs["teacher_topk_indices"], self.temperature)
            if layers:
                teacher_states = self.teacher_forward(ids, states=True)[1]
        else:
            t_logits, teacher_states = self.teacher_forward(ids, states=layers)
            kd = kd_kl(logits, t_logits, self.temperature)
        parts = {"kd_part": kd.detach().item()}
        loss = kd
        if self.lm_weight > 0:
            labels = inputs.get("labels", ids)
            dt = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 if the logits are
            lm = F.cross_entropy(logits[:, :-1].flatten(0, 1).to(dt), labels[:, 1:].flatten())
            parts["lm_part"] = lm.detach().item()
            loss = (1 - self.lm_weight) * kd + self.lm_weight * lm
        return self._add_layers(loss, parts, student_states if layers else None, teacher_states)

    def _add_layers(self, loss, parts: dict, student_states, teacher_states):
        if student_states is not None:
            ls = layer_state_loss(student_states, teacher_states, self.layer_map)
            parts["layer_part"] = ls.detach().item()
            loss = loss + self.layer_weight * ls
        return loss, parts

    def _chunked(self, model, inputs: dict):
        """The same loss with the heads applied ``chunk_tokens`` positions at a time
        (:mod:`.logit_loss`): no ``[B, L, V]`` logits of either model."""
        ids = inputs["input_ids"]
        layers = self.uses_layers
        with ExitStack() as stack:
            student_states = stack.enter_context(layer_outputs(model)) if layers else None
            cap = stack.enter_context(final_hidden(model))
            model(input_ids=ids, use_cache=False)
        hidden, teacher_states = cap.hidden, None
        if "teacher_topk_values" in inputs:
            teacher = ("topk", inputs["teacher_topk_values"], inputs["teacher_topk_indices"])
            if layers:
                teacher_states = self.teacher_forward(ids, states=True)[1]
        else:
            dev = torch.device(self.teacher_device) if self.teacher_device is not None else ids.device
            if next(self.teacher.parameters()).device != dev:
                self.teacher.to(dev)
            with torch.no_grad(), ExitStack() as stack:
                hs = stack.enter_context(layer_outputs(self.teacher)) if layers else None
                tcap = stack.enter_context(final_hidden(self.teacher))
                self.teacher(input_ids=to_model(ids, self.teacher), use_cache=False)
            teacher = ("hidden", tcap.hidden, output_head(self.teacher))
            if layers:
                teacher_states = [h.to(ids.device) for h in hs]
        head = output_head(model)
        if id(model) not in self._head_params:
            self._head_params[id(model)] = head.trainable_parameters(model, hidden[:1, :1])
        loss, kd, lm = chunked_logit_loss(
            hidden,
            head,
            teacher,
            inputs.get("labels", ids),
            temperature=self.temperature,
            lm_weight=self.lm_weight,
            chunk_tokens=self.chunk_tokens,
            head_params=self._head_params[id(model)],
        )
        parts = {"kd_part": kd, **({"lm_part": lm} if lm is not None else {})}
        return self._add_layers(loss, parts, student_states, teacher_states)


@torch.no_grad()
def mean_kl(student, teacher, sequences: torch.Tensor, batch_size: int = 8, temperature: float = 1.0) -> float:
    """Mean per-position ``KL(teacher ‖ student)`` (nats, temperature ``T``, times ``T²``) over
    ``sequences [n, L]`` — the held-out figure the tests and the card report."""
    total, count = 0.0, 0
    for i in range(0, sequences.shape[0], batch_size):
        ids = sequences[i : i + batch_size]
        s = student(input_ids=to_model(ids, student), use_cache=False).logits
        t = teacher(input_ids=to_model(ids, teacher), use_cache=False).logits.to(s.device)
        total += kd_kl(s, t, temperature).item() * ids.numel()
        count += ids.numel()
    return total / max(count, 1)


def _vocab_signature(tok) -> dict:
    return {
        "vocab": tok.get_vocab(),
        "special": {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")},
    }


def check_same_tokenizer(
    student_tok, teacher_tok, student_vocab_size: int | None = None, teacher_vocab_size: int | None = None
) -> None:
    """Raise ``ValueError`` (one line) unless the two tokenizers map every token to the same id and
    agree on special tokens, and the two models' output vocabularies (``config.vocab_size``) match."""
    a, b = _vocab_signature(student_tok), _vocab_signature(teacher_tok)
    if a["vocab"] != b["vocab"]:
        diff = len(set(a["vocab"].items()) ^ set(b["vocab"].items()))
        raise ValueError(
            f"teacher and student tokenizers differ ({len(b['vocab'])} vs {len(a['vocab'])} tokens, "
            f"{diff} token/id pairs not shared): distillation needs the same tokenizer"
        )
    if a["special"] != b["special"]:
        raise ValueError(f"teacher and student tokenizers differ in special tokens: {a['special']} vs {b['special']}")
    if student_vocab_size is not None and teacher_vocab_size is not None and student_vocab_size != teacher_vocab_size:
        raise ValueError(
            f"teacher and student have different output vocabularies ({teacher_vocab_size} vs "
            f"{student_vocab_size} logits)"
        )


def _fingerprint(sequences: torch.Tensor, k: int, teacher_id: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"k": k, "teacher": teacher_id, "shape": list(sequences.shape)}).encode())
    h.update(sequences.numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def build_teacher_cache(
    teacher,
    sequences: torch.Tensor,
    path: str | Path,
    k: int = 64,
    batch_size: int = 8,
    teacher_id: str = "",
    progress: bool = True,
) -> Path:
    """Run ``teacher`` once, where it is, over ``sequences [n, L]`` and write its top-``k`` logits per
    position to ``path`` (safetensors: ``topk_values`` float32, ``topk_indices`` int32, ``sequences`` int64 and a
    fingerprint of teacher id, k and sequences in the metadata). An existing file with the same
    fingerprint is reused as is. Written to a temporary name and renamed, so a crash leaves no half file."""
    path = Path(path)
    fp = _fingerprint(sequences, k, teacher_id)
    if path.is_file() and _read_fingerprint(path) == fp:
        return path

    teacher.eval()
    vocab = None
    vals, idxs = [], []
    for i in tqdm(
        range(0, sequences.shape[0], batch_size), desc="teacher top-k cache", disable=not progress, unit="batch"
    ):
        logits = teacher(input_ids=to_model(sequences[i : i + batch_size], teacher), use_cache=False).logits.float()
        vocab = logits.shape[-1]
        v, ix = logits.topk(min(k, vocab), dim=-1)
        vals.append(v.cpu())
        idxs.append(ix.to(torch.int32).cpu())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {
            "topk_values": torch.cat(vals).contiguous(),
            "topk_indices": torch.cat(idxs).contiguous(),
            "sequences": sequences.contiguous(),
        },
        str(tmp),
        metadata={"fingerprint": fp, "k": str(k), "teacher": teacher_id, "vocab_size": str(vocab)},
    )
    tmp.replace(path)
    return path


def _read_fingerprint(path: Path) -> str | None:
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("fingerprint")
    except Exception:
        return None


def load_teacher_cache(path: str | Path, sequences: torch.Tensor) -> dict[str, torch.Tensor]:
    """The cached ``{"teacher_topk_values", "teacher_topk_indices"}`` for ``sequences`` (checked equal
    to the cached ones), ready to pass as ``PackedDataset(..., extras=...)``."""
    data = load_file(str(path))
    if not torch.equal(data["sequences"], sequences):
        raise ValueError(f"teacher cache {path} was built for other training sequences")
    return {"teacher_topk_values": data["topk_values"], "teacher_topk_indices": data["topk_indices"]}


def _start_token(tokenizer) -> int:
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start teacher samples from")
    return int(start)


def default_sample_batch(device) -> int:
    """Sequences generated at once: 64 on an accelerator, 8 on CPU."""
    return 8 if torch.device(device).type == "cpu" else 64


@torch.no_grad()
def teacher_samples(
    teacher,
    tokenizer,
    n: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """``[n, seq_len]`` sequences sampled from the teacher itself (temperature 1, no truncation),
    each starting from the BOS token (EOS when there is none): data-free distillation material.
    Generated ``batch_size`` sequences at a time with the KV cache, sampled where the teacher is
    (:func:`~hf_symmetry.devices.module_device`, a generator of that device): deterministic for a given
    seed, batch size and device."""
    start = _start_token(tokenizer)
    dev = module_device(teacher)
    batch_size = batch_size or default_sample_batch(dev)
    teacher.eval()
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for i in tqdm(range(0, n, batch_size), desc="sampling from the teacher", disable=not progress, unit="batch"):
        b = min(batch_size, n - i)
        ids = torch.empty((b, seq_len), dtype=torch.long, device=dev)
        ids[:, 0] = start
        past = None
        for t in range(1, seq_len):
            o = teacher(input_ids=ids[:, t - 1 : t], use_cache=True, **{cache_field(): past})
            past = getattr(o, cache_field())
            probs = torch.softmax(o.logits[:, -1].float(), -1)
            ids[:, t] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        out.append(ids.cpu())
        del past
    return torch.cat(out)


def teacher_fingerprint(folder: str | Path) -> str:
    """A fingerprint of the model folder ``folder``: its ``config.json`` and the names, sizes and
    modification times of its weights files (no weights are read). A changed teacher changes it."""
    folder = Path(folder)
    h = hashlib.sha256()
    h.update((folder / "config.json").read_bytes())
    for p in sorted(folder.iterdir()):
        if p.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".json") and p.name.startswith(
            ("model", "pytorch_model")
        ):
            st = p.stat()
            h.update(json.dumps([p.name, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()[:20]


def cached_teacher_samples(
    teacher,
    tokenizer,
    teacher_folder: str | Path,
    n: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, Path, bool]:
    """:func:`teacher_samples`, cached: ``(sequences [n, seq_len], file, reused)``. The token file
    (safetensors, ``sequences`` int32) lives in ``<hf_symmetry cache>/teacher-samples``
    (``HF_SYMMETRY_CACHE``) under a key of the teacher's fingerprint (:func:`teacher_fingerprint`), n,
    seq_len, seed, batch size, start token and the type of the device the teacher is on; an existing file
    with that key is read instead of sampling. Written to a temporary name and renamed: concurrent runs
    never see half a file."""
    cache = cache_dir() / "teacher-samples"
    dev = module_device(teacher)
    batch_size = batch_size or default_sample_batch(dev)
    fp = teacher_fingerprint(teacher_folder)
    key = {
        "teacher": fp,
        "n": n,
        "seq_len": seq_len,
        "seed": seed,
        "batch_size": batch_size,
        "start": _start_token(tokenizer),
        "device": dev.type,
        "version": 2,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache) / f"{Path(teacher_folder).name}-{n}x{seq_len}-seed{seed}-{digest}.safetensors"
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("key") == json.dumps(key, sort_keys=True):
                    return f.get_tensor("sequences").long(), path, True
        except Exception:  # a damaged file: sample anew
            pass
    seqs = teacher_samples(teacher, tokenizer, n, seq_len, seed=seed, batch_size=batch_size, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(
        {"sequences": seqs.to(torch.int32).contiguous()},
        str(tmp),
        metadata={"key": json.dumps(key, sort_keys=True), "teacher": str(Path(teacher_folder).name)},
    )
    os.replace(tmp, path)
    return seqs, path, False
