"""ProcrustesGPT's building blocks (docs/math.md §3): Frobenius-optimal projections of the structured classes,
exact weighted ALS, factorised forward passes, the segment solver (stages F and W), the weighted
Procrustes step and the Cayley storage of skip rotations."""

from __future__ import annotations

import pytest
import torch

from hf_symmetry.modeling.structured_linear import OrthogonalSkip, cayley_decode, structured_linear
from hf_symmetry.solvers import structures as S
from hf_symmetry.symmetry.groups import haar_orthogonal, rng
from hf_symmetry.solvers.segments import Alternation, Term, cayley_encode, objective, solve_segment, weighted_procrustes
from hf_symmetry.solvers.linalg import weighted_error

M, N = 24, 36
STRUCTURES = {
    "kron_row": S.Kron((M, N), 2, (1, 4)),  # reader layout: A is 1 x q
    "kron_col": S.Kron((M, N), 2, (6, 1)),  # writer layout: A is q x 1
    "kron_general": S.Kron((M, N), 3, (4, 3)),
    "gs": S.GS((M, N), 3, 4, 2),
    "gs_embedding": S.GS((M, N), 1, 4, 3),
    "lowrank": S.LowRank((M, N), 5),
}


def _W(seed=0, m=M, n=N):
    return torch.randn(m, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _gram(seed=1, m=M, kind="dense"):
    g = torch.Generator().manual_seed(seed)
    if kind == "diag":
        return S.Gram(diag=torch.rand(m, dtype=torch.float64, generator=g) * 5 + 0.1)
    X = torch.randn(3 * m, m, dtype=torch.float64, generator=g) * torch.linspace(0.1, 3, m, dtype=torch.float64)
    return S.Gram(matrix=X.T @ X)


# ----------------------------------------------------------------------------- projections
@pytest.mark.parametrize("name", ["kron_row", "kron_col", "kron_general"])
def test_kronecker_error_is_the_tail_of_the_rearranged_singular_values(name):
    st, W = STRUCTURES[name], _W()
    f = st.project(W)
    sv = torch.linalg.svdvals(st.rearrange(W))
    assert S.error(st, W, f) == pytest.approx(float((sv[st.rank :] ** 2).sum()), rel=1e-10)
    # the rearrangement really turns Σ A⊗B into Σ vec(A) vec(B)ᵀ (rank r): a rank-r+1 tail is nonzero
    assert float((sv[st.rank :] ** 2).sum()) > 1.0


@pytest.mark.parametrize("name", ["gs", "gs_embedding"])
def test_gs_error_is_the_sum_of_the_tile_tails(name):
    st, W = STRUCTURES[name], _W()
    sv = torch.linalg.svdvals(st.tiles(W))  # [kl, kr, min tile]
    assert S.error(st, W, st.project(W)) == pytest.approx(float((sv[..., st.rank :] ** 2).sum()), rel=1e-10)


def test_lowrank_error_is_eckart_young():
    st, W = STRUCTURES["lowrank"], _W()
    sv = torch.linalg.svdvals(W)
    assert S.error(st, W, st.project(W)) == pytest.approx(float((sv[st.rank :] ** 2).sum()), rel=1e-10)


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_random_perturbations_never_beat_the_projection(name):
    st, W = STRUCTURES[name], _W()
    f = st.project(W)
    best = S.error(st, W, f)
    g = torch.Generator().manual_seed(5)
    for scale in (1e-4, 1e-2, 1e-1):
        for _ in range(20):
            other = tuple(t + scale * t.abs().mean() * torch.randn(t.shape, dtype=t.dtype, generator=g) for t in f)
            assert S.error(st, W, other) >= best * (1 - 1e-12)


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_factorised_forward_equals_the_dense_reconstruction(name):
    st, W = STRUCTURES[name], _W()
    f = st.project(W)
    module = structured_linear(N, M, {**st.entry(), "bias": True}).double()
    with torch.no_grad():
        for k, v in st.module_tensors(f).items():
            getattr(module, k).copy_(v)
        module.bias.copy_(torch.arange(M, dtype=torch.float64))
    dense = st.dense(f)
    x = torch.randn(3, 5, N, dtype=torch.float64)
    assert (module(x) - (x @ dense.T + module.bias)).abs().max() < 1e-12
    assert (module.dense_weight() - dense).abs().max() < 1e-13
    ids = torch.tensor([[0, 7, M - 1], [3, 3, 11]])
    assert (module.rows(ids) - dense[ids]).abs().max() < 1e-13  # embedding lookups
    # parameter counts come from the factor shapes, and match the class's formula
    assert sum(p.numel() for n, p in module.named_parameters() if n != "bias") == st.params() < M * N
    # negative control: the module really uses its factors
    with torch.no_grad():
        next(p for n, p in module.named_parameters() if n != "bias").mul_(1.5)
    assert (module(x) - (x @ dense.T + module.bias)).abs().max() > 1e-3


def test_factor_shapes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="does not divide"):
        S.Kron((M, N), 2, (5, 1))
    with pytest.raises(ValueError, match="does not divide"):
        S.GS((M, N), 5, 4, 1)
    with pytest.raises(ValueError, match="does not divide"):
        structured_linear(N, M, {"type": "kron", "rank": 1, "a_shape": [1, 5]})


# ----------------------------------------------------------------------------- weighted ALS
@pytest.mark.parametrize("kind", ["dense", "diag"])
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_weighted_als_is_monotone_and_beats_the_frobenius_projection(name, kind):
    st, W, gram = STRUCTURES[name], _W(), _gram(kind=kind)
    f = st.project(W)
    errors = [S.error(st, W, f, gram)]
    for _ in range(6):
        f = st.weighted(W, gram, init=f, iters=1)
        errors.append(S.error(st, W, f, gram))
    assert all(b <= a * (1 + 1e-10) for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0] * 0.999  # the weight matters, and ALS uses it


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_weighted_with_identity_equals_frobenius(name):
    st, W = STRUCTURES[name], _W()
    f = st.project(W)
    w = st.weighted(W, S.Gram.identity(M), init=f, iters=4)
    assert (st.dense(w) - st.dense(f)).abs().max() < 1e-10
    w2 = st.weighted(W, S.Gram(matrix=torch.eye(M, dtype=torch.float64)), init=f, iters=4)
    assert (st.dense(w2) - st.dense(f)).abs().max() < 1e-10


def test_column_weights_go_through_the_transpose():
    st, W, gram = STRUCTURES["kron_row"], _W(), _gram(m=N)
    f = st.transpose_factors(st.transpose().weighted(W.T, gram, iters=5))
    D = W - st.dense(f)
    weighted = float((D * (D @ gram.matrix)).sum())
    D0 = W - st.dense(st.project(W))
    assert weighted < float((D0 * (D0 @ gram.matrix)).sum())


# ----------------------------------------------------------------------------- segment solver
def _segment(stage: str, struct="kron", d=24, seed=0):
    """A toy segment: two writers ([in, d]) and two readers ([out, d])."""
    g = torch.Generator().manual_seed(seed)
    make = {
        "kron": lambda k: S.Kron((k, d), 2, (1, 4)),
        "gs": lambda k: S.GS((k, d), 2, 4, 2),
        "lowrank": lambda k: S.LowRank((k, d), 6),
    }[struct]
    # a shared low-dimensional structure that a rotation can expose
    basis = torch.randn(d, d, dtype=torch.float64, generator=g)
    terms, readers = [], []
    for name, k, role in (("w1", 16, "writer"), ("w2", 32, "writer"), ("r1", 20, "reader"), ("r2", 12, "reader")):
        Mk = torch.randn(k, d, dtype=torch.float64, generator=g) @ basis
        t = Term(name, Mk, make(k))
        if stage == "w":
            if role == "writer":
                t.row_gram = _gram(seed=len(terms) + 3, m=k)
            else:
                X = torch.randn(4 * d, d, dtype=torch.float64, generator=g) * torch.linspace(
                    0.2, 2, d, dtype=torch.float64
                )
                t.col_gram = X.T @ X
        terms.append(t)
        if role == "reader":
            readers.append(t)
    if stage == "w":
        for t in readers[1:]:
            t.col_gram = readers[0].col_gram  # one segment: its readers share the stream covariance
    return terms


@pytest.mark.parametrize("struct", ["kron", "gs"])
def test_stage_f_is_monotone_keeps_q_orthogonal_and_helps(struct):
    terms = _segment("f", struct)
    eye = torch.eye(24, dtype=torch.float64)
    res = solve_segment(terms, eye, Alternation(iters=8))
    assert all(b <= a * (1 + 1e-10) for a, b in zip(res.trace, res.trace[1:])), res.trace
    assert (res.Q.T @ res.Q - eye).abs().max() <= 1e-5
    assert res.trace[-1] < 0.9 * res.trace[0]  # the rotation makes the weights more compressible


@pytest.mark.parametrize("stage", ["f", "w"])
def test_rotations_cannot_help_low_rank(stage):
    """rank(M Q) = rank(M), in every weighting used here: why ``compress`` keeps Q = I for low rank."""
    terms = _segment(stage, "lowrank")
    res = solve_segment(terms, haar_orthogonal(24, rng(2)), Alternation(iters=3, als_iters=1, wopp_iters=30))
    assert res.trace[-1] == pytest.approx(res.trace[0], rel=1e-8)


@pytest.mark.parametrize("struct", ["kron", "gs"])
def test_stage_w_is_monotone_keeps_q_orthogonal(struct):
    terms = _segment("w", struct)
    eye = torch.eye(24, dtype=torch.float64)
    res = solve_segment(terms, eye, Alternation(iters=3, als_iters=3, wopp_iters=60))
    assert all(b <= a * (1 + 1e-10) for a, b in zip(res.trace, res.trace[1:])), res.trace
    assert (res.Q.T @ res.Q - eye).abs().max() <= 1e-5
    assert res.trace[-1] < res.trace[0]


@pytest.mark.parametrize("stage", ["f", "w"])
@pytest.mark.parametrize("struct", ["kron", "gs"])
def test_float32_iterations_match_float64(stage, struct):
    """``compress`` iterates in float32 (``CompressOptions.solver_dtype``): the objective is non-increasing
    up to float32 round-off, the returned Q is float64 and orthogonal to float64 round-off, and the result
    is the float64 solver's (to 0.5 %: the problem is not convex, round-off can move the path a little)."""
    eye = torch.eye(24, dtype=torch.float64)
    kwargs = dict(iters=4, als_iters=3, wopp_iters=60)
    fast = solve_segment(_segment(stage, struct), eye, Alternation(dtype=torch.float32, **kwargs))
    exact = solve_segment(_segment(stage, struct), eye, Alternation(**kwargs))
    assert all(b <= a * (1 + 1e-5) for a, b in zip(fast.trace, fast.trace[1:])), fast.trace
    assert fast.Q.dtype == torch.float64 and (fast.Q.T @ fast.Q - eye).abs().max() <= 1e-12
    assert fast.trace[-1] < 0.99 * fast.trace[0]
    assert fast.trace[-1] == pytest.approx(exact.trace[-1], rel=5e-3)
    terms = _segment(stage, struct)
    solve_segment(terms, eye, Alternation(dtype=torch.float32, **kwargs))
    assert all(f.dtype == torch.float64 for t in terms for f in t.factors)
    Q0 = haar_orthogonal(24, rng(5))  # no iterations: Q0 itself, not its float32 rounding
    assert torch.equal(solve_segment(_segment(stage, struct), Q0, Alternation(iters=0, dtype=torch.float32)).Q, Q0)


@pytest.mark.parametrize("stage", ["f", "w"])
@pytest.mark.parametrize("struct", ["kron", "gs_rows_free"])
def test_gram_reduction_of_tall_terms_is_exact(stage, struct):
    """Row-free structures on tall matrices are solved on ``(MᵀGM)^{1/2}``: the lifted factors have exactly
    the reduced objective; with Frobenius projections (stage F) the whole trajectory is the same. (With
    weights the ALS iterates differ: their Frobenius starting points are not equivalent.)"""
    d = 16
    g = torch.Generator().manual_seed(4)
    make = {"kron": lambda k: S.Kron((k, d), 2, (1, 4)), "gs_rows_free": lambda k: S.GS((k, d), 1, 4, 2)}[struct]

    def terms():
        g.manual_seed(4)
        out = []
        for i, k in enumerate((40, 64)):
            t = Term(f"t{i}", torch.randn(k, d, dtype=torch.float64, generator=g), make(k))
            if stage == "w":
                if i == 0:
                    t.row_gram = S.Gram(diag=torch.rand(k, dtype=torch.float64, generator=g) + 0.5)
                else:
                    X = torch.randn(50, d, dtype=torch.float64, generator=g)
                    t.col_gram = X.T @ X
            out.append(t)
        return out

    full, red = terms(), terms()
    assert all(t.reducible() for t in red)
    eye = torch.eye(d, dtype=torch.float64)
    a = solve_segment(full, eye, Alternation(iters=3, als_iters=2, wopp_iters=20, reduce=False))
    b = solve_segment(red, eye, Alternation(iters=3, als_iters=2, wopp_iters=20, reduce=True))
    assert objective(red, b.Q) == pytest.approx(b.trace[-1], rel=1e-9)  # lifted = reduced objective
    for tf, tr in zip(full, red):
        assert tr.factors[0].shape == tf.factors[0].shape and tr.factors[1].shape == tf.factors[1].shape
        D = tr.M @ b.Q - tr.structure.dense(tr.factors)
        direct = (
            weighted_error(D, tr.row_gram)
            if tr.col_gram is None
            else float(((D @ b.Q.T) @ tr.col_gram * (D @ b.Q.T)).sum())
        )
        assert tr.error(b.Q) == pytest.approx(direct, rel=1e-8)
    if stage == "f":
        assert b.trace == pytest.approx(a.trace, rel=1e-8)
        assert (a.Q - b.Q).abs().max() < 1e-6
        for tf, tr in zip(full, red):
            assert (tf.structure.dense(tf.factors) - tr.structure.dense(tr.factors)).abs().max() < 1e-6
    else:  # different ALS starting points, so different (non-convex) paths: the same optimum to 0.1 %
        assert b.trace[-1] <= a.trace[-1] * (1 + 1e-3)


def test_weighted_procrustes_descends_and_reduces_to_procrustes():
    g = rng(0, 1)
    d = 16
    K = torch.randn(d, d, dtype=torch.float64)
    A = torch.randn(d, d, dtype=torch.float64)
    pairs = [(A @ A.T, torch.diag(torch.linspace(0.1, 3, d, dtype=torch.float64)))]
    Q0 = haar_orthogonal(d, g)
    Q, values = weighted_procrustes(K, pairs, Q0, iters=1000)
    assert all(b <= a for a, b in zip(values, values[1:])) and values[-1] < values[0]
    assert (Q.T @ Q - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-12
    # a stationary point: the Riemannian gradient vanishes
    G = 2 * (pairs[0][0] @ Q @ pairs[0][1] - K)
    A_ = Q.T @ G
    assert (A_ - A_.T).abs().max() < 1e-5 * G.abs().max()
    # no quadratic part: the closed-form Procrustes optimum, better than any other orthogonal Q
    Qp, _ = weighted_procrustes(K, [], Q0)
    for _ in range(10):
        assert float((Qp * K).sum()) >= float((haar_orthogonal(d, g) * K).sum())


def test_stage_w_objective_uses_the_rotated_covariance():
    """J(Q) = Σ λ‖(MQ − Ŵ)Qᵀ Σ^{1/2}‖²: evaluating a term at Q equals rotating the data by hand."""
    t = _segment("w")[2]
    Q = haar_orthogonal(24, rng(3))
    t.fit(Q, als_iters=2)
    What = t.structure.dense(t.factors)
    direct = t.M @ t.col_gram @ t.M.T - 2 * (t.M @ t.col_gram @ Q @ What.T) + What @ Q.T @ t.col_gram @ Q @ What.T
    assert t.error(Q) == pytest.approx(float(direct.trace()), rel=1e-10)
    assert objective([t], Q) == pytest.approx(t.weight * t.error(Q))


# ----------------------------------------------------------------------------- skip storage
@pytest.mark.parametrize("case", ["random", "det_minus_one", "minus_identity", "reflections"])
def test_cayley_storage_round_trips(case):
    d = 40
    if case == "minus_identity":
        Q = -torch.eye(d, dtype=torch.float64)
    elif case == "reflections":
        Q = torch.diag(torch.tensor([(-1.0) ** (i % 3 == 0) for i in range(d)], dtype=torch.float64))
    else:
        Q = haar_orthogonal(d, rng(7))
        if (torch.linalg.det(Q) > 0) == (case == "det_minus_one"):
            Q[:, 0] *= -1
    k, signs = cayley_encode(Q)
    assert k.numel() == d * (d - 1) // 2 and signs.numel() == d
    assert (cayley_decode(k, signs) - Q).abs().max() < 1e-12
    assert (cayley_decode(k.float(), signs.float()).double() - Q).abs().max() < 1e-5  # float32 storage


def test_orthogonal_skip_is_computed_once_and_refreshed_when_its_parameters_change(monkeypatch):
    from hf_symmetry.modeling import structured_linear as mcl

    d = 12
    Q = haar_orthogonal(d, rng(1))
    skip = OrthogonalSkip(d).double().eval()
    k, signs = cayley_encode(Q)
    with torch.no_grad():
        skip.skip_k.copy_(k)
        skip.skip_signs.copy_(signs)
    calls = []
    real = mcl.cayley_decode
    monkeypatch.setattr(mcl, "cayley_decode", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, d, dtype=torch.float64)
    for _ in range(5):
        assert (skip(x) - x @ Q).abs().max() < 1e-12
    assert len(calls) == 1
    with torch.no_grad():
        skip.skip_k.zero_()  # now S = diag(signs)
    assert (skip(x) - x * signs).abs().max() < 1e-12
    assert len(calls) == 2
