"""Stage W (the weighted segment problem of ProcrustesGPT) run to convergence: the objective never
increases, the solver stops by its rule (relative decrease below ``tol``, or the cap), and on a planted
problem — structured matrices rotated by a known orthogonal Q — it finds the optimum (zero error)."""

from __future__ import annotations

import pytest
import torch

from hf_symmetry.solvers import structures as S
from hf_symmetry.symmetry.groups import haar_orthogonal, rng
from hf_symmetry.solvers.linalg import limit_threads
from hf_symmetry.solvers.segments import Alternation, Term, balance, objective, solve_segment, weighted_procrustes

D = 24


def _cov(seed: int, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * d, d, dtype=torch.float64, generator=g) * torch.linspace(0.2, 2.0, d, dtype=torch.float64)
    return X.T @ X / (4 * d)


def _segment(mats: dict[str, torch.Tensor], structures: dict[str, S.Structure]) -> list[Term]:
    """One writer (``o``, weighted on its rows) and readers sharing the stream covariance (columns), balanced
    as ``compress`` balances them."""
    cov = _cov(7)
    terms, readers = [], []
    for name, M in mats.items():
        t = Term(name, M.clone(), structures[name])
        if name == "o":
            t.row_gram = S.Gram(matrix=_cov(3, M.shape[0]))
        else:
            t.col_gram = cov
            readers.append(t)
        terms.append(t)
    balance(terms, readers)
    return terms


def _structures(rank: int = 2) -> dict[str, S.Structure]:
    return {
        "o": S.Kron((32, D), rank, (1, 4)),
        "gate": S.Kron((40, D), rank, (1, 4)),
        "up": S.Kron((48, D), rank, (1, 4)),
        "v": S.Dense((16, D)),
    }


def _random_mats(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*st.shape, dtype=torch.float64, generator=g) for n, st in _structures().items()}


def _relative_decreases(res) -> list[float]:
    """Per alternation: the relative objective decrease the stopping rule looks at (the value after each
    rotation step against the one before the alternation)."""
    values = [res.trace[0]] + res.trace[1:-1:2]
    return [(a - b) / a for a, b in zip(values, values[1:])]


@pytest.mark.parametrize("dtype,extrapolate", [(torch.float64, False), (torch.float32, False), (torch.float64, True)])
def test_objective_is_non_increasing_and_stops_by_its_rule(dtype, extrapolate):
    eye = torch.eye(D, dtype=torch.float64)
    tol, cap = 1e-3, 200
    res = solve_segment(
        _segment(_random_mats(), _structures()),
        eye,
        Alternation(iters=cap, als_iters=2, wopp_iters=30, dtype=dtype, tol=tol, extrapolate=extrapolate),
    )
    slack = 1e-10 if dtype == torch.float64 else 1e-5
    assert all(b <= a * (1 + slack) for a, b in zip(res.trace, res.trace[1:])), res.trace
    assert res.converged and 2 <= res.alternations < cap
    steps = _relative_decreases(res)
    assert len(steps) == res.alternations
    assert steps[-1] <= tol and all(s > tol for s in steps[:-1]), steps  # it stopped at the first small step
    assert res.trace[-1] < 0.8 * res.trace[0]
    assert (res.Q.T @ res.Q - eye).abs().max() <= 1e-10


def test_zero_tolerance_keeps_the_fixed_count():
    eye = torch.eye(D, dtype=torch.float64)
    res = solve_segment(_segment(_random_mats(), _structures()), eye, Alternation(iters=3, als_iters=2, wopp_iters=10))
    assert res.alternations == 3 and not res.converged and len(res.trace) == 2 * 3 + 1
    loose = solve_segment(
        _segment(_random_mats(), _structures()), eye, Alternation(iters=3, als_iters=2, wopp_iters=10, tol=0.99)
    )
    assert loose.alternations == 1 and loose.converged  # any decrease below 99 % stops it at once


def test_running_to_convergence_beats_one_alternation():
    eye = torch.eye(D, dtype=torch.float64)
    one = solve_segment(_segment(_random_mats(1), _structures()), eye, Alternation(iters=1, als_iters=2, wopp_iters=30))
    conv = solve_segment(
        _segment(_random_mats(1), _structures()), eye, Alternation(iters=100, als_iters=2, wopp_iters=30, tol=1e-4)
    )
    assert conv.trace[-1] < 0.95 * one.trace[-1]


def test_planted_rotation_is_recovered():
    """Every compressed matrix is exactly structured after a known rotation Q* (``M = Ŵ Q*ᵀ``); the dense V
    is arbitrary. The optimum is zero error; from Q = I (where the error is large) stage W reaches it."""
    g = torch.Generator().manual_seed(11)
    structures = _structures()
    Q_star = torch.linalg.matrix_exp(0.03 * (lambda A: A - A.T)(torch.randn(D, D, dtype=torch.float64, generator=g)))
    mats = {}
    for name, st in structures.items():
        if st.kind == "dense":
            mats[name] = torch.randn(*st.shape, dtype=torch.float64, generator=g)
        else:
            A = torch.randn(st.rank, *st.a_shape, dtype=torch.float64, generator=g)
            B = torch.randn(st.rank, *st.b_shape, dtype=torch.float64, generator=g)
            mats[name] = st.dense((A, B)) @ Q_star.T
    terms = _segment(mats, structures)
    eye = torch.eye(D, dtype=torch.float64)
    res = solve_segment(terms, eye, Alternation(iters=100, als_iters=3, wopp_iters=50, tol=1e-9, extrapolate=True))
    energy = sum(t.weight * t.energy() for t in terms if not t.is_dense)
    assert res.trace[0] > 1e-3 * energy  # the start is far from the optimum ...
    assert res.trace[-1] <= 1e-5 * energy, res.trace[-1] / energy  # ... which it reaches
    assert objective(terms, res.Q) == pytest.approx(res.trace[-1], rel=1e-9)
    for t in terms:
        if not t.is_dense:  # M Q is (to 1 %) in the class: the rotation is found, up to the class's
            W = t.M @ res.Q  # own symmetries (e.g. Q* (I ⊗ R) for a 1 x q Kronecker factor)
            assert torch.linalg.matrix_norm(W - t.structure.dense(t.factors)) <= 1e-2 * torch.linalg.matrix_norm(W)
            assert torch.linalg.matrix_norm(
                W - t.structure.dense(t.structure.project(W))
            ) <= 1e-2 * torch.linalg.matrix_norm(W)


def test_single_pair_rotation_step_matches_the_general_solver():
    """The readers of a segment share one covariance: that rotation step runs in the eigenbases of Σ and H
    (O(d²) gradients). It must solve the same problem as the general path (several pairs)."""
    g = torch.Generator().manual_seed(5)
    K = torch.randn(D, D, dtype=torch.float64, generator=g)
    S1, H = _cov(1), _cov(2)
    Q0 = haar_orthogonal(D, rng(3))
    f = lambda Q: float(-2 * (Q * K).sum() + (S1 @ Q @ H * Q).sum())  # noqa: E731
    with limit_threads():
        Q1, _ = weighted_procrustes(K, [(S1, H)], Q0, iters=2000, tol=1e-12)
        Q2, _ = weighted_procrustes(K, [(S1, H / 2), (S1, H / 2)], Q0, iters=2000, tol=1e-12)
    assert (Q1.T @ Q1 - torch.eye(D, dtype=torch.float64)).abs().max() <= 1e-10
    assert f(Q1) < f(Q0)
    assert f(Q1) == pytest.approx(f(Q2), rel=1e-6)
