"""Weight-only quantization with real quantizers, dequantized back into a float model for evaluation.

Every decoder-layer linear is quantized and dequantized in place; embeddings, norms and the head
stay in float. Quantizers (``QUANTIZERS``):

* GGUF block types through the ``gguf`` package's own Python quantizers (``Q4_0``, ``Q4_1``,
  ``Q5_0``, ``Q5_1``, ``Q8_0``, ``MXFP4``): blocks of 32 along the input dimension, exactly what
  llama.cpp stores. The package implements no Python quantizer for the k-quants (Q4_K, Q3_K, …;
  it only dequantizes them), so 3 bits come from HQQ.
* HQQ (``hqq`` package, optional): ``hqq{bits}g{group}`` for 2, 3, 4 or 8 bits, asymmetric,
  group along the input dimension, zero point optimised by half-quadratic splitting
  (calibration-free; transformers serves it through ``HqqConfig``). Its optimiser costs about
  5 s per million weights on two CPU cores, so ``hqq{bits}g{group}-rtn`` is the same library's
  quantizer without it (``optimize=False``: asymmetric min-max round-to-nearest per group).
"""

from __future__ import annotations

import re

import numpy as np
import torch

GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")


def _gguf_roundtrip(W: torch.Tensor, name: str) -> torch.Tensor:
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[name]
    a = W.detach().to(torch.float32).cpu().numpy()
    q = quants.quantize(a, qtype)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(q, qtype))).reshape(W.shape)


def _hqq_roundtrip(W: torch.Tensor, bits: int, group: int, optimize: bool = True) -> torch.Tensor:
    try:
        from hqq.core.quantize import Quantizer
    except ImportError as e:  # pragma: no cover - optional
        raise ImportError("HQQ quantizers need the 'hqq' package (pip install hqq termcolor einops)") from e
    Wq, meta = Quantizer.quantize(
        W.detach().to(torch.float32).cpu(),
        nbits=bits,
        group_size=group,
        optimize=optimize,
        axis=1,
        device="cpu",
        compute_dtype=torch.float32,
        bitpack=False,
    )
    meta["compute_dtype"] = torch.float32
    return Quantizer.dequantize(Wq, meta).reshape(W.shape).to(torch.float32)


def roundtrip(W: torch.Tensor, quantizer: str) -> torch.Tensor:
    """``dequantize(quantize(W))`` in float32, for ``W`` of shape ``[out, in]`` (groups along ``in``)."""
    if quantizer in GGUF_TYPES:
        return _gguf_roundtrip(W, quantizer)
    m = re.fullmatch(r"hqq(\d)g(\d+)(-rtn)?", quantizer)
    if m:
        return _hqq_roundtrip(W, int(m.group(1)), int(m.group(2)), optimize=not m.group(3))
    raise ValueError(f"unknown quantizer {quantizer!r}: one of {', '.join(GGUF_TYPES)}, hqq<bits>g<group>[-rtn]")


def bits_per_weight(quantizer: str) -> float:
    """Storage cost including the per-block scale/zero (float16 each for HQQ)."""
    table = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "MXFP4": 4.25}
    if quantizer in table:
        return table[quantizer]
    m = re.fullmatch(r"hqq(\d)g(\d+)(-rtn)?", quantizer)
    return int(m.group(1)) + 32 / int(m.group(2))


def decoder_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """Every ``nn.Linear`` inside the decoder layers (not the head, not the embeddings)."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    return [
        (f"layers.{i}.{n}", m)
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]


@torch.no_grad()
def quantize_model_(model, quantizer: str) -> dict:
    """Replace every decoder-layer linear's weight by its quantized-dequantized copy (in place).
    Returns the relative Frobenius error of all weights together."""
    err = ref = 0.0
    for _, lin in decoder_linears(model):
        W = lin.weight.data
        Wq = roundtrip(W, quantizer).to(W.dtype)
        err += (Wq.double() - W.double()).pow(2).sum().item()
        ref += W.double().pow(2).sum().item()
        lin.weight.data.copy_(Wq)
    return {"relative_error": (err / ref) ** 0.5}
