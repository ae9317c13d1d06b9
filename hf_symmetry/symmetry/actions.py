"""Group actions on canonical (float64, ``[out, in]``) layer tensors. docs/math.md §1.

Each function takes the canonical dict of one layer (see
:mod:`hf_symmetry.architectures.adapter`) and returns a new dict; nothing is modified in
place. Biases are column vectors here, so the row-vector rule ``b -> b R`` reads ``b -> Rᵀ b``.
"""

from __future__ import annotations

import torch

from .groups import rope_commutant_violation
from .layout import HeadLayout

Tensors = dict[str, torch.Tensor]
_TOL = 1e-8


class NotASymmetry(ValueError):
    """A requested transform would change the model's function."""


def _check_orthogonal(R: torch.Tensor, what: str) -> None:
    eye = torch.eye(R.shape[0], dtype=R.dtype)
    err = (R.T @ R - eye).abs().max().item()
    if err > _TOL:
        raise NotASymmetry(f"{what} is not orthogonal (max |RᵀR - I| = {err:.2e})")


def _per_head(per_group: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """Expand one entry per KV group to one per query head (heads of a group are contiguous)."""
    return per_group.repeat_interleave(layout.group_size, dim=0)


def _rotate_row_blocks(W: torch.Tensor, Rs: torch.Tensor) -> torch.Tensor:
    """Block b of ``head_dim`` rows (or bias entries) becomes ``Rs[b]ᵀ @ block``."""
    n, d = Rs.shape[:2]
    return (Rs.transpose(1, 2) @ W.reshape(n, d, -1)).reshape(W.shape)


def _scale_row_blocks(W: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = scales.shape[0]
    return (W.reshape(n, -1) * scales[:, None]).reshape(W.shape)


class OwnedTensors(dict):
    """A layer dict whose holder gave it away (the streaming loop, for conversions that opt in):
    actions then update it in place, so each replaced tensor is freed at once instead of the
    whole layer being held twice. Plain dicts are never modified."""


def _new_dict(layer: Tensors) -> Tensors:
    return layer if isinstance(layer, OwnedTensors) else dict(layer)


def _map(layer: Tensors, fn, *names: str) -> Tensors:
    """A dict sharing untouched tensors, with ``fn`` applied to the named ones present (a new
    dict, or the same one for :class:`OwnedTensors`)."""
    out = _new_dict(layer)
    for name in names:
        if name in out:
            out[name] = fn(out[name])
    return out


def rotate_qk(layer: Tensors, layout: HeadLayout, rotations: list[torch.Tensor], check: bool = True) -> Tensors:
    """``W_Q^h -> Rᵀ W_Q^h``, ``W_K^g -> Rᵀ W_K^g`` with one R per KV group.

    With ``check`` (the default) R must commute with RoPE in the checkpoint's pairing layout
    and the model must not have QK-norm; ``check=False`` exists only for negative controls."""
    if len(rotations) != layout.n_kv_heads:
        raise ValueError(f"need one QK rotation per KV group ({layout.n_kv_heads}), got {len(rotations)}")
    if check:
        if layout.qk_norm:
            raise NotASymmetry("QK rotation is not a symmetry under QK-norm (the per-head γ does not commute)")
        for g, R in enumerate(rotations):
            err = rope_commutant_violation(R, layout)
            if err > _TOL:
                raise NotASymmetry(
                    f"QK rotation of KV group {g} does not commute with RoPE "
                    f"({layout.rope_layout}, rotary dim {layout.rotary_dim}): violation {err:.2e}"
                )
    Rs = torch.stack(rotations)
    out = _map(layer, lambda W: _rotate_row_blocks(W, _per_head(Rs, layout)), "q.weight", "q.bias")
    return _map(out, lambda W: _rotate_row_blocks(W, Rs), "k.weight", "k.bias")


def rotate_vo(layer: Tensors, layout: HeadLayout, rotations: list[torch.Tensor], check: bool = True) -> Tensors:
    """``W_V^g -> Rᵀ W_V^g`` and ``W_O^h -> W_O^h R`` for every query head h of group g."""
    if len(rotations) != layout.n_kv_heads:
        raise ValueError(f"need one VO rotation per KV group ({layout.n_kv_heads}), got {len(rotations)}")
    if check:
        for g, R in enumerate(rotations):
            _check_orthogonal(R, f"VO rotation of KV group {g}")
    Rs = torch.stack(rotations)
    out = _map(layer, lambda W: _rotate_row_blocks(W, Rs), "v.weight", "v.bias")
    # columns of W_O are rows of W_Oᵀ: W_O^h R = (Rᵀ W_O^hᵀ)ᵀ
    return _map(out, lambda W: _rotate_row_blocks(W.T, _per_head(Rs, layout)).T, "o.weight")


def scale_qk(layer: Tensors, layout: HeadLayout, scales: torch.Tensor, check: bool = True) -> Tensors:
    """``W_Q^h -> a_g W_Q^h``, ``W_K^g -> W_K^g / a_g`` (biases alike), one a per KV group."""
    if check and layout.qk_norm:
        raise NotASymmetry("QK scaling is not a symmetry under QK-norm")
    if check and (scales == 0).any():
        raise NotASymmetry("QK scales must be non-zero")
    scales = scales.to(torch.float64)
    out = _map(layer, lambda W: _scale_row_blocks(W, _per_head(scales, layout)), "q.weight", "q.bias")
    return _map(out, lambda W: _scale_row_blocks(W, 1.0 / scales), "k.weight", "k.bias")


def scale_vo(layer: Tensors, layout: HeadLayout, scales: torch.Tensor) -> Tensors:
    """``W_V^g -> W_V^g / c_g``, ``W_O^h -> c_g W_O^h``."""
    if (scales == 0).any():
        raise NotASymmetry("VO scales must be non-zero")
    scales = scales.to(torch.float64)
    out = _map(layer, lambda W: _scale_row_blocks(W, 1.0 / scales), "v.weight", "v.bias")
    return _map(out, lambda W: _scale_row_blocks(W.T, _per_head(scales, layout)).T.contiguous(), "o.weight")


def permute_ffn(layer: Tensors, perm: torch.Tensor) -> Tensors:
    """Hidden neuron j of the result is neuron ``perm[j]`` of the input: rows of up (and gate,
    with their biases) and columns of down move together."""
    n = layer["up.weight"].shape[0]
    if sorted(perm.tolist()) != list(range(n)):
        raise NotASymmetry(f"FFN permutation is not a permutation of {n} neurons")
    out = _map(layer, lambda W: W[perm], "up.weight", "up.bias", "gate.weight", "gate.bias")
    return _map(out, lambda W: W[:, perm], "down.weight")


def interleaved_to_half(layer: Tensors, layout: HeadLayout) -> Tensors:
    """Re-pair the rotary dims of every q and k head from interleaved ``(2i, 2i+1)`` (GPT-J) to
    rotate-half ``(i, i + r/2)`` (GPT-NeoX, Llama). The same permutation of q's and k's rows leaves every
    score ``q·k`` unchanged and carries pair ``i`` with its frequency, so interleaved RoPE before equals
    rotate-half RoPE after. Not a symmetry of one architecture: the RoPE layout changes with it."""
    r, dh = layout.rotary_dim, layout.head_dim
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, dh)])

    def per_head(W: torch.Tensor) -> torch.Tensor:
        return W.reshape(W.shape[0] // dh, dh, -1)[:, perm].reshape(W.shape)

    return _map(layer, per_head, "q.weight", "q.bias", "k.weight", "k.bias")


# ---------------------------------------------------------------------- residual stream


def centre_rows(W: torch.Tensor) -> torch.Tensor:
    """Each row minus its mean (embedding rows: every token then writes a zero-mean vector)."""
    return W - W.mean(dim=1, keepdim=True)


def centre_writers(layer: Tensors) -> Tensors:
    """Make every write of the layer to the residual stream zero-mean (docs/math.md §1.4 step 2 of residual
    rotation for LayerNorm models): the output rows of ``o`` and ``down`` and their biases minus
    their mean over the output dim. LayerNorm subtracts the mean anyway, so with the embeddings
    centred too the function is unchanged and every LayerNorm sees a zero-mean stream, on which it
    equals an RMSNorm followed by its γ and β."""
    out = _new_dict(layer)
    for n in _WRITERS:
        W = out[f"{n}.weight"]
        out[f"{n}.weight"] = W - W.mean(dim=0, keepdim=True)
        if f"{n}.bias" in out:
            b = out[f"{n}.bias"]
            out[f"{n}.bias"] = b - b.mean()
    return out


_ATTN_READERS = ("q", "k", "v")
_FFN_READERS = ("gate", "up")
_WRITERS = ("o", "down")


def fold_norm(readers: Tensors, names: tuple[str, ...], weight: torch.Tensor, bias: torch.Tensor | None) -> Tensors:
    """Fold a norm's affine part into the linears reading its output:
    ``W <- W diag(γ)``, ``b <- b + W β``."""
    out = _new_dict(readers)
    for n in names:
        key = f"{n}.weight"
        if key not in out:
            continue
        W = out[key]
        if bias is not None:
            out[f"{n}.bias"] = out.get(f"{n}.bias", torch.zeros(W.shape[0], dtype=W.dtype)) + W @ bias
        out[key] = W * weight[None, :]
    return out


def fold_layer_norms(layer: Tensors) -> Tensors:
    """Fold both pre-norms of a layer into their readers; norm weights become 1 (biases 0).
    Norms without weight (already folded, or never affine) are left as they are."""
    out = _new_dict(layer)
    for norm, readers in (("attn_norm", _ATTN_READERS), ("ffn_norm", _FFN_READERS)):
        if f"{norm}.weight" not in out:
            continue
        w, b = out[f"{norm}.weight"], out.get(f"{norm}.bias")
        out = fold_norm(out, readers, w, b)
        out[f"{norm}.weight"] = torch.ones_like(w)
        if b is not None:
            out[f"{norm}.bias"] = torch.zeros_like(b)
    return out


def fold_final_norm(globals_: Tensors, inplace: bool = False) -> Tensors:
    """Fold the final norm into ``lm_head``. ``inplace`` overwrites the head tensor instead of
    allocating a new vocabulary-sized one (for callers that own it). No-op without a final norm weight."""
    out = dict(globals_)
    if "final_norm.weight" not in out:
        return out
    w, b = out["final_norm.weight"], out.get("final_norm.bias")
    if inplace and b is None:
        out["lm_head.weight"].mul_(w[None, :])
    else:
        out = fold_norm(out, ("lm_head",), w, b)
    out["final_norm.weight"] = torch.ones_like(w)
    if b is not None:
        out["final_norm.bias"] = torch.zeros_like(b)
    return out


def _require_folded(t: Tensors, norms: tuple[str, ...]) -> None:
    for n in norms:
        w = t.get(f"{n}.weight")
        if w is not None and not torch.equal(w, torch.ones_like(w)):
            raise NotASymmetry(f"residual rotation needs {n} folded first (its γ is not 1)")


def rotate_residual_layer(
    layer: Tensors, Q: torch.Tensor, Q_mid: torch.Tensor | None = None, Q_out: torch.Tensor | None = None
) -> Tensors:
    """Readers ``W <- W Q``; writers ``W <- Qᵀ W``, ``b <- Qᵀ b``. Norms must be folded.

    With one basis per residual segment (ProcrustesGPT) the layer touches three segments: q/k/v read
    ``Q``'s, ``o`` writes into ``Q_mid``'s (which gate/up read) and ``down`` writes into ``Q_out``'s;
    both default to ``Q`` (one global rotation, an exact symmetry)."""
    _require_folded(layer, ("attn_norm", "ffn_norm"))
    Q_mid = Q if Q_mid is None else Q_mid
    Q_out = Q if Q_out is None else Q_out
    out = _new_dict(layer)
    for names, R in ((_ATTN_READERS, Q), (_FFN_READERS, Q_mid)):
        for n in names:
            if f"{n}.weight" in out:
                out[f"{n}.weight"] = out[f"{n}.weight"] @ R
    for n, R in zip(_WRITERS, (Q_mid, Q_out)):
        out[f"{n}.weight"] = R.T @ out[f"{n}.weight"]
        if f"{n}.bias" in out:
            out[f"{n}.bias"] = R.T @ out[f"{n}.bias"]
    return out


_RESIDUAL_VECTORS = ("attn_norm.weight", "attn_norm.bias", "ffn_norm.weight", "ffn_norm.bias")
_HEAD_SIDE = ("q_norm.weight", "k_norm.weight")  # per head_dim: untouched by a residual permutation


def _check_permutation(perm: torch.Tensor, n: int) -> None:
    if perm.ndim != 1 or sorted(perm.tolist()) != list(range(n)):
        raise NotASymmetry(f"residual permutation is not a permutation of {n} channels")


def permute_residual_layer(layer: Tensors, perm: torch.Tensor) -> Tensors:
    """Residual channel j of the result is channel ``perm[j]`` of the input. Unlike a rotation this needs
    no norm folding: an RMSNorm (or LayerNorm) commutes with a permutation of its channels once its
    weight and bias are permuted too, so the norms keep their γ. Readers' columns, writers' rows (and
    biases) and the pre-norm vectors move together; any other residual-sized tensor is refused."""
    known = {f"{n}.{p}" for n in _ATTN_READERS + _FFN_READERS + _WRITERS for p in ("weight", "bias")}
    unknown = sorted(set(layer) - known - set(_RESIDUAL_VECTORS) - set(_HEAD_SIDE))
    if unknown:
        raise NotASymmetry(f"residual permutation does not know how to move {unknown}")
    _check_permutation(perm, layer["o.weight"].shape[0])
    out = _map(layer, lambda W: W[:, perm], *(f"{n}.weight" for n in _ATTN_READERS + _FFN_READERS))
    return _map(out, lambda W: W[perm], *(f"{n}.{p}" for n in _WRITERS for p in ("weight", "bias")), *_RESIDUAL_VECTORS)


def permute_residual_globals(globals_: Tensors, perm: torch.Tensor) -> Tensors:
    """Embedding columns (token and position), the final norm's weight and bias and the head's columns:
    a tied head stays tied (it is the same permuted matrix)."""
    out = dict(globals_)
    for key in list(out):
        if key in ("embed.weight", "lm_head.weight") or (key.startswith("pos") and key.endswith(".weight")):
            _check_permutation(perm, out[key].shape[1])
            out[key] = out[key][:, perm]
        elif key.startswith("final_norm."):
            out[key] = out[key][perm]
    return out


def _right_multiply_rows_(
    W: torch.Tensor, Q: torch.Tensor, chunk: int = 4096, col_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``W <- W diag(col_scale) Q`` in place, a block of rows at a time (row-separable), so a
    vocabulary-sized matrix never needs a second full copy. Each block is computed in float64
    and rounded once into W's own dtype."""
    for i in range(0, W.shape[0], chunk):
        block = W[i : i + chunk].to(torch.float64)
        if col_scale is not None:
            block = block * col_scale[None, :]
        W[i : i + chunk] = block @ Q
    return W


def fold_and_rotate_globals_(globals_: Tensors, Q: torch.Tensor) -> Tensors:
    """:func:`fold_final_norm` then :func:`rotate_residual_globals`, in place on tensors of any
    dtype the caller owns: each block of rows is computed in float64 and rounded once, so a
    float32/bfloat16 checkpoint's embeddings are never held in float64 whole."""
    out = dict(globals_)
    if "final_norm.weight" not in out:  # a weightless final norm: nothing to fold
        out["final_norm.weight"] = torch.ones(Q.shape[0], dtype=torch.float64)
        out = fold_and_rotate_globals_(out, Q)
        del out["final_norm.weight"]
        return out
    w = out["final_norm.weight"].to(torch.float64)
    if out.get("final_norm.bias") is not None:
        raise NotASymmetry("folding a final norm with a bias needs the float64 path (fold_final_norm)")
    for key in list(out):
        if key == "embed.weight" or (key.startswith("pos") and key.endswith(".weight")):
            _right_multiply_rows_(out[key], Q)
        elif key == "lm_head.weight":
            _right_multiply_rows_(out[key], Q, col_scale=w)
    out["final_norm.weight"] = torch.ones_like(out["final_norm.weight"])
    return out


def rotate_residual_globals(
    globals_: Tensors, Q: torch.Tensor, Q_head: torch.Tensor | None = None, inplace: bool = False
) -> Tensors:
    """Embeddings (token and position) ``E <- E Q``; lm_head ``W <- W Q_head`` (final norm folded;
    ``Q_head`` defaults to ``Q``, and differs only with one basis per residual segment).
    ``inplace`` overwrites the tensors row block by row block (for callers that own them)."""
    _require_folded(globals_, ("final_norm",))
    Q_head = Q if Q_head is None else Q_head
    out = dict(globals_)
    for key in list(out):
        R = None
        if key == "embed.weight" or (key.startswith("pos") and key.endswith(".weight")):
            R = Q
        elif key == "lm_head.weight":
            R = Q_head
        if R is not None:
            out[key] = _right_multiply_rows_(out[key], R) if inplace else out[key] @ R
    return out
