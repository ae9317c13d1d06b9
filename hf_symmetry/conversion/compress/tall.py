"""Vocabulary-sized matrices with free rows (a low-rank, GS or Kronecker embedding or untied head),
solved on their ``d × d`` Gram accumulated a block of rows at a time and lifted into the output a
block of rows at a time (:class:`TallTerm`), so that neither the matrix nor its row factor is ever in
memory whole."""

from __future__ import annotations

import weakref

import torch

from ...checkpoint_io import RowBlocks
from ...solvers import structures as st
from ...solvers.segments import Term
from .folded import global_row_blocks, global_rows
from .plan import MatrixPlan


class TallTerm:
    """A vocabulary-sized matrix with free rows (a low-rank, GS or Kronecker embedding or untied head) and a row
    weighting or none, solved as :func:`solve_segment` solves it (on its ``[d, d]`` Gram root,
    :meth:`Term.reduced`), but read from the checkpoint a block of rows at a time: its Gram ``Mᵀ G M``
    (and ``MᵀM``) is accumulated block by block, and the row factor ``T f₀ = (M R) f₀`` is lifted
    block by block into the output's dtype, so M is never in memory whole. ``right``: the matrix is
    ``M Aᵀ`` instead (a head's matched target, :func:`.targets._reader_map`), applied to each block.
    ``col_gram``: the head's column weight (stage W), set on the reduced term. :attr:`term` is the
    reduced term the segment's solve sees (handed over by :meth:`take`)."""

    def __init__(
        self,
        m: MatrixPlan,
        globals_,
        weights: torch.Tensor | None,
        device,
        row_dtype,
        right: torch.Tensor | None = None,
        col_gram: torch.Tensor | None = None,
    ):
        self.m, self.globals, self.key, self.device = m, globals_, f"{m.canon}.weight", device
        self.row_dtype = row_dtype or torch.float64
        self.right = right
        n, blocks = self._blocks()
        P = P1 = None
        for i, B in blocks:
            GB = B if weights is None else weights[i : i + len(B)].to(device)[:, None] * B
            P = B.T @ GB if P is None else P.addmm_(B.T, GB)
            if weights is not None:
                P1 = B.T @ B if P1 is None else P1.addmm_(B.T, B)
        self.plain = P if P1 is None else P1  # Mᵀ M (the relative error's metric)
        shell = Term(m.name, torch.empty(n, P.shape[0], dtype=P.dtype, device="meta"), m.structure)
        term, self.R = shell.reduced_from_gram(P)
        term.col_gram = col_gram
        term.tall = self
        # the term owns this object and this one refers back weakly: no reference cycle, so both (and
        # their [d, d] matrices) are freed when the solver drops the term, not at the next garbage collection
        self._term, self._handed = weakref.ref(term), term

    def take(self) -> Term:
        """The reduced term, handed to the caller (who then owns both)."""
        term, self._handed = self._handed, None
        return term

    @property
    def term(self) -> Term:
        """The reduced term the segment's solve sees (it owns this object)."""
        return self._term()

    def _map(self, B: torch.Tensor) -> torch.Tensor:
        B = B.to(self.device)
        return B if self.right is None else B @ self.right.T

    def _blocks(self):
        n, blocks = global_row_blocks(self.globals, self.key)
        return n, ((i, self._map(B)) for i, B in blocks)

    @staticmethod
    def applies(m: MatrixPlan) -> bool:
        """A vocabulary-sized matrix whose row factor is free: low rank, GS with one row block (the
        embeddings' GS blocks), Kronecker with ``A_s`` of one row (the plan's Kronecker shapes)."""
        s = m.structure
        return m.canon in ("embed", "lm_head") and s.rows_free and s.shape[0] > s.shape[1]

    def lift(self, Q: torch.Tensor) -> tuple[st.Factors, float]:
        """The full matrix's factors and its relative error ``‖M Q − Ŵ‖ / ‖M‖`` (from ``MᵀM``:
        ``Ŵ = M R Ŵ'``, Ŵ' the reduced term's approximation). The vocabulary-sized row factor
        ``M (R f₀)`` (low rank; GS: ``[1, vocab, c]``; Kronecker: the ``B_s``, ``[r, vocab, n₂]``) is a
        :class:`...checkpoint_io.RowBlocks` in the
        output's dtype: made a block of rows of M at a time, read again from the checkpoint, when it
        is written (the output's shard writer streams it), so it is never in memory whole (220 MB in
        float32 for a 49152 × 1117 factor)."""
        term = self.term
        s, (row, dim) = term.structure, term.structure.row_factor
        n, _ = self._blocks()
        RF = s.map_rows(self.R, term.factors[row])

        def blocks():
            for _, B in self._blocks()[1]:
                yield s.map_rows(B, RF)

        shape = tuple(RF.shape[:dim]) + (n,) + tuple(RF.shape[dim + 1 :])
        factors = tuple(
            RowBlocks(shape, self.row_dtype, blocks, row_dim=dim) if j == row else f.cpu()
            for j, f in enumerate(term.factors)
        )
        D = Q.to(self.R) - self.R @ term.structure.dense(term.factors)
        err = float(
            torch.sqrt((D * (self.plain @ D)).sum().clamp_min(0)) / torch.sqrt(self.plain.trace()).clamp_min(1e-300)
        )
        return factors, err

    def rows(self, Q: torch.Tensor):
        """``idx -> Ŵ Qᵀ`` at the rows ``idx`` (any shape): the approximation the sequential calibration
        runs on, row by row as the whole ``dense(factors) Qᵀ`` would give it."""
        term = self.term
        W_red = term.structure.dense(term.factors)  # Ŵ = M R Ŵ'

        def take(idx: torch.Tensor) -> torch.Tensor:
            uniq, inverse = torch.unique(idx.reshape(-1), return_inverse=True)
            B = self._map(global_rows(self.globals, self.key, uniq))
            out = ((B @ self.R) @ W_red) @ Q.to(B).T
            return out[inverse].reshape(*idx.shape, out.shape[-1])

        return take
