"""How fast a converted model runs against its source, measured on the machine that verifies it.

The verification (:func:`~.verification.verify` with ``speed=True``) holds both models on one device in the same
dtype when they fit it together (:func:`speed_device`), and :func:`compare_loaded` times them, in interleaved
rounds (the two models take turns, so a changing machine load falls on both alike): a prefill of the first tokens
of the verification text and single-token decode steps through the model's own cache after it. The figures are
the medians over the rounds of each model's time and of the per-round ratios (source time / converted time: above
1 the converted model is faster). A few forward passes on models already loaded: a rough figure for the card, not
a benchmark (``benchmarks/bench_deploy.py`` is the benchmark). Timings vary from run to run, so cards record them
only when a verification runs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..assets import resolve_model
from ..devices import DeviceRequest, parse_device, to_model
from ..modeling import cache_field
from .compare import is_causal_lm

#: tokens of the prefill, decode steps after it, interleaved rounds
PREFILL_TOKENS, DECODE_STEPS, ROUNDS = 64, 4, 3


@dataclass
class SpeedComparison:
    """What :func:`compare_loaded` measured; ``as_dict()`` is what cards and ``--json`` record."""

    device: str
    dtype: str
    threads: int | None  # torch's CPU threads (None on an accelerator)
    prefill_tokens: int
    decode_steps: int  # 0: an encoder (no decoding)
    rounds: int
    prefill_s: dict  # {"source", "converted"}: median seconds of one prefill
    decode_ms: dict | None  # {"source", "converted"}: median ms per decoded token
    prefill_speedup: float  # median of source time / converted time over the rounds (> 1: converted faster)
    decode_speedup: float | None
    seconds: float = 0.0  # the timing alone (the models were loaded by the verification)

    def as_dict(self) -> dict:
        return asdict(self)


def _fits_both(models: tuple[Path, Path], device: torch.device) -> bool:
    """Whether both models, at 4 bytes a parameter with a margin, fit the device's free memory."""
    need = 1.5 * sum(sum(f.stat().st_size for f in Path(m).glob("*.safetensors")) for m in models) * 2
    if device.type == "cuda":
        return need < torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return need < int(line.split()[1]) * 1024
    except OSError:
        pass
    return True  # no meminfo (not Linux): try


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_one(model, ids: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float | None]:
    """Seconds of one prefill of ``ids`` and seconds per decode step of ``steps`` greedy steps after it."""
    ids = to_model(ids, model)
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=steps > 0)
    _sync(device)
    prefill = time.perf_counter() - t0
    if steps == 0:
        return prefill, None
    field = cache_field()  # (the installed transformers' name of the KV cache)
    cache, nxt = getattr(out, field), out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, use_cache=True, **{field: cache})
        cache, nxt = getattr(out, field), out.logits[:, -1:].argmax(-1)
    _sync(device)
    return prefill, (time.perf_counter() - t0) / steps


def speed_device(
    original: str | os.PathLike, converted: str | os.PathLike, device: str | DeviceRequest | None = "auto"
) -> torch.device | None:
    """The one device the two models are timed on (``device`` read by :func:`~hf_symmetry.devices.parse_device`:
    ``auto`` is its one device, never spread), or None when the two together do not fit its free memory (the
    verification then loads one at a time and nothing is timed)."""
    dev = parse_device(device).device
    return dev if _fits_both((Path(resolve_model(original)), Path(resolve_model(converted))), dev) else None


def compare_loaded(
    models: tuple, ids: torch.Tensor, device: torch.device, decode_steps: int = DECODE_STEPS, rounds: int = ROUNDS
) -> SpeedComparison:
    """Time ``models`` (source, converted), both loaded whole on ``device`` in float32 (:func:`speed_device`), as
    the module docstring says, on the token ids ``ids`` (the first :data:`PREFILL_TOKENS` of the text)."""
    start = time.perf_counter()
    limit = min(getattr(m.config, "max_position_embeddings", None) or ids.numel() for m in models)
    ids = ids[: max(2, min(ids.numel(), limit - decode_steps))].reshape(1, -1)
    steps = decode_steps if all(is_causal_lm(m) for m in models) else 0
    times: list[list[tuple[float, float | None]]] = [[], []]
    with torch.no_grad():
        for m in models:  # warm-up: first-call allocations and kernel choices are not the model's speed
            _time_one(m, ids[:, :8], min(steps, 1), device)
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                times[i].append(_time_one(models[i], ids, steps, device))
    (src, out) = times
    median = statistics.median
    return SpeedComparison(
        device=str(device),
        dtype="float32",
        threads=torch.get_num_threads() if device.type == "cpu" else None,
        prefill_tokens=ids.shape[1],
        decode_steps=steps,
        rounds=rounds,
        prefill_s={"source": median(t[0] for t in src), "converted": median(t[0] for t in out)},
        decode_ms=None
        if not steps
        else {"source": 1e3 * median(t[1] for t in src), "converted": 1e3 * median(t[1] for t in out)},
        prefill_speedup=median(a[0] / b[0] for a, b in zip(src, out)),
        decode_speedup=median(a[1] / b[1] for a, b in zip(src, out)) if steps else None,
        seconds=time.perf_counter() - start,
    )
