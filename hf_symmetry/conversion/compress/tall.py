"""Vocabulary-sized matrices with free rows (a low-rank, GS or Kronecker embedding or untied head), solved
on their ``d × d`` Gram and lifted into the output a block of rows at a time, so that neither the matrix
nor its row factor is ever in memory whole."""

from __future__ import annotations

import torch

from ...checkpoint_io import RowBlocks
from ...solvers import structures as st
from ...solvers.segments import Term
from .folded import global_row_blocks, global_rows
from .plan import MatrixPlan


class TallTerm:
    """How a tall matrix's reduced term (:meth:`reduced`) is lifted back: from ``R`` and ``MᵀM`` (``plain``),
    its rows read again from the checkpoint (``right``: the matrix is ``M Aᵀ`` instead, a head's matched
    target), its row factor made in ``row_dtype`` (default float64)."""

    def __init__(self, m: MatrixPlan, globals_, device, row_dtype, right: torch.Tensor | None = None):
        self.globals, self.key, self.device = globals_, f"{m.canon}.weight", device
        self.row_dtype, self.right = row_dtype or torch.float64, right

    @classmethod
    def reduced(cls, m: MatrixPlan, globals_, weights, device, row_dtype, right=None, col_gram=None) -> Term:
        """``m``'s term as :func:`solve_segment` solves it, on its ``[d, d]`` Gram root, the Gram ``Mᵀ G M`` (row
        weights ``weights`` or none; and ``MᵀM``) accumulated block by block; ``col_gram``: the head's column
        weight. Its ``tall`` lifts it back (and does not refer to it: both are freed with the term)."""
        tall = cls(m, globals_, device, row_dtype, right)
        tall.n_rows, blocks = tall._blocks()
        P = P1 = None
        for i, B in blocks:
            GB = B if weights is None else weights[i : i + len(B)].to(device)[:, None] * B
            P = B.T @ GB if P is None else P.addmm_(B.T, GB)
            if weights is not None:
                P1 = B.T @ B if P1 is None else P1.addmm_(B.T, B)
        tall.plain = P if P1 is None else P1  # Mᵀ M (the relative error's metric)
        shell = Term(m.name, torch.empty(tall.n_rows, P.shape[0], dtype=P.dtype, device="meta"), m.structure)
        term, tall.R = shell.reduced_from_gram(P)
        term.col_gram, term.tall = col_gram, tall
        return term

    def _map(self, B: torch.Tensor) -> torch.Tensor:
        B = B.to(self.device)
        return B if self.right is None else B @ self.right.T

    def _blocks(self):
        n, blocks = global_row_blocks(self.globals, self.key)
        return n, ((i, self._map(B)) for i, B in blocks)

    @staticmethod
    def applies(m: MatrixPlan) -> bool:
        """A vocabulary-sized matrix with a free row factor (low rank, GS of one row block, Kronecker, A one row)."""
        s = m.structure
        return m.canon in ("embed", "lm_head") and s.rows_free and s.shape[0] > s.shape[1]

    def lift(self, term: Term, Q: torch.Tensor) -> tuple[st.Factors, float]:
        """The full matrix's factors (the reduced ``term``'s lifted) and its relative error ``‖M Q − Ŵ‖ / ‖M‖``
        (from ``MᵀM``; ``Ŵ = M R Ŵ'``). The vocabulary-sized row factor ``M (R f₀)`` (GS: ``[1, vocab, c]``;
        Kronecker: ``[r, vocab, n₂]``) is a :class:`...checkpoint_io.RowBlocks` in the output's dtype, made
        from the checkpoint's rows when it is written (220 MB in float32 for a 49152 × 1117 factor)."""
        s, (row, dim) = term.structure, term.structure.row_factor
        RF = s.map_rows(self.R, term.factors[row])
        shape = tuple(RF.shape[:dim]) + (self.n_rows,) + tuple(RF.shape[dim + 1 :])
        lifted = RowBlocks(shape, self.row_dtype, lambda: (s.map_rows(B, RF) for _, B in self._blocks()[1]), dim)
        factors = tuple(lifted if j == row else f.cpu() for j, f in enumerate(term.factors))
        D = Q.to(self.R) - self.R @ s.dense(term.factors)
        err = float(
            torch.sqrt((D * (self.plain @ D)).sum().clamp_min(0)) / torch.sqrt(self.plain.trace()).clamp_min(1e-300)
        )
        return factors, err

    def rows(self, term: Term, Q: torch.Tensor):
        """``idx -> Ŵ Qᵀ`` (``term`` lifted) at the rows ``idx`` (any shape): what sequential calibration runs on."""
        W_red = term.structure.dense(term.factors)  # Ŵ = M R Ŵ'

        def take(idx: torch.Tensor) -> torch.Tensor:
            uniq, inverse = torch.unique(idx.reshape(-1), return_inverse=True)
            B = self._map(global_rows(self.globals, self.key, uniq))
            out = ((B @ self.R) @ W_red) @ Q.to(B).T
            return out[inverse].reshape(*idx.shape, out.shape[-1])

        return take
