"""The quantizer ``llama-quantize`` will apply, as the scale search sees it (``rotate --for-quantization
--target gguf-imatrix``).

``llama-quantize MODEL OUT Q4_K_M`` does not quantize every matrix to one type: its mixture (``src/llama-quant.cpp``
``llama_tensor_get_type_impl`` of llama.cpp ``0c1e57098``) puts ``attn_v`` and ``ffn_down`` of some layers in more
bits, and a tensor whose rows do not fill the type's blocks falls back to a 32-block type
(``tensor_type_fallback``: Q4_K -> Q5_0, Q3_K -> Q4_0, Q5_K -> Q5_1, Q6_K -> Q8_0). :func:`tensor_type` follows those
rules for the dense decoders this project converts (no experts, not Falcon, not a 70B), for the file types in
:data:`FTYPES`; :func:`layer_quantizers` gives the search one quantizer per exact scaling site, each the
concatenation of its readers' types, applied with the importance matrix of the *scaled* layer
(:mod:`hf_symmetry.evaluation.ggml_quants`, llama.cpp's weighted searches emulated bit for bit).
"""

from __future__ import annotations

import torch

from ...evaluation.ggml_quants import BLOCK, roundtrip

#: llama-quantize file type -> the base type of its matrices
FTYPES = {
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q8_0": "Q8_0",
    "Q3_K_S": "Q3_K",
    "Q3_K_M": "Q3_K",
    "Q4_K_S": "Q4_K",
    "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K",
    "Q5_K_M": "Q5_K",
    "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL",
}
FALLBACK = {"Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(
    ftype: str, linear: str, layer: int, n_layers: int, n_cols: int, n_gqa: int = 1, imatrix: bool = True
) -> str:
    """The ggml type ``llama-quantize ... FTYPE`` gives decoder linear ``linear`` (q, k, v, o, gate, up, down) of
    layer ``layer`` with rows of ``n_cols`` (``imatrix``: whether ``--imatrix`` was given; it changes Q4_0's,
    Q5_0's and IQ4_NL's first ``ffn_down`` layers)."""
    if ftype not in FTYPES:
        raise ValueError(f"llama-quantize type {ftype!r} is not emulated; choose one of {', '.join(FTYPES)}")
    t = FTYPES[ftype]
    i, n = layer, n_layers
    if linear == "v":
        if ftype == "Q3_K_M":
            t = "Q5_K" if i < 2 else "Q4_K"
        elif ftype == "IQ4_NL" and n_gqa >= 4:
            t = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and i < 4:
            t = "Q5_K"
    elif linear == "down":
        if ftype == "Q3_K_M":
            t = "Q5_K" if i < n // 16 else "Q4_K"
        elif ftype == "Q4_K_M":
            t = "Q6_K" if use_more_bits(i, n) else t
        elif i < n // 8 and ftype == "IQ4_NL" and not imatrix:
            t = "Q5_K"
        elif ftype == "Q5_K_M" and use_more_bits(i, n):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and i < n // 8:
            t = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and imatrix and i < n // 8:
            t = "Q4_1" if ftype == "Q4_0" else "Q5_1"
    elif linear == "o" and ftype == "Q3_K_M":
        t = "Q4_K"

    if n_cols % BLOCK[t]:
        t = FALLBACK.get(t, t)
        if n_cols % BLOCK[t]:
            raise ValueError(f"{linear} of {n_cols} columns fits no block of {t}: llama-quantize would keep it F16")
    return t


class GGMLQuantizer:
    """``A -> dequantize(quantize(A))`` for a stack of readers (rows ``[r_0, r_1, ...)`` of types ``[t_0, t_1,
    ...]``) as llama-quantize computes it, with the column importance ``h`` (``E[x_j²]`` of the layer as it will be
    written; None: no importance matrix)."""

    uses_importance = True

    def __init__(self, segments: list[tuple[int, str]], imatrix: bool = True, stride: int = 1):
        self.segments = segments
        self.imatrix = imatrix
        self.stride = stride
        self.sample = self._sample if stride > 1 else None

    def _sample(self) -> tuple[torch.Tensor, GGMLQuantizer]:
        """Every ``stride``-th row of each segment and the quantizer of those rows: llama.cpp quantizes rows
        independently, so the scale search can measure its error on a sample of rows (``stride`` times faster)."""
        rows, segments, start = [], [], 0
        for n, qtype in self.segments:
            keep = torch.arange(start, start + n, self.stride)
            rows.append(keep)
            segments.append((len(keep), qtype))
            start += n
        return torch.cat(rows), GGMLQuantizer(segments, self.imatrix)

    def __call__(self, A: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        h = h.to(torch.float32) if (self.imatrix and h is not None) else None
        out, start = [], 0
        for rows, qtype in self.segments:
            out.append(torch.from_numpy(roundtrip(A[start : start + rows].to(torch.float32), qtype, h)))
            start += rows
        if start != A.shape[0]:
            raise ValueError(f"quantizer for {start} rows got {A.shape[0]}")
        return torch.cat(out)

    def __repr__(self) -> str:
        return f"GGMLQuantizer({self.segments}, imatrix={self.imatrix})"


#: the scale search measures the emulated quantizers' error on every 4th row (4x faster; rows are independent)
SEARCH_STRIDE = 4
SITE_READERS = {"o": ("o",), "down": ("down",), "attn_norm": ("q", "k", "v"), "ffn_norm": ("gate", "up")}


def layer_types(ftype: str, layer: dict, i: int, n_layers: int, n_gqa: int, imatrix: bool = True) -> dict[str, str]:
    """``{linear: ggml type}`` of one canonical layer (its tensors ``{name}.weight``)."""
    return {
        lin: tensor_type(ftype, lin, i, n_layers, layer[f"{lin}.weight"].shape[1], n_gqa, imatrix)
        for lin in ("q", "k", "v", "o", "gate", "up", "down")
        if f"{lin}.weight" in layer
    }


def layer_quantizers(
    ftype: str, layer: dict, i: int, n_layers: int, n_gqa: int, imatrix: bool = True, stride: int = SEARCH_STRIDE
) -> dict[str, GGMLQuantizer]:
    """One :class:`GGMLQuantizer` per exact scaling site of :func:`.scales.apply_scales` (``o``, ``down``,
    ``attn_norm`` for q, k, v, ``ffn_norm`` for gate, up), each with its readers' llama-quantize types; the search
    measures the error on every ``stride``-th row."""
    types = layer_types(ftype, layer, i, n_layers, n_gqa, imatrix)
    return {
        site: GGMLQuantizer(
            [(layer[f"{lin}.weight"].shape[0], types[lin]) for lin in readers if lin in types],
            imatrix=imatrix,
            stride=stride,
        )
        for site, readers in SITE_READERS.items()
    }
