"""The solver's batched and host-placed linear algebra (issue 28, "the solver on a GPU"): the batched
paths equal the per-problem ones they replace, the objective is fetched once per evaluation with the
same bits as the per-term sum, and the rule that places small factorisations on the host keeps CPU
matrices where they are. Each comparison has a negative control."""

from __future__ import annotations

import pytest
import torch

from hf_symmetry.solvers import linalg
from hf_symmetry.solvers import structures as S
from hf_symmetry.solvers.segments import Term, objective


def _psd(n: int, rank: int | None = None, batch: tuple = (), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(*batch, n, rank or n + 3, generator=g, dtype=torch.float64)
    return X @ X.mT


def _per_block_r(st: S.GS, W: torch.Tensor, gram: S.Gram, L: torch.Tensor) -> torch.Tensor:
    """The R step one block at a time (the CPU's path, as it was before batching)."""
    return st._solve_r_blocks(W, gram, L)


@pytest.mark.parametrize("shape,kl,kr,b", [((24, 16), 4, 2, 2), ((12, 20), 2, 4, 3), ((16, 16), 1, 4, 2)])
@pytest.mark.parametrize("weight", ["dense", "diag"])
def test_batched_gs_r_step_equals_the_per_block_solves(shape, kl, kr, b, weight):
    g = torch.Generator().manual_seed(1)
    st = S.GS(shape, kl, kr, b)
    W = torch.randn(*shape, generator=g, dtype=torch.float64)
    gram = (
        S.Gram(matrix=_psd(shape[0], seed=2))
        if weight == "dense"
        else S.Gram(diag=torch.rand(shape[0], generator=g, dtype=torch.float64) + 0.1)
    )
    L, _ = st.project(W)
    got, ref = st._solve_r_batched(W, gram, L), _per_block_r(st, W, gram, L)
    assert torch.equal(st._solve_r(W, gram, L), ref)  # a CPU matrix takes the per-block path
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-10 * ref.abs().max()
    # negative control: the blocks solved against another block's columns of W differ
    wrong = _per_block_r(st, W.roll(shape[1] // kr, dims=1), gram, L)
    assert (wrong - ref).abs().max() > 1e-3 * ref.abs().max()
    # and the step still descends: the ALS objective after it is no larger than before
    before = S.error(st, W, (L, _), gram)
    assert S.error(st, W, (L, got), gram) <= before * (1 + 1e-12)


def test_batched_psd_solve_equals_each_problem_rank_deficient_ones_included():
    C = torch.cat([_psd(7, batch=(3,), seed=3), _psd(7, rank=3, batch=(2,), seed=4)])
    D = C @ torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # in C's range
    got = S.psd_solve(C, D)
    ref = torch.stack([S.psd_solve(C[i], D[i]) for i in range(len(C))])
    assert (got - ref).abs().max() <= 1e-10 * ref.abs().max()
    assert (C @ got - D).abs().max() <= 1e-9 * D.abs().max()  # solves each system
    assert (got[1:] - ref[:-1]).abs().max() > 1e-3 * ref.abs().max()  # (problems are not interchangeable)


def test_the_objective_is_fetched_once_with_the_per_term_sums_bits():
    g = torch.Generator().manual_seed(6)
    d = 12
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    Sigma = _psd(d, seed=7)
    terms = [
        Term(
            "a",
            torch.randn(20, d, generator=g, dtype=torch.float64),
            S.LowRank((20, d), 3),
            row_gram=S.Gram(matrix=_psd(20, seed=8)),
        ),
        Term(
            "b",
            torch.randn(16, d, generator=g, dtype=torch.float64),
            S.Kron((16, d), 2, (2, 3)),
            col_gram=Sigma,
            weight=0.37,
        ),
        Term("v", torch.randn(8, d, generator=g, dtype=torch.float64), S.Dense((8, d))),
    ]
    for t in terms:
        t.fit(Q, als_iters=2)
    per_term = sum(t.weight * t.error(Q) for t in terms if not t.is_dense)  # the previous definition
    assert objective(terms, Q) == per_term
    assert objective(terms[:1], Q) != per_term  # (each term counts)
    assert objective(terms[2:], Q) == 0


def test_small_factorisations_go_to_the_host_only_from_an_accelerator():
    """``meta`` stands in for an accelerator (no GPU here): a CPU matrix stays put whatever its order;
    an accelerator's small one goes to the CPU, a large one stays, and ``host_max=0`` keeps all."""
    small, large = torch.empty(8, 8, device="meta"), torch.empty(600, 600, device="meta")
    assert linalg.factorisation_device(torch.zeros(8, 8)).type == "cpu"
    assert linalg.factorisation_device(torch.zeros(600, 600)).type == "cpu"
    assert linalg.factorisation_device(small, host_max=256).type == "cpu"
    assert linalg.factorisation_device(large, host_max=256).type == "meta"
    assert linalg.factorisation_device(small, host_max=0).type == "meta"
    assert linalg.factorisation_device(torch.empty(4, 8, 8, device="meta"), host_max=8).type == "cpu"  # batches
