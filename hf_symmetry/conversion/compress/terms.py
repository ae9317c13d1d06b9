"""The solvers' terms: each compressed matrix of the plan as a :class:`...solvers.segments.Term` (a tall
embedding or head as the reduced term of a :class:`.tall.TallTerm`), weighted for its stage by the calibration
statistics: token counts on the embedding's rows, a reader's column weight, a writer's row weight, and under
sequential calibration the matched targets (:mod:`.targets`)."""

from __future__ import annotations

import torch

from ...solvers import structures as st
from ...solvers.segments import Term, balance
from . import targets
from .plan import MatrixPlan
from .tall import TallTerm

Tensors = dict[str, torch.Tensor]


def _matrix_of(m: MatrixPlan, layers: list[Tensors], globals_: Tensors) -> torch.Tensor:
    if m.canon == "embed":
        return globals_["embed.weight"]
    if m.canon == "lm_head":
        return globals_["lm_head.weight"]
    W = layers[m.layer][f"{m.canon}.weight"]
    return W if m.role == "reader" else W.T


def _reducible(m: MatrixPlan) -> bool:
    """Whether ``m``'s term is solved on its Gram root (:meth:`Term.reducible`; shape and structure only)."""
    return Term(m.name, torch.empty(m.structure.shape, device="meta"), m.structure).reducible()


class _Weighting:
    """The weights of one segment's terms at one stage: its readers share one column weight (its damped
    normalised-stream moments) and, matched, one map A; a writer's row weight is its damped input moments."""

    def __init__(self, run, stage: str, segment: int, consume: bool):
        stats = run.stats
        self.stats, self.stage, self.segment, self.damping = stats, stage, segment, run.options.damping
        self.device, self.consume = run.device, consume
        # the token counts D on the rows, as the Gram (√(D+1))²
        self.token_gram = None if stats is None else st.Gram(diag=(stats.token_counts + 1.0).to(run.device))
        self.weighted = stage == "w" and stats is not None and stats.normed is not None
        self.matched = self.weighted and stats.normed_cross is not None
        self._column = self._map = None

    def column_weight(self) -> torch.Tensor:
        """The readers' column weight, made with their map A where matched (consumed: both from the segment's
        moments in place)."""
        if self._column is None:
            self._column, self._map = targets.reader_weights(
                self.segment, self.stats, self.damping, self.device, self.matched, self.consume
            )
        return self._column

    def reader_map(self) -> torch.Tensor | None:
        """The readers' map A (``None`` unless matched)."""
        self.column_weight()
        return self._map

    def token_rows(self, m: MatrixPlan) -> bool:
        """The embedding (stages F, W) and head (stage F): weighted by the token counts on their rows."""
        if self.token_gram is None or self.stage not in ("f", "w"):
            return False
        return m.canon == "embed" or (m.canon == "lm_head" and self.stage == "f")

    def tall_term(self, m: MatrixPlan, globals_, row_dtype) -> Term:
        """A tall embedding or head, weighted as :meth:`term`; a head's matched target a block of rows at a time."""
        col = right = None
        if self.weighted and m.canon == "lm_head":
            col, right = self.column_weight(), self.reader_map()
        token = self.token_gram.diag if self.token_rows(m) else None
        return TallTerm.reduced(m, globals_, token, self.device, row_dtype, right, col)

    def term(self, m: MatrixPlan, layers, globals_) -> Term:
        """``m``'s term: its matrix (or matched target) with its row or column weight."""
        stats, device, consume = self.stats, self.device, self.consume
        row_weight, reduced = None, False  # a writer's damped input moments, or (reduced) only Mᵀ G M of them
        if self.matched and m.canon != "embed":
            reduced = consume and m.role == "writer" and _reducible(m)  # M handed over: freed once used
            M, row_weight = targets.matched_target(
                m,
                _matrix_of(m, layers, globals_).to(device),
                stats,
                self.damping,
                consume=consume,
                rows_gram=reduced,
                reader_map=self.reader_map() if m.role == "reader" else None,
            )
        else:
            M = _matrix_of(m, layers, globals_).to(device)
            if self.weighted and m.canon in ("o", "down"):
                G, _ = stats.writer_moments(m.segment, consume)
                row_weight = targets.damped(G.to(device), self.damping, in_place=consume)
                del G
        term = Term(m.name, M, m.structure)
        del M
        if self.token_rows(m):
            term.row_gram = self.token_gram
        if self.weighted and m.role == "reader" and term.row_gram is None:
            term.col_gram = self.column_weight()
        elif row_weight is not None and reduced:
            term.set_rows_gram(row_weight)
        elif row_weight is not None:
            term.row_gram = st.Gram(matrix=row_weight)
            del row_weight
            if consume and term.reducible():  # its solve needs Mᵀ G M only: the [k, k] G goes now
                term.release_row_weight()
        return term


def each_term(run, layers: list[Tensors], globals_: Tensors, stage: str, segment: int, row_dtype=None, consume=False):
    """``(MatrixPlan, Term)`` of each compressed matrix of ``segment``, weighted for ``stage`` by ``run.stats``, on
    ``run.device``, made one at a time when asked for (unbalanced: λ = 1). A tall matrix's row factor is lifted into
    ``row_dtype``. ``consume``: the statistics are dropped from ``run.stats`` once their terms are built."""
    weighting = _Weighting(run, stage, segment, consume)
    for m in run.plan.matrices:
        if not m.compressed or m.segment != segment:
            continue
        if TallTerm.applies(m):
            yield m, weighting.tall_term(m, globals_, row_dtype)
        else:
            yield m, weighting.term(m, layers, globals_)


def segment_terms(
    run, layers: list[Tensors], globals_: Tensors, stage: str, segment: int, row_dtype=None, consume=False
) -> list[Term]:
    """The terms of :func:`each_term`, balanced (stage ``none`` is not)."""
    pairs = list(each_term(run, layers, globals_, stage, segment, row_dtype, consume))
    terms = [t for _, t in pairs]
    if stage != "none":
        balance(terms, [t for m, t in pairs if m.role == "reader"])
    return terms
