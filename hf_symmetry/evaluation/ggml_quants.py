"""llama.cpp's importance-matrix quantizers, emulated bit for bit (``llama-quantize --imatrix``).

With an importance matrix, ``llama-quantize`` does not round a weight block to its nearest grid point: each
type searches its block scales (and minima) for the smallest *weighted* error ``Σ_j w_j (x_j − q_j)²``, where
``w_j`` comes from the importance matrix entry of input column ``j`` (the mean square activation that
``llama-imatrix`` collected, ``E[x_j²]``), mostly as ``w_j = imatrix_j · sqrt(σ² + x_j²)``. The ``gguf`` package
has no such quantizer (its Python quantizers take no weights and stop at the 32-blocks), so this module follows
ggml's own C code (``ggml/src/ggml-quants.c`` of llama.cpp ``0c1e57098``: ``make_qx_quants``,
``make_qkx3_quants``, ``make_qp_quants``, ``quantize_row_*_impl``, ``quantize_iq4_nl``) step by step in float32
numpy, every sum accumulated in the C loop's order (``np.cumsum`` is sequential), so that the dequantized
weights are the ones ``llama-quantize`` writes (tests/evaluation/test_ggml_quants.py compares them with recorded
``llama-quantize`` output, bit for bit, for every type here). This holds for a build without fused
multiply-add in ggml-base (x86-64 with ``GGML_NATIVE=OFF``); a build that contracts ``a*b + c`` into FMA may
round an occasional tie differently.

Types: ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0`` (blocks of 32), ``Q3_K``, ``Q4_K``, ``Q5_K``, ``Q6_K``
(super-blocks of 256), ``IQ4_NL`` (blocks of 32, non-uniform levels), each with an importance matrix and
without one (llama.cpp's reference quantizers, ``quantize_row_*_ref``).

:func:`roundtrip` returns the dequantized weight for ``[rows, n_per_row]`` float32 input and an importance
vector of length ``n_per_row`` (or None).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
QK_K = 256
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

#: elements per block of each type (the row length must be a multiple)
BLOCK = {
    "Q4_0": 32,
    "Q4_1": 32,
    "Q5_0": 32,
    "Q5_1": 32,
    "Q8_0": 32,
    "IQ4_NL": 32,
    "Q3_K": QK_K,
    "Q4_K": QK_K,
    "Q5_K": QK_K,
    "Q6_K": QK_K,
}
#: bits per weight of each type (codes plus block scales and minima, as llama.cpp stores them)
BITS = {
    "Q4_0": 4.5,
    "Q4_1": 5.0,
    "Q5_0": 5.5,
    "Q5_1": 6.0,
    "Q8_0": 8.5,
    "IQ4_NL": 4.5,
    "Q3_K": 3.4375,
    "Q4_K": 4.5,
    "Q5_K": 5.5,
    "Q6_K": 6.5625,
}


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in float32, left to right (the C loop's ``s += a[i]``)."""
    return np.cumsum(a, axis=-1, dtype=F32)[..., -1]


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even (its magic-number trick), as int32."""
    return np.rint(v).astype(np.int32)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's ``roundf``: half away from zero, exactly (no ``|v| + 0.5`` rounding)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= F32(0.5), np.sign(v), F32(0)).astype(F32)


def _fp16(v: np.ndarray) -> np.ndarray:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))`` (round to nearest even)."""
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def _signed_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the entry of largest magnitude (the first one on ties) and that magnitude."""
    idx = np.argmax(np.abs(x), axis=-1)
    mx = np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return mx, np.abs(mx)


def make_qx_quants(x: np.ndarray, nmax: int, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` on every row of ``x`` ``[blocks, n]``: the
    symmetric scale searched over 19 candidate grids for the least weighted error (weights ``qw``, else
    ``x²``). Returns ``(scale [blocks], L [blocks, n] in 0 .. 2·nmax−1)``."""
    x = x.astype(F32, copy=False)
    w = (x * x) if qw is None else qw.astype(F32, copy=False)
    mx, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    safe = np.where(zero, F32(1), mx).astype(F32)
    fn = F32(nmax)

    def candidate(iscale):
        lv = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lv.astype(F32)
        return lv, _seq_sum(w * x * lf), _seq_sum(w * lf * lf)

    iscale = (F32(-nmax) / safe).astype(F32)
    lv, sumlx, suml2 = candidate(iscale)
    L = lv + nmax
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
    best = (scale * sumlx).astype(F32)
    for i in range(-9, 10):
        if i == 0:
            continue
        iscale = (-(fn + F32(0.1) * F32(i)) / safe).astype(F32)
        lv, sumlx, suml2 = candidate(iscale)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        if take.any():
            L = np.where(take[:, None], lv + nmax, L)
            with np.errstate(divide="ignore", invalid="ignore"):
                new_scale = (sumlx / suml2).astype(F32)
            scale = np.where(take, new_scale, scale)
            best = np.where(take, (new_scale * sumlx).astype(F32), best)
    scale = np.where(zero, F32(0), scale).astype(F32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` (Q3_K without an importance matrix): round to the
    max-scaled grid, then 5 coordinate passes on ``x²``-weighted least squares. Returns ``(scale, L)``,
    ``L`` in 0..2·nmax−1."""
    x = x.astype(F32, copy=False)
    mx, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    iscale = (F32(-nmax) / np.where(zero, F32(1), mx)).astype(F32)
    L = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
    w = (x * x).astype(F32)
    lf = L.astype(F32)
    sumlx, suml2 = _seq_sum(w * x * lf), _seq_sum(w * lf * lf)
    for _ in range(5):
        changed = np.zeros(x.shape[0], dtype=bool)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i].astype(F32)
            slx = (sumlx - wi * xi * li).astype(F32)
            sl2 = (suml2 - wi * li * li).astype(F32)
            ok = slx > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                new_l = np.clip(_nearest_int(np.where(ok, xi * sl2 / slx, F32(0))), -nmax, nmax - 1)
            ok &= new_l != L[:, i]
            nf = new_l.astype(F32)
            slx2 = (slx + wi * xi * nf).astype(F32)
            sl22 = (sl2 + wi * nf * nf).astype(F32)
            take = ok & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new_l, L[:, i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        if not changed.any():
            break
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero[:, None], 0, L + nmax)


def make_qkx3_quants(
    x: np.ndarray, nmax: int, w: np.ndarray, rmin=-0.9, rdelta=0.05, nstep: int = 36
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx3_quants`` (asymmetric: scale and minimum searched over ``nstep + 1`` grids, each
    solved by weighted least squares, the minimum kept ≤ 0). Returns ``(scale, the_min, L)``, ``the_min = −min``."""
    x = x.astype(F32, copy=False)
    w = w.astype(F32, copy=False)
    mn = np.minimum(x.min(axis=-1), F32(0)).astype(F32)
    mx = x.max(axis=-1).astype(F32)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    flat = mx <= mn
    span = np.where(flat, F32(1), mx - mn).astype(F32)
    iscale = (F32(nmax) / span).astype(F32)
    scale = (F32(1) / iscale).astype(F32)
    L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    diff = scale[:, None] * L.astype(F32) + mn[:, None] - x
    best = _seq_sum(w * (diff * diff))
    fn, frmin, fdelta = F32(nmax), F32(rmin), F32(rdelta)
    for i in range(nstep + 1):
        span = np.where(flat, F32(1), mx - mn).astype(F32)
        iscale = ((frmin + fdelta * F32(i) + fn) / span).astype(F32)
        laux = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = laux.astype(F32)
        wl = w * lf
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * lf), _seq_sum(wl * x)
        D = (sum_w * sum_l2 - sum_l * sum_l).astype(F32)
        ok = (D > 0) & ~flat
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = ((sum_w * sum_xl - sum_x * sum_l) / D).astype(F32)
            this_min = ((sum_l2 * sum_x - sum_l * sum_xl) / D).astype(F32)
            pos = this_min > 0
            this_scale = np.where(pos, (sum_xl / sum_l2).astype(F32), this_scale)
        this_min = np.where(pos, F32(0), this_min).astype(F32)
        diff = this_scale[:, None] * lf + this_min[:, None] - x
        mad = _seq_sum(w * (diff * diff))
        take = ok & (mad < best)
        if take.any():
            L = np.where(take[:, None], laux, L)
            best = np.where(take, mad, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
    scale = np.where(flat, F32(0), scale).astype(F32)
    L = np.where(flat[:, None], 0, L)
    return scale, (-mn).astype(F32), L


def make_qp_quants(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qp_quants`` (non-negative values ``x`` ``[blocks, n]``, e.g. the 8 sub-block scales of a
    Q4_K super-block, quantized to 0..nmax with weights ``qw``: 9 candidate grids, then 5 coordinate passes).
    Returns ``(scale, L)``."""
    x = x.astype(F32, copy=False)
    w = qw.astype(F32, copy=False)
    mx = np.maximum(x.max(axis=-1), F32(0)).astype(F32)
    zero = mx < GROUP_MAX_EPS
    safe = np.where(zero, F32(1), mx).astype(F32)
    fn = F32(nmax)
    iscale = (fn / safe).astype(F32)
    L = _nearest_int(iscale[:, None] * x)
    scale = (F32(1) / iscale).astype(F32)
    diff = x - scale[:, None] * L.astype(F32)
    best = _seq_sum(w * diff * diff)
    for i in range(-4, 5):
        if i == 0:
            continue
        iscale_i = ((F32(0.1) * F32(i) + fn) / safe).astype(F32)
        scale_i = (F32(1) / iscale_i).astype(F32)
        lv = np.minimum(_nearest_int(iscale_i[:, None] * x), nmax)
        diff = x - scale_i[:, None] * lv.astype(F32)
        mse = _seq_sum(w * diff * diff)
        take = mse < best
        best = np.where(take, mse, best)
        iscale = np.where(take, iscale_i, iscale).astype(F32)
    L = np.minimum(_nearest_int(iscale[:, None] * x), nmax)
    lf = L.astype(F32)
    sumlx = _seq_sum(w * x * lf)
    suml2 = _seq_sum(w * lf * lf)
    n = x.shape[-1]
    for _ in range(5):
        changed = np.zeros(x.shape[0], dtype=bool)
        for i in range(n):
            wi, xi, li = w[:, i], x[:, i], L[:, i].astype(F32)
            slx = (sumlx - wi * xi * li).astype(F32)
            sl2 = (suml2 - wi * li * li).astype(F32)
            ok = (slx > 0) & (sl2 > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                new_l = np.minimum(_nearest_int(np.where(ok, xi * sl2 / slx, F32(0))), nmax)
            ok &= new_l != L[:, i]
            nf = new_l.astype(F32)
            slx2 = (slx + wi * xi * nf).astype(F32)
            sl22 = (sl2 + wi * nf * nf).astype(F32)
            take = ok & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new_l, L[:, i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        if not changed.any():
            break
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    scale = np.where(zero, F32(0), scale).astype(F32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


# ---------------------------------------------------------------------------------------------- block types


def _row_sigma2(x: np.ndarray, per: int) -> np.ndarray:
    """``Σ x² / n_per_row`` of each row (Q4_0, Q4_1, Q5_0, Q5_1), repeated for each of its blocks of ``per``."""
    s = (_seq_sum(x * x) / F32(x.shape[1])).astype(F32)
    return np.repeat(s, x.shape[1] // per)


def _blocks(x: np.ndarray, per: int) -> np.ndarray:
    return x.reshape(-1, per)


def _weights(xb: np.ndarray, qw: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """``qw_j · sqrtf(σ² + x_j²)`` per block row."""
    return (qw * np.sqrt((sigma2[:, None] + xb * xb).astype(F32))).astype(F32)


def _tile(qw: np.ndarray, rows: int, per: int) -> np.ndarray:
    return np.tile(qw.astype(F32).reshape(-1, per), (rows, 1))


def _q_sym32(x, qw, nmax):
    """Q4_0 / Q5_0: ``quantize_row_q{4,5}_0_impl`` (imatrix) or the reference rounding without it."""
    rows = x.shape[0]
    xb = _blocks(x, 32)
    if qw is None:  # quantize_row_q4_0_ref / q5_0_ref: d = max / -nmax, (int8_t)(x·id + nmax + 0.5) clamped
        mx, _ = _signed_max(xb)
        d = (mx / F32(-nmax)).astype(F32)
        with np.errstate(divide="ignore"):
            idd = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
        v = (xb * idd[:, None] + F32(nmax + 0.5)).astype(F32)
        L = np.minimum(np.trunc(v).astype(np.int32), 2 * nmax - 1)
        return (L - nmax).astype(F32) * _fp16(d)[:, None]
    w = _weights(xb, _tile(qw, rows, 32), _row_sigma2(x, 32))
    d, L = make_qx_quants(xb, nmax, w)
    return (L - nmax).astype(F32) * _fp16(d)[:, None]


def _q_asym32(x, qw, nmax):
    """Q4_1 / Q5_1 with an imatrix: ``make_qkx3_quants(32, nmax, ..., -0.9, 0.05, 36)``; ``L·d + m``."""
    rows = x.shape[0]
    xb = _blocks(x, 32)
    if qw is None:  # quantize_row_q{4,5}_1_ref: min/max, (x − min)·id + 0.5 truncated
        mn, mx = xb.min(axis=-1).astype(F32), xb.max(axis=-1).astype(F32)
        d = ((mx - mn) / F32(nmax)).astype(F32)
        with np.errstate(divide="ignore"):
            idd = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
        L = np.trunc(((xb - mn[:, None]) * idd[:, None] + F32(0.5)).astype(F32)).astype(np.int32)
        L = np.minimum(L, nmax) if nmax == 15 else L
        return L.astype(F32) * _fp16(d)[:, None] + _fp16(mn)[:, None]
    w = _weights(xb, _tile(qw, rows, 32), _row_sigma2(x, 32))
    d, the_min, L = make_qkx3_quants(xb, nmax, w)
    return L.astype(F32) * _fp16(d)[:, None] + _fp16(-the_min)[:, None]


def _q8_0(x, qw):
    xb = _blocks(x, 32)
    amax = np.abs(xb).max(axis=-1).astype(F32)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        idd = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = _roundf((xb * idd[:, None]).astype(F32))
    return q.astype(F32) * _fp16(d)[:, None]


def _superblock_sigma2(xs: np.ndarray) -> np.ndarray:
    """``2 · Σ x² / QK_K`` of each super-block row ``[n, 256]``."""
    return (F32(2) * _seq_sum(xs * xs) / F32(QK_K)).astype(F32)


def _q_k_asym(x, qw, nmax):
    """Q4_K (nmax 15) / Q5_K (nmax 31) with an imatrix: ``quantize_row_q{4,5}_K_impl``."""
    rows = x.shape[0]
    xs = _blocks(x, QK_K)
    nsb = xs.shape[0]
    xb = xs.reshape(nsb * 8, 32)
    if qw is None:  # quantize_row_q{4,5}_K_ref: weights av_x + |x| per sub-block, 6-bit scales over the max
        av_x = np.sqrt((_seq_sum(xb * xb) / F32(32)).astype(F32))
        w = (av_x[:, None] + np.abs(xb)).astype(F32)
        step = (-1.0, 0.1, 20) if nmax == 15 else (-0.5, 0.1, 15)
        scales, mins, L = make_qkx3_quants(xb, nmax, w, *step)
        max_scale = np.maximum(scales.reshape(nsb, 8).max(axis=-1), F32(0)).astype(F32)
        max_min = np.maximum(mins.reshape(nsb, 8).max(axis=-1), F32(0)).astype(F32)
        with np.errstate(divide="ignore"):
            inv_s = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
            inv_m = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
        Ls = np.minimum(_nearest_int(inv_s[:, None] * scales.reshape(nsb, 8)), 63)
        Lm = np.minimum(_nearest_int(inv_m[:, None] * mins.reshape(nsb, 8)), 63)
        dd, dm = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    else:
        sigma2 = _superblock_sigma2(xs)
        w = _weights(xb, _tile(qw, rows, 32), np.repeat(sigma2, 8))
        sw = _seq_sum(w).reshape(nsb, 8)
        scales, mins, L = make_qkx3_quants(xb, nmax, w)
        d_block, Ls = make_qp_quants(scales.reshape(nsb, 8), 63, sw)
        m_block, Lm = make_qp_quants(mins.reshape(nsb, 8), 63, sw)
        Ls, Lm = np.minimum(Ls, 63), np.minimum(Lm, 63)
        dd, dm = _fp16(d_block), _fp16(m_block)
    d = (dd[:, None] * Ls.astype(F32)).astype(F32).reshape(-1)
    m = (dm[:, None] * Lm.astype(F32)).astype(F32).reshape(-1)
    live = d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int(((xb + m[:, None]) / np.where(live, d, F32(1))[:, None]).astype(F32)), 0, nmax)
    L = np.where(live[:, None], l2, L)
    return (d[:, None] * L.astype(F32) - m[:, None]).astype(F32)


def _q6_k(x, qw):
    """Q6_K: ``quantize_row_q6_K_impl`` (16-element scales by ``make_qx_quants(16, 32, .., qw)``; note the
    imatrix enters unmodified here)."""
    rows = x.shape[0]
    xs = _blocks(x, QK_K)
    nsb = xs.shape[0]
    xb = xs.reshape(nsb * 16, 16)
    scales, L = make_qx_quants(xb, 32, None if qw is None else _tile(qw, rows, 16))
    scales = scales.reshape(nsb, 16)
    max_scale, amax = _signed_max(scales)
    dead = amax < GROUP_MAX_EPS
    iscale = (F32(-128) / np.where(dead, F32(1), max_scale)).astype(F32)
    dd = _fp16(F32(1) / iscale)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127)
    d = (np.repeat(dd, 16) * sc.reshape(-1).astype(F32)).astype(F32)
    live = d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int((xb / np.where(live, d, F32(1))[:, None]).astype(F32)), -32, 31) + 32
    L = np.where(live[:, None], l2, L)
    out = (d[:, None] * (L - 32).astype(F32)).astype(F32)
    return np.where(np.repeat(dead, 16)[:, None], F32(0), out)


def _q3_k(x, qw):
    """Q3_K with an imatrix: ``quantize_row_q3_K_impl``."""
    rows = x.shape[0]
    xs = _blocks(x, QK_K)
    nsb = xs.shape[0]
    xb = xs.reshape(nsb * 16, 16)
    if qw is None:  # quantize_row_q3_K_ref: make_q3_quants, then 6-bit scales over the largest
        scales, L = make_q3_quants(xb, 4)
        max_scale, _ = _signed_max(scales.reshape(nsb, 16))
        live_sb = max_scale != 0
        iscale = (F32(-32) / np.where(live_sb, max_scale, F32(1))).astype(F32)
        Ls = np.clip(_nearest_int(iscale[:, None] * scales.reshape(nsb, 16)), -32, 31) + 32
        Ls = np.where(live_sb[:, None], Ls, 0)
        d_sb = np.where(live_sb, _fp16(F32(1) / iscale), F32(0)).astype(F32)
    else:
        sigma2 = _superblock_sigma2(xs)
        w = _weights(xb, _tile(qw, rows, 16), np.repeat(sigma2, 16))
        sw = _seq_sum(w).reshape(nsb, 16)
        scales, L = make_qx_quants(xb, 4, w)
        d_block, Ls = make_qx_quants(scales.reshape(nsb, 16), 32, sw)
        d_sb = _fp16(d_block)
    d = (np.repeat(d_sb, 16) * (Ls.reshape(-1) - 32).astype(F32)).astype(F32)
    live = d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int((xb / np.where(live, d, F32(1))[:, None]).astype(F32)), -4, 3) + 4
    L = np.where(live[:, None], l2, L)
    return (d[:, None] * (L - 4).astype(F32)).astype(F32)


def _best_index(v: np.ndarray) -> np.ndarray:
    """ggml's ``best_index_int8(16, kvalues_iq4nl, v)``: the nearest level, the lower one on ties."""
    vals = IQ4NL_VALUES.astype(F32)
    mu = np.clip(np.searchsorted(vals, v, side="right"), 1, 15)
    lower = (v - vals[mu - 1]).astype(F32) < (vals[mu] - v).astype(F32)
    idx = np.where(lower, mu - 1, mu)
    idx = np.where(v <= vals[0], 0, idx)
    return np.where(v >= vals[15], 15, idx)


def _iq4_nl(x, qw):
    """IQ4_NL: ``quantize_iq4_nl`` (``quantize_row_iq4_nl_impl(32, 32, ..., ntry=7)``)."""
    rows = x.shape[0]
    xb = _blocks(x, 32)
    vals = IQ4NL_VALUES.astype(F32)
    sigma2 = (_seq_sum(xb * xb) * (F32(2) / F32(32))).astype(F32)
    w = (xb * xb) if qw is None else _weights(xb, _tile(qw, rows, 32), sigma2)
    mx, amax = _signed_max(xb)
    dead = amax < GROUP_MAX_EPS
    safe = np.where(dead, F32(1), mx).astype(F32)
    d = (-safe / vals[0]).astype(F32)
    idd = (F32(1) / d).astype(F32)

    def sums(idd):
        q = vals[_best_index((idd[:, None] * xb).astype(F32))]
        wq = w * q
        return _seq_sum(wq * xb), _seq_sum(wq * q)

    sumqx, sumq2 = sums(idd)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
    best = (d * sumqx).astype(F32)
    for itry in range(-7, 8):
        idd = (F32(itry - 127) / safe).astype(F32)
        sumqx, sumq2 = sums(idd)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        with np.errstate(divide="ignore", invalid="ignore"):
            nd = (sumqx / sumq2).astype(F32)
        d = np.where(take, nd, d)
        best = np.where(take, (nd * sumqx).astype(F32), best)
    d = np.where(dead, F32(0), d).astype(F32)
    with np.errstate(divide="ignore"):
        idd = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = vals[_best_index((idd[:, None] * xb).astype(F32))]
    return (_fp16(d)[:, None] * q).astype(F32)


_IMPL = {
    "Q4_0": lambda x, qw: _q_sym32(x, qw, 8),
    "Q5_0": lambda x, qw: _q_sym32(x, qw, 16),
    "Q4_1": lambda x, qw: _q_asym32(x, qw, 15),
    "Q5_1": lambda x, qw: _q_asym32(x, qw, 31),
    "Q8_0": _q8_0,
    "Q3_K": _q3_k,
    "Q4_K": lambda x, qw: _q_k_asym(x, qw, 15),
    "Q5_K": lambda x, qw: _q_k_asym(x, qw, 31),
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
}
TYPES = tuple(_IMPL)


def roundtrip(W, qtype: str, imatrix=None) -> np.ndarray:
    """``dequantize(quantize(W))`` as ``llama-quantize`` computes it for a tensor of type ``qtype``: ``W``
    ``[rows, n_per_row]`` (float32; torch tensors are converted), ``imatrix`` the importance of each of the
    ``n_per_row`` input columns exactly as llama-quantize reads it (``in_sum2 / counts`` in float32; see
    :func:`hf_symmetry.conversion.quantization.imatrix.imatrix_values`) or None. Returns float32 numpy."""
    if qtype not in _IMPL:
        raise ValueError(f"unknown or unsupported ggml type {qtype!r}; supported: {', '.join(TYPES)}")
    x = np.ascontiguousarray(W.detach().cpu().numpy() if hasattr(W, "detach") else W, dtype=F32)
    if x.ndim != 2 or x.shape[1] % BLOCK[qtype]:
        raise ValueError(f"{qtype} quantizes rows in blocks of {BLOCK[qtype]}: got shape {x.shape}")
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(imatrix.detach().cpu().numpy() if hasattr(imatrix, "detach") else imatrix, F32)
        if qw.shape != (x.shape[1],):
            raise ValueError(f"importance matrix of {qw.shape} for rows of {x.shape[1]}")
    return _IMPL[qtype](x, qw).reshape(x.shape)
