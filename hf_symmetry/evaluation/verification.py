"""The one verification path of every conversion.

A conversion writes its folder; the command then calls :func:`verify` (one converted model
against its original) or :func:`perplexities` (several models on one text, e.g. a merge and
its inputs). Both load each model through accelerate's big-model loading on the device
:func:`hf_symmetry.devices.parse_device` reads (left to ``auto``, accelerate's ``device_map="auto"`` with
CPU/disk offload when the model does not fit; a named device holds it all), one model at a time,
and measure with the same definitions: max |Δ| over the first :data:`~.perplexity.LOGIT_TOKENS` tokens
(logits, or hidden states for encoders) and the perplexity of :data:`~.perplexity.PPL`. One progress
bar covers the whole step.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from ..assets import resolve_model, resolve_text
from ..devices import DeviceRequest, parse_device, to_model
from ..modeling import register_auto_classes
from ..text import public_text_label, read_text, tokenize_text
from .compare import auto_class, is_causal_lm, load_tokenizer
from .perplexity import LOGIT_TOKENS, PPL, PerplexityWindows, perplexity, windows
from .speed import PREFILL_TOKENS, SpeedComparison, compare_loaded, speed_device

DEFAULT_TEXT = "britannica-eval"


_OFFLOAD: list[str] = []


def _offload_dir() -> str:
    """A private folder for accelerate's disk offload, removed when the process exits."""
    if not _OFFLOAD:
        _OFFLOAD.append(tempfile.mkdtemp(prefix="hf_symmetry-offload-"))
        atexit.register(shutil.rmtree, _OFFLOAD[0], True)
    return _OFFLOAD[0]


def load_for_eval(
    path: str | os.PathLike,
    device: str | DeviceRequest | None = "auto",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool | None = None,
    offload_folder: str | os.PathLike | None = None,
):
    """A saved model (LM class when it has one, else its base model) in eval mode, placed by
    accelerate on ``device`` (read by :func:`~hf_symmetry.devices.parse_device`): a device that may be
    spread (:attr:`~hf_symmetry.devices.DeviceRequest.spread`, ``auto``) spreads it over the visible GPUs
    and offloads what does not fit to CPU memory and then to ``offload_folder``; a named device puts it
    all there."""
    register_auto_classes()

    path = resolve_model(path)
    trust = bool(trust_remote_code)  # hf_symmetry's own families are registered and need no remote code
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    request = parse_device(device)
    cls = auto_class(config)
    kwargs = dict(dtype=dtype, trust_remote_code=trust)
    if request.spread:
        kwargs.update(device_map=request.device_map, offload_folder=str(offload_folder or _offload_dir()))
    else:
        kwargs.update(device_map={"": str(request.device)})
    try:
        model = cls.from_pretrained(path, **kwargs)
    except ValueError as exc:
        if "no_split" not in str(exc).lower():
            raise
        # a custom class without _no_split_modules: accelerate cannot split it, so the one device it is
        kwargs.update(device_map={"": str(request.device)})
        kwargs.pop("offload_folder", None)
        model = cls.from_pretrained(path, **kwargs)
    return model.eval()


def _output(model, ids: torch.Tensor) -> tuple[torch.Tensor, str]:
    with torch.no_grad():
        out = model(input_ids=to_model(ids.reshape(1, -1), model))
    if getattr(out, "logits", None) is not None:
        return out.logits[0].float().cpu(), "logits"
    return out.last_hidden_state[0].float().cpu(), "hidden_states"


class VerificationFailed(Exception):
    """A verification that measured a NaN or infinite figure: whatever the tolerance, the run fails (the command
    line prints its one line and exits with status 1). Not a ``ValueError``: the input was not wrong, the model is."""


def non_finite(figures: dict) -> list[str]:
    """The names of the figures in ``figures`` (``{name: number or None}``) that are NaN or infinite."""
    return [k for k, v in figures.items() if isinstance(v, (int, float)) and not math.isfinite(v)]


@dataclass
class Verification:
    """What :func:`verify` measured; ``as_dict()`` is what cards and JSON reports record."""

    max_abs_dlogit: float
    output_kind: str  # "logits" or "hidden_states"
    tokens: int  # tokens compared for max |Δ|
    text: str  # public label of the text (embedded name or file name)
    perplexity_original: float | None = None
    perplexity_converted: float | None = None
    ppl_tokens: int | None = None
    ppl_window: int | None = None
    ppl_stride: int | None = None
    hidden_cosine: float | None = None  # encoders: mean cosine of last hidden states
    seconds: float = 0.0  # the whole verification, the speed comparison included
    text_path: str | None = field(default=None, repr=False)  # local only, never recorded
    speed: SpeedComparison | None = field(default=None, repr=False)  # with speed=True: a timing, not exactness

    @property
    def delta_perplexity(self) -> float | None:
        if self.perplexity_original is None or self.perplexity_converted is None:
            return None
        return self.perplexity_converted - self.perplexity_original

    def describe_perplexity(self) -> str:
        return PerplexityWindows(self.ppl_tokens, self.ppl_window, self.ppl_stride).describe()

    def failure(self) -> str | None:
        """Why this verification fails whatever the tolerance (a figure is NaN or infinite), or None: the one
        place that decides it, for ``verify`` and for every conversion's verification."""
        kind = "logit" if self.output_kind == "logits" else "hidden state"
        names = {
            "max_abs_dlogit": f"max |Δ{kind}|",
            "perplexity_original": "the original's perplexity",
            "perplexity_converted": "the converted model's perplexity",
            "hidden_cosine": "the mean cosine of last hidden states",
        }
        bad = non_finite({k: getattr(self, k) for k in names})
        return ", ".join(f"{names[k]} is {getattr(self, k)}" for k in bad) or None

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("text_path", "speed") and v is not None}
        d["delta_perplexity"] = self.delta_perplexity
        return d


def _text_ids(tokenizer, text, count: int) -> tuple[torch.Tensor, Path]:
    path = resolve_text(text)
    return tokenize_text(tokenizer, read_text(path), max_tokens=count), path


def _steps(n_logit: int, n_ppl: int, causal: bool) -> int:
    return 2 + (windows(n_ppl, PPL.window, PPL.stride) if causal and n_ppl > 1 else 0)


def verify(
    original: str | os.PathLike,
    converted: str | os.PathLike,
    text: str | os.PathLike = DEFAULT_TEXT,
    tokens: int = LOGIT_TOKENS,
    ppl_tokens: int = PPL.tokens,
    device: str | DeviceRequest | None = "auto",
    trust_remote_code: bool | None = None,
    progress: bool = True,
) -> Verification:
    """Compare ``converted`` with ``original`` on the first tokens of ``text``: max |Δlogit| over
    ``tokens`` tokens (hidden states and their mean cosine for encoders) and, for causal LMs,
    both perplexities over ``ppl_tokens`` tokens (:data:`PPL`'s window and stride; 0 skips).
    The two models are loaded one after the other, so memory holds one model at a time
    (:class:`Verifier`, which also times the two where asked)."""
    return Verifier(text, tokens, ppl_tokens, device, trust_remote_code, progress).run(original, converted)


@dataclass(frozen=True)
class Verifier:
    """How :func:`verify` compares two models (its keywords), and ``speed``: where the two fit the device together
    (:func:`~.speed.speed_device`), the original is kept until the converted model is loaded, the two are timed
    against each other (``Verification.speed``: :mod:`.speed`; None when a figure is not finite), and the original
    is let go before the converted model is scored: one load of each model serves both (every conversion's
    verification, ``commands/common.verify_output``)."""

    text: str | os.PathLike = DEFAULT_TEXT
    tokens: int = LOGIT_TOKENS
    ppl_tokens: int = PPL.tokens
    device: str | DeviceRequest | None = "auto"
    trust_remote_code: bool | None = None
    progress: bool = True
    speed: bool = False

    def run(self, original: str | os.PathLike, converted: str | os.PathLike) -> Verification:
        """The :class:`Verification` of ``converted`` against ``original``."""
        text, tokens, ppl_tokens = self.text, self.tokens, self.ppl_tokens
        if tokens < 2 or ppl_tokens < 0:
            raise ValueError(f"need --tokens >= 2 and --ppl-tokens >= 0; got {tokens} and {ppl_tokens}")
        start = time.perf_counter()
        tokenizer = load_tokenizer(original)
        ids, path = _text_ids(tokenizer, text, max(tokens, ppl_tokens))
        held = speed_device(original, converted, self.device) if self.speed else None  # both on it, or one at a time
        results, kind, kept, timed = [], "logits", None, None
        bar = tqdm(desc="verifying", total=4, disable=not self.progress, leave=False, unit="step")
        try:
            for which in (original, converted):
                bar.set_postfix_str(f"loading {Path(str(which)).name}")
                where = self.device if held is None else str(held)
                model = load_for_eval(which, device=where, trust_remote_code=self.trust_remote_code)
                bar.update(1)
                if kept is not None:  # both loaded: timed, then the original goes before the converted is scored
                    bar.set_postfix_str("timing both")
                    timed = compare_loaded((kept, model), _text_ids(tokenizer, text, PREFILL_TOKENS)[0], held)
                    kept = None
                    gc.collect()
                bar.set_postfix_str(f"scoring {Path(str(which)).name}")
                out, kind, ppl = _score(model, ids, tokens, ppl_tokens, bar)
                results.append((out, ppl))
                if held is not None and len(results) == 1:
                    kept = model
                del model
                gc.collect()
        finally:
            bar.close()
            kept = None
            gc.collect()
        v = _verification(results, kind, text, path)
        v.speed = timed if v.failure() is None else None  # (a failed verification records no speed)
        v.seconds = time.perf_counter() - start
        return v


def _score(model, ids: torch.Tensor, tokens: int, ppl_tokens: int, bar) -> tuple[torch.Tensor, str, object]:
    """One model's outputs on the first ``tokens`` ids (its positions allowing), their kind, and its perplexity
    on the first ``ppl_tokens`` (None for an encoder or ``ppl_tokens`` < 2); ``bar`` counts the steps."""
    limit = getattr(model.config, "max_position_embeddings", None) or tokens
    head = ids[: min(tokens, limit)]
    causal = is_causal_lm(model)
    if bar.total == 4:  # (the first model: now the steps are known)
        bar.total = 2 * _steps(head.numel(), min(ppl_tokens, ids.numel()), causal)
        bar.refresh()
    out, kind = _output(model, head)
    bar.update(1)
    ppl = perplexity(model, ids[:ppl_tokens], PPL.window, PPL.stride, bar=bar) if causal and ppl_tokens > 1 else None
    return out, kind, ppl


def _verification(results: list, kind: str, text, path: Path) -> Verification:
    """The figures of the two models' ``(outputs, perplexity)`` (original first)."""
    (a, pa), (b, pb) = results
    v = Verification((a - b).abs().max().item(), kind, a.shape[0], public_text_label(text), text_path=str(path))
    if kind == "hidden_states":
        v.hidden_cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    if pa is not None and pb is not None:
        v.perplexity_original, v.perplexity_converted = pa.perplexity, pb.perplexity
        v.ppl_tokens, v.ppl_window, v.ppl_stride = pb.tokens, pb.window, pb.stride
    return v


def perplexities(
    models: dict[str, str | os.PathLike],
    text: str | os.PathLike = DEFAULT_TEXT,
    ppl_tokens: int = PPL.tokens,
    tokenizer_from: str | os.PathLike | None = None,
    device: str | DeviceRequest | None = "auto",
    trust_remote_code: bool | None = None,
    progress: bool = True,
):
    """``{name: PerplexityResult}`` for several causal LMs on the same tokens of ``text``
    (:data:`PPL`), loading one model at a time. Returns (results, text path)."""
    if ppl_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens; got {ppl_tokens}")
    tokenizer = load_tokenizer(tokenizer_from or next(iter(models.values())))
    ids, path = _text_ids(tokenizer, text, ppl_tokens)
    out = {}
    per_model = 1 + windows(ids.numel(), PPL.window, PPL.stride)
    with tqdm(desc="perplexity", total=per_model * len(models), disable=not progress, leave=False, unit="step") as bar:
        for name, folder in models.items():
            bar.set_postfix_str(f"loading {name}")
            model = load_for_eval(folder, device=device, trust_remote_code=trust_remote_code)
            bar.update(1)
            if not is_causal_lm(model):
                raise ValueError(f"{name} is not a causal LM ({type(model).__name__}); perplexity needs one")
            bar.set_postfix_str(f"scoring {name}")
            out[name] = perplexity(model, ids, PPL.window, PPL.stride, bar=bar)
            del model
            gc.collect()
    return out, path
