"""Rotations and scalings aimed at low-bit weight quantization (``rotate --for-quantization``).

Every transform here is an exact symmetry of the float model (docs/math.md §1), chosen so that the
weights quantize with less loss, and the output stays the stock architecture:

* **Residual rotation** ``Q`` (randomised Hadamard, or learned against the quantizer's grid by
  :func:`learn_residual_rotation`), after folding each RMSNorm's γ into its readers.
* **Norm weights as free input scales.** Residual rotation needs ``RMSNorm(x Q) = RMSNorm(x) Q``,
  which holds for a *weightless* norm. But a norm weight ``w`` in the rotated basis is just a
  per-channel scale of what the readers see, so ``norm.weight = w`` with readers ``W diag(γ) Q
  diag(1/w)`` is exact for any non-zero ``w``. This is the fold the rotation requires, undone in
  the new basis: ``w`` balances the readers' input columns (SmoothQuant/AWQ's per-channel scale,
  for free, inside the stock RMSNorm). The final norm is folded into the float head (w = 1).
* **Per-head V/O:** a randomised Hadamard per KV group (``W_V -> Rᵀ W_V``, ``W_O -> W_O R``), then a
  per-channel scale between V's rows and O's columns (any invertible map per head is exact).
* **FFN:** a per-channel scale between up's rows and down's columns. ``silu(gate)·up`` is linear
  in ``up``, so ``up -> diag(s) up``, ``down -> down diag(1/s)`` is exact; gate rows cannot be
  scaled (SiLU is not homogeneous).

What is *not* used, and why: a Q↔K scale per RoPE pair is exact but scales whole rows of W_Q and
W_K, and a row-grouped weight quantizer (GGUF blocks, HQQ groups along the input dim) is
equivariant to row scales, so it cannot change the quantization error. The same holds for the
row side of every pair above: only the *column* side (norm → readers, V → O, up → down) matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...symmetry import actions, groups
from ...symmetry.layout import HeadLayout
from ...symmetry.procrustes import orthogonal_procrustes
from .channel_scales import normalised, scale_ffn_channels, scale_vo_channels
from .scales import apply_scales, to_layer_basis

Tensors = dict[str, torch.Tensor]

_ATTN_READERS = ("q", "k", "v")
_FFN_READERS = ("gate", "up")
_VO_STREAM = 7  # random-stream id of the per-head Hadamard signs (rotate.py uses 0-5)


@dataclass(frozen=True)
class QuantBalance:
    """Which exact scalings to balance, and how strongly (``alpha`` = exponent of the column
    max-abs ratio: 1 equalises the columns, 0.5 meets halfway, 0 does nothing)."""

    norms: bool = True
    vo: bool = True
    ffn: bool = True
    alpha: float = 1.0


def _col_maxabs(*Ws: torch.Tensor) -> torch.Tensor:
    return torch.stack([W.abs().amax(dim=0) for W in Ws]).amax(dim=0)


def balance_norms(layer: Tensors, alpha: float = 1.0) -> Tensors:
    """For each pre-norm (whose γ must already be folded: weight 1), move a per-channel scale
    ``w`` into the norm weight and ``1/w`` into its readers' columns: ``w_j`` is the readers'
    max |column j| (to the power ``alpha``), so every reader column ends with the same max-abs."""
    out = dict(layer)
    for norm, readers in (("attn_norm", _ATTN_READERS), ("ffn_norm", _FFN_READERS)):
        key = f"{norm}.weight"
        if key not in out:
            continue
        if not torch.equal(out[key], torch.ones_like(out[key])):
            raise actions.NotASymmetry(f"balance_norms needs {norm} folded first")
        names = [n for n in readers if f"{n}.weight" in out]
        w = normalised(_col_maxabs(*(out[f"{n}.weight"] for n in names)), alpha)
        for n in names:
            out[f"{n}.weight"] = out[f"{n}.weight"] / w[None, :]
        out[key] = w.to(out[key].dtype)
    return out


def balance_ffn(layer: Tensors, alpha: float = 1.0) -> Tensors:
    """Equalise down's column max-abs (to the power ``alpha``) through the up ↔ down scale. Needs a
    gated FFN (with a plain ``act(up)`` only positive scales of a ReLU would be exact)."""
    if "gate.weight" not in layer:
        return layer
    return scale_ffn_channels(layer, normalised(layer["down.weight"].abs().amax(dim=0), alpha))


def balance_vo(layer: Tensors, layout: HeadLayout, alpha: float = 1.0) -> Tensors:
    """Equalise O's column max-abs (per channel of each KV group, over the group's heads)."""
    c = layer["o.weight"].abs().amax(dim=0).reshape(layout.n_kv_heads, layout.group_size, layout.head_dim)
    return scale_vo_channels(layer, layout, 1.0 / normalised(c.amax(dim=1).reshape(-1), alpha))


def hadamard_except(n: int, held: tuple[int, ...], gen) -> torch.Tensor:
    """Dense orthogonal ``Q``: identity on the ``held`` residual channels, a randomised Hadamard on the
    others. Holding out the channels of the massive activations keeps them coordinate-aligned, where a
    quantizer's zero level can represent the near-zero weights that read them."""
    rest = [j for j in range(n) if j not in set(held)]
    Q = torch.zeros(n, n, dtype=torch.float64)
    Q[list(held), list(held)] = 1.0
    H = groups.random_hadamard(len(rest), gen).dense()
    idx = torch.tensor(rest)
    Q[idx.unsqueeze(1), idx.unsqueeze(0)] = H
    return Q


@torch.no_grad()
def massive_channels(model, ids: torch.Tensor, k: int = 4) -> tuple[int, ...]:
    """The ``k`` residual channels with the largest max |hidden state| (summed over layers) on ``ids``:
    the massive activations (SmolLM2: four channels hold 99 % of the first token's energy)."""
    hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    score = sum(h[0].abs().amax(dim=0) for h in hs[1:])
    return tuple(sorted(score.topk(k).indices.tolist()))


def head_hadamards(layout: HeadLayout, seed: int, layer: int) -> list[torch.Tensor]:
    """One randomised Hadamard ``diag(±1) H / √d_h`` per KV group (dense, head_dim × head_dim)."""
    gen = groups.rng(seed, _VO_STREAM, layer)
    return [groups.random_hadamard(layout.head_dim, gen).dense() for _ in range(layout.n_kv_heads)]


@dataclass(frozen=True)
class LayerSteps:
    """The per-checkpoint settings of :func:`transform_layer`: the seed of the V/O Hadamards (``vo_hadamard``:
    whether to apply them), the data-free balancing, and ``pow2`` (the searched scales rounded to powers of two,
    :func:`.scales.search_scales`)."""

    seed: int = 0
    vo_hadamard: bool = True
    balance: QuantBalance = QuantBalance()
    pow2: bool = False


@dataclass(frozen=True)
class ScaleSearch:
    """What the activation-aware search of one layer measures against: the calibration second moments
    ``stats`` (keys of :data:`.scales.SITES`) and ``quantize`` (one quantizer, or one per site)."""

    stats: Tensors
    quantize: Callable[[torch.Tensor], torch.Tensor] | dict | None = None


def transform_layer(
    i: int,
    layer: Tensors,
    layout: HeadLayout,
    Q,
    steps: LayerSteps = LayerSteps(),
    search: ScaleSearch | None = None,
    scale_log: dict | None = None,
) -> Tensors:
    """Layer ``i`` of a ``--for-quantization`` checkpoint: fold the norms, rotate the residual by
    ``Q`` (None: no residual rotation, norms stay unfolded), Hadamard the V/O heads, then set the
    exact column scales: searched against ``search.quantize`` (one quantizer, or one per site) on the calibration
    second moments ``search.stats`` (:mod:`.scales`, AWQ's criterion) when given, else the data-free max-abs
    balancing. ``scale_log`` gets what was done: the search's report per site (:func:`.scales.apply_scales`)
    and ``basis_diag`` (the diagonal of each site's second moment in the layer's basis before the scales), or
    ``balanced`` (the max-abs balancings applied)."""
    layer = dict(layer)
    log = scale_log if scale_log is not None else {}
    gammas = (layer["attn_norm.weight"], layer["ffn_norm.weight"])
    if Q is not None:
        layer = actions.rotate_residual_layer(actions.fold_layer_norms(layer), Q)
    vo = head_hadamards(layout, steps.seed, i) if steps.vo_hadamard else None
    if vo is not None:
        layer = actions.rotate_vo(layer, layout, vo)
    if search is not None:
        H = to_layer_basis(search.stats, gammas, Q, vo, layout)
        log["basis_diag"] = {site: H[site].diagonal().to(torch.float64).clone() for site in H}
        return apply_scales(layer, layout, H, search.quantize, log=log, pow2=steps.pow2)
    balance = steps.balance
    balanced_sites = []
    if balance.vo:
        layer = balance_vo(layer, layout, balance.alpha)
        balanced_sites.append("o")
    if balance.ffn and "gate.weight" in layer:
        layer = balance_ffn(layer, balance.alpha)
        balanced_sites.append("down")
    if Q is not None and balance.norms:  # last: V's and up's rows (reader rows) were rescaled above
        layer = balance_norms(layer, balance.alpha)
        balanced_sites += ["attn_norm", "ffn_norm"]
    log["balanced"] = balanced_sites
    return layer


# ---------------------------------------------------------------------------- learned rotations


Quantizer = Callable[[torch.Tensor], torch.Tensor]


def balanced(quantize: Quantizer, alpha: float = 1.0) -> Quantizer:
    """The quantizer a balanced checkpoint applies: ``A -> q(A diag(1/t)) diag(t)``, ``t`` = the
    column max-abs of ``A`` to the power ``alpha`` (the exact column scale moved into the norm, V or
    up). With an isotropic input, ``||A - result||`` is the output error that quantization causes."""

    def q(A: torch.Tensor) -> torch.Tensor:
        t = normalised(A.abs().amax(dim=0), alpha).to(A.dtype)
        return quantize(A / t[None, :]) * t[None, :]

    return q


def learn_rotation(
    readers: list[torch.Tensor],
    writers: list[torch.Tensor],
    quantize: Quantizer,
    starts: list[torch.Tensor],
    iterations: int = 20,
    tol: float = 1e-9,
    log: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Orthogonal ``Q`` minimising the quantization error of the readers ``W_r Q`` and writers
    ``Qᵀ W_w`` (SpinQuant's goal, here without gradients), by alternating minimisation from each start:

    1. quantize: targets ``T_r = q(W_r Q)``, ``T_w = q(Qᵀ W_w)``, and the error ``Σ ||W_r Q - T_r||² +
       Σ ||Qᵀ W_w - T_w||²`` of the current ``Q``;
    2. solve ``min_Q Σ ||W_r Q - T_r||² + Σ ||W_wᵀ Q - T_wᵀ||²`` for the fixed targets exactly: orthogonal
       Procrustes on ``M = Σ W_rᵀ T_r + Σ W_w T_wᵀ`` (:func:`procrustes.orthogonal_procrustes`), the stage F
       step of ProcrustesGPT with the quantizer's grid in the structure class's place.

    With a quantizer that is the nearest point of a fixed grid both steps are exact minimisations,
    so the error never increases; group-scaled grids move with ``Q``, so the best iterate over all
    starts is returned, with the error of every iterate (``history``).
    """
    best, best_err, history = None, float("inf"), []
    for start in starts:
        Q = start.to(torch.float64)
        prev = float("inf")
        for it in range(iterations + 1):
            M = torch.zeros(Q.shape, dtype=torch.float64)
            err = 0.0
            for W in readers:
                A = W @ Q.to(W.dtype)
                T = quantize(A)
                err += (A - T).double().pow(2).sum().item()
                M += (W.T @ T).double()
            for W in writers:
                A = Q.T.to(W.dtype) @ W
                T = quantize(A)
                err += (A - T).double().pow(2).sum().item()
                M += (W @ T.T).double()
            history.append(err)
            if log:
                log(f"  iteration {it}: quantization error {err:.6g}")
            if err < best_err:
                best, best_err = Q, err
            if it == iterations or prev - err <= tol * max(prev, 1e-30) and it > 0:
                break
            prev = err
            Q = orthogonal_procrustes(M)
    return best, history


def rotation_error(
    readers: list[torch.Tensor], writers: list[torch.Tensor], Q: torch.Tensor, quantize: Quantizer
) -> float:
    """``Σ ||W_r Q - q(W_r Q)||² + Σ ||Qᵀ W_w - q(Qᵀ W_w)||²``."""
    return learn_rotation(readers, writers, quantize, [Q], iterations=0)[1][0]


def layer_matrices(
    layer: Tensors, layout: HeadLayout, seed: int, i: int, vo_hadamard: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The residual stream's readers (``[q; k; v]`` and ``[gate; up]``, norms folded, each group
    sharing one norm) and writers (``o``, ``down``) of a canonical layer, as the
    ``--for-quantization`` checkpoint will hold them up to the residual rotation, in float32."""
    layer = actions.fold_layer_norms(dict(layer))
    if vo_hadamard:
        layer = actions.rotate_vo(layer, layout, head_hadamards(layout, seed, i))

    def f32(*names):
        return torch.cat([layer[f"{n}.weight"] for n in names if f"{n}.weight" in layer]).float()

    return [f32("q", "k", "v"), f32("gate", "up")], [f32("o"), f32("down")]
