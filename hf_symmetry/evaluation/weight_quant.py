"""Weight-only quantization with real quantizers, dequantized back into a float model for evaluation.

Every decoder-layer linear is quantized and dequantized in place; embeddings, norms and the head
stay in float. A quantizer is named by a string and parsed by :func:`quantizer` into a
:class:`WeightQuantizer`, which owns its behaviour (``roundtrip``, ``bits_per_weight``, ``group``).
The kinds (:data:`KINDS`):

* GGUF block types through the ``gguf`` package's own Python quantizers (``Q4_0``, ``Q4_1``,
  ``Q5_0``, ``Q5_1``, ``Q8_0``, ``MXFP4``): blocks of 32 along the input dimension, exactly what
  llama.cpp stores. The package implements no Python quantizer for the k-quants (Q4_K, Q3_K, …;
  it only dequantizes them), so 3 bits come from HQQ.
* HQQ (``hqq`` package, optional extra ``quant``): ``hqq{bits}g{group}`` for 1, 2, 3, 4 or 8 bits,
  asymmetric, group along the input dimension, zero point optimised by half-quadratic splitting
  (calibration-free; transformers serves it through ``HqqConfig``). Its optimiser costs about
  5 s per million weights on two CPU cores, so ``hqq{bits}g{group}-rtn`` is the same library's
  quantizer without it (``optimize=False``: asymmetric min-max round-to-nearest per group).
* bitsandbytes 4-bit (``bitsandbytes`` package, optional extra ``quant``): ``bnb-nf4`` and
  ``bnb-fp4``, blocks of 64 (bitsandbytes' default and ``BitsAndBytesConfig``'s), ``bnb-nf4-g32``
  etc. for another block size; what ``bnb.nn.Linear4bit`` / ``load_in_4bit`` compute with (CPU
  NF4 and FP4 need bitsandbytes >= 0.47; 0.46 quantizes NF4 only, 0.45 neither).
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import gguf
import numpy as np
import torch
from gguf import quants

from ..architectures import adapter_for


@dataclass(frozen=True)
class WeightQuantizer(ABC):
    """One quantizer: ``roundtrip(W)`` is ``dequantize(quantize(W))`` in float32 for ``W`` of shape
    ``[out, in]``, in groups (blocks) of ``group`` consecutive weights along ``in``."""

    name: str
    group: int

    #: the names this kind parses (a full-match regular expression) and how to write them in an error
    pattern: ClassVar[re.Pattern]
    syntax: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_match(cls, name: str, m: re.Match) -> WeightQuantizer: ...

    @property
    @abstractmethod
    def bits_per_weight(self) -> float:
        """Storage cost per weight, the per-group scale (and zero point) included."""

    @abstractmethod
    def _roundtrip(self, W: torch.Tensor) -> torch.Tensor: ...

    def check(self, shape: torch.Size | tuple[int, ...]) -> None:
        """Refuse a weight whose input dimension is not a whole number of groups."""
        if len(shape) != 2 or shape[1] % self.group:
            raise ValueError(
                f"{self.name} quantizes [out, in] weights in groups of {self.group} along in: got shape {tuple(shape)}"
            )

    @torch.no_grad()
    def roundtrip(self, W: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(W))`` in float32, same shape as ``W`` (any float dtype in)."""
        self.check(W.shape)
        return self._roundtrip(W.detach().to(device="cpu", dtype=torch.float32).contiguous()).reshape(W.shape)


@dataclass(frozen=True)
class GGUFQuantizer(WeightQuantizer):
    """A llama.cpp block type through the ``gguf`` package's quantizer (blocks of 32 along ``in``)."""

    pattern: ClassVar[re.Pattern] = re.compile(r"Q4_0|Q4_1|Q5_0|Q5_1|Q8_0|MXFP4")
    syntax: ClassVar[str] = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4"
    #: bits per weight: the codes plus a float16 scale (and float16 minimum for the _1 types) per 32;
    #: MXFP4: 4-bit E2M1 codes and one 8-bit power-of-two scale per 32
    BITS: ClassVar[dict[str, float]] = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "MXFP4": 4.25}

    @classmethod
    def from_match(cls, name: str, m: re.Match) -> GGUFQuantizer:
        return cls(name, 32)

    @property
    def bits_per_weight(self) -> float:
        return self.BITS[self.name]

    def _roundtrip(self, W: torch.Tensor) -> torch.Tensor:
        qtype = gguf.GGMLQuantizationType[self.name]
        q = quants.quantize(W.numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(q, qtype)))


@dataclass(frozen=True)
class HQQQuantizer(WeightQuantizer):
    """HQQ's asymmetric group quantizer (``hqq`` package), with or without its zero-point optimiser."""

    bits: int = 4
    optimize: bool = True

    pattern: ClassVar[re.Pattern] = re.compile(r"hqq([12348])g(\d+)(-rtn)?")
    syntax: ClassVar[str] = "hqq<bits>g<group>[-rtn] (bits 1, 2, 3, 4, 8)"

    @classmethod
    def from_match(cls, name: str, m: re.Match) -> HQQQuantizer:
        return cls(name, int(m.group(2)), bits=int(m.group(1)), optimize=not m.group(3))

    @property
    def bits_per_weight(self) -> float:
        return self.bits + 32 / self.group  # float16 scale and zero per group

    def _roundtrip(self, W: torch.Tensor) -> torch.Tensor:
        try:
            from hqq.core.quantize import Quantizer  # optional dependency
        except ImportError as e:  # pragma: no cover - optional
            raise ImportError(
                f"{self.name} needs the 'hqq' package: pip install 'hf-symmetry[quant]' (or pip install hqq)"
            ) from e
        Wq, meta = Quantizer.quantize(
            W,
            nbits=self.bits,
            group_size=self.group,
            optimize=self.optimize,
            axis=1,
            device="cpu",
            compute_dtype=torch.float32,
            bitpack=False,
        )
        meta["compute_dtype"] = torch.float32
        return Quantizer.dequantize(Wq, meta).to(torch.float32)


class _DropKernelsHubNotice(logging.Filter):
    """bitsandbytes (0.50) logs a warning at import on CPUs with AVX512-BF16 when the optional
    ``kernels`` package (a Hub download of a fused CPU kernel) is absent; nothing here uses that kernel."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


def _bnb_functional():
    """``bitsandbytes.functional``, imported without its notice about the optional CPU kernel."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")  # the module's own logger (getLogger(__name__))
    notice = _DropKernelsHubNotice()
    log.addFilter(notice)
    try:
        import bitsandbytes.functional as F  # optional dependency
    except ImportError as e:  # pragma: no cover - optional
        raise ImportError(
            "bitsandbytes quantizers need the 'bitsandbytes' package: pip install 'hf-symmetry[quant]'"
        ) from e
    finally:
        log.removeFilter(notice)
    return F


@dataclass(frozen=True)
class BnbQuantizer(WeightQuantizer):
    """bitsandbytes' 4-bit blockwise quantizer (``functional.quantize_4bit`` / ``dequantize_4bit``, the
    pair ``bnb.nn.Linear4bit`` uses) on CPU in float32: ``nf4`` (the NormalFloat codebook, non-uniform)
    or ``fp4``; each block of ``group`` weights is scaled by its absolute maximum.

    bitsandbytes blocks run over the flattened row-major tensor, not along a dimension; with ``in`` a
    multiple of the block size (:meth:`check` insists) that is exactly groups along the input
    dimension. Otherwise a block would straddle two rows, and bitsandbytes 0.50.2's CPU
    ``dequantize_4bit`` kernel disagrees with its own quantizer: it reads one absmax per row-local
    block (measured on a gaussian 1536x576 at block size 128: relative error 0.219, against 0.096 from
    its pure-torch dequantizer and from bitsandbytes 0.46.1 / 0.47.0).

    The absmax is kept in float32 (``compress_statistics=False``: no double quantization, as
    ``BitsAndBytesConfig``'s default ``bnb_4bit_use_double_quant=False``), so storage is
    ``4 + 32 / group`` bits per weight (4.5 at the default 64)."""

    quant_type: str = "nf4"

    pattern: ClassVar[re.Pattern] = re.compile(r"bnb-(nf4|fp4)(?:-g(32|64|128|256))?")
    syntax: ClassVar[str] = "bnb-nf4, bnb-fp4 (blocks of 64), bnb-{nf4,fp4}-g{32,128,256}"

    @classmethod
    def from_match(cls, name: str, m: re.Match) -> BnbQuantizer:
        return cls(name, int(m.group(2) or 64), quant_type=m.group(1))

    @property
    def bits_per_weight(self) -> float:
        return 4 + 32 / self.group

    def _roundtrip(self, W: torch.Tensor) -> torch.Tensor:
        F = _bnb_functional()
        q, state = F.quantize_4bit(W, blocksize=self.group, quant_type=self.quant_type, compress_statistics=False)
        return F.dequantize_4bit(q, state).to(torch.float32)


#: every kind of quantizer, in the order names are tried
KINDS: tuple[type[WeightQuantizer], ...] = (GGUFQuantizer, HQQQuantizer, BnbQuantizer)


def quantizer(name: str | WeightQuantizer) -> WeightQuantizer:
    """The quantizer a name stands for (a :class:`WeightQuantizer` is returned as it is)."""
    if isinstance(name, WeightQuantizer):
        return name
    for kind in KINDS:
        m = kind.pattern.fullmatch(name)
        if m:
            return kind.from_match(name, m)
    raise ValueError(f"unknown quantizer {name!r}: one of {'; '.join(k.syntax for k in KINDS)}")


def roundtrip(W: torch.Tensor, name: str | WeightQuantizer) -> torch.Tensor:
    """``dequantize(quantize(W))`` in float32, for ``W`` of shape ``[out, in]`` (groups along ``in``)."""
    return quantizer(name).roundtrip(W)


def bits_per_weight(name: str | WeightQuantizer) -> float:
    """Storage cost including the per-group scale (and zero point)."""
    return quantizer(name).bits_per_weight


def decoder_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """Every ``nn.Linear`` inside the decoder layers (not the head, not the embeddings), the layers
    found through the family's adapter."""
    adapter = adapter_for(model.config, list(model.state_dict()))
    layers = model.get_submodule(adapter.prefix + adapter.spec.layers)
    return [
        (f"layers.{i}.{n}", m)
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]


@torch.no_grad()
def quantize_model_(model, name: str | WeightQuantizer) -> dict:
    """Replace every decoder-layer linear's weight by its quantized-dequantized copy (in place).
    Returns the relative Frobenius error of all weights together. Every weight's shape is checked
    before the first one changes."""
    q = quantizer(name)
    linears = decoder_linears(model)
    if not linears:
        raise ValueError(f"{type(model).__name__}: no nn.Linear in the decoder layers to quantize")
    for _, lin in linears:
        q.check(lin.weight.shape)
    err = ref = 0.0
    for _, lin in linears:
        W = lin.weight.data
        Wq = q.roundtrip(W).to(W.dtype)
        err += (Wq.double() - W.double()).pow(2).sum().item()
        ref += W.double().pow(2).sum().item()
        lin.weight.data.copy_(Wq)
    return {"relative_error": (err / ref) ** 0.5}
