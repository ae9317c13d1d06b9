"""Group elements: Hadamard constructions, Haar samples, the RoPE commutant."""

import math

import pytest
import torch

from hf_symmetry.symmetry import HeadLayout, groups


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 48, 64, 384, 576, 768, 1024])
def test_hadamard_is_hadamard(n):
    H = groups.hadamard(n)
    assert set(H.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(H @ H.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n", [22, 30, 6])
def test_hadamard_refuses_sizes_without_construction(n):
    with pytest.raises(ValueError, match="no Hadamard"):
        groups.hadamard(n)


def test_random_hadamard_orthogonal_and_seeded():
    Q1 = groups.random_hadamard(576, groups.rng(0, 0)).dense()
    assert torch.allclose(Q1.T @ Q1, torch.eye(576, dtype=torch.float64), atol=1e-12)
    assert torch.equal(Q1, groups.random_hadamard(576, groups.rng(0, 0)).dense())
    assert not torch.equal(Q1, groups.random_hadamard(576, groups.rng(1, 0)).dense())
    assert torch.allclose(Q1.abs(), torch.full_like(Q1, 576**-0.5))  # spreads every direction evenly


@pytest.mark.parametrize("n", [2, 48, 576, 1024])
def test_factored_hadamard_products_equal_dense_products(n):
    """The Kronecker-factored fast path computes exactly the dense W Q and Qᵀ W."""
    Q = groups.random_hadamard(n, groups.rng(5))
    D = Q.dense()
    W, V, b = (
        torch.randn(7, n, dtype=torch.float64),
        torch.randn(n, 3, dtype=torch.float64),
        torch.randn(n, dtype=torch.float64),
    )
    assert torch.allclose(W @ Q, W @ D, atol=1e-12)
    assert torch.allclose(Q.T @ V, D.T @ V, atol=1e-12)
    assert torch.allclose(Q.T @ b, D.T @ b, atol=1e-12)
    if n >= 576:
        assert max(f.shape[0] for f in Q.factors) <= 64  # really factored: the fast path is used


def test_haar_orthogonal_covers_both_components():
    dets = [torch.linalg.det(groups.haar_orthogonal(5, groups.rng(s))).item() for s in range(40)]
    assert all(abs(abs(d) - 1) < 1e-10 for d in dets)
    assert min(dets) < 0 < max(dets)  # reflections too: O(n), not SO(n)


def _rope(x, pos, layout, theta=10000.0):
    """Reference RoPE on the last dim of x (rotary dims only) in either pairing layout."""
    r = layout.rotary_dim
    inv = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = pos * inv
    out = x.clone()
    for p, (i, j) in enumerate(layout.rope_pairs()):
        c, s = math.cos(ang[p]), math.sin(ang[p])
        out[..., i] = c * x[..., i] - s * x[..., j]
        out[..., j] = s * x[..., i] + c * x[..., j]
    return out


LAYOUTS = [
    HeadLayout(1, 1, 8, 8, "rotate_half"),
    HeadLayout(1, 1, 8, 8, "interleaved"),
    HeadLayout(1, 1, 10, 4, "rotate_half"),
    HeadLayout(1, 1, 10, 6, "interleaved"),
    HeadLayout(1, 1, 6, 0, "none"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda L: f"{L.rope_layout}-{L.rotary_dim}of{L.head_dim}")
def test_commutant_preserves_rope_scores(layout):
    gen = groups.rng(3)
    R = groups.random_rope_commutant(layout, gen)
    assert groups.rope_commutant_violation(R, layout) < 1e-12
    q, k = torch.randn(layout.head_dim, dtype=torch.float64), torch.randn(layout.head_dim, dtype=torch.float64)
    for m, n in [(0, 5), (7, 2), (31, 30)]:
        s0 = _rope(q, m, layout) @ _rope(k, n, layout)
        s1 = _rope(R.T @ q, m, layout) @ _rope(R.T @ k, n, layout)
        assert abs(s0 - s1) < 1e-12


def _rope_score_change(R, layout):
    q, k = torch.randn(layout.head_dim, dtype=torch.float64), torch.randn(layout.head_dim, dtype=torch.float64)
    return max(
        abs(_rope(q, m, layout) @ _rope(k, n, layout) - _rope(R.T @ q, m, layout) @ _rope(R.T @ k, n, layout))
        for m, n in [(0, 5), (7, 2), (31, 3)]
    )


def test_non_commutants_are_detected_and_change_scores():
    layout = HeadLayout(1, 1, 8, 8, "rotate_half")
    generic = groups.haar_orthogonal(8, groups.rng(1))
    wrong_layout = groups.random_rope_commutant(HeadLayout(1, 1, 8, 8, "interleaved"), groups.rng(2))
    reflection = torch.eye(8, dtype=torch.float64)
    reflection[0, 0] = -1.0  # flips one member of pair (0, 4): R_Δ becomes R_-Δ
    for R in (generic, wrong_layout, reflection):
        assert groups.rope_commutant_violation(R, layout) > 0.1
        assert _rope_score_change(R, layout) > 1e-3
    # partial rotary: mixing a rotary dim into the free dims is not allowed
    partial = HeadLayout(1, 1, 10, 4, "rotate_half")
    mix = torch.eye(10, dtype=torch.float64)
    mix[[0, 9]] = mix[[9, 0]]
    assert groups.rope_commutant_violation(mix, partial) > 0.1
    assert _rope_score_change(mix, partial) > 1e-3
