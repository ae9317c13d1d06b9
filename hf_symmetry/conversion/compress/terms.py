"""The solvers' terms: each compressed matrix of the plan as a :class:`...solvers.segments.Term` (or, for a
tall embedding or head, a :class:`.tall.TallTerm`), weighted for its stage by the calibration statistics
(:class:`_Weighting`: token counts on the embedding's rows, a reader's column weight, a writer's row weight,
and sequential calibration's matched targets), made one at a time as the solver asks for them
(:func:`each_term`) or collected and balanced per segment (:func:`segment_terms`)."""

from __future__ import annotations

import torch

from ...solvers import structures as st
from ...solvers.segments import Term, balance
from . import targets
from .options import CompressOptions
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


def segment_terms(
    run, layers: list[Tensors], globals_: Tensors, stage: str, only: int | None = None, row_dtype=None, consume=False
) -> list[tuple[list[Term], list[Term]]]:
    """Per segment: (terms, readers) of the compressed matrices, weighted for ``stage`` (only segment
    ``only`` filled when given: sequential calibration has the statistics of one segment at a time),
    balanced (:func:`...solvers.segments.balance`); the terms are those of :func:`each_term`."""
    segments: list[tuple[list[Term], list[Term]]] = [([], []) for _ in range(run.plan.n_segments)]
    for m, term in each_term(run, layers, globals_, stage, only, row_dtype, consume):
        terms, readers = segments[m.segment]
        terms.append(term)
        if m.role == "reader":
            readers.append(term)
    for terms, readers in segments:
        if stage != "none":
            balance(terms, readers)
    return segments


def _reducible(m: MatrixPlan) -> bool:
    """Whether ``m``'s term is solved on its Gram root (:meth:`Term.reducible`; shape and structure only)."""
    return Term(m.name, torch.empty(m.structure.shape, device="meta"), m.structure).reducible()


class _Weighting:
    """The weights of one stage's terms (see :func:`each_term`): the token counts on the embedding's (and
    stage F's head's) rows, a reader's column weight (its segment's damped normalised-stream moments,
    one tensor per segment shared by its readers), a writer's row weight (its damped input moments),
    and under sequential calibration each matrix's matched target."""

    def __init__(self, stats, stage: str, options: CompressOptions, device, consume: bool):
        self.stats, self.stage, self.damping = stats, stage, options.damping
        self.device, self.consume = device, consume
        self.token_gram = None if stats is None else st.Gram(diag=(stats.token_counts + 1.0).to(device))  # (√(D+1))²
        self.weighted = stage == "w" and stats is not None and stats.normed is not None
        self.matched = self.weighted and stats.normed_cross is not None
        self.reader_cov: dict[int, torch.Tensor] = {}  # one tensor per segment, shared by its readers
        self.reader_maps: dict[int, torch.Tensor] = {}  # ... and its matched targets' map A

    def column_weight(self, segment: int) -> torch.Tensor:
        if segment not in self.reader_cov:
            if self.consume:  # the segment's readers' weight and map made at once, from its moments in place
                self.reader_cov[segment], A = targets.consume_reader_moments(
                    segment, self.stats, self.damping, self.device, self.matched
                )
                if A is not None:
                    self.reader_maps.clear()
                    self.reader_maps[segment] = A
            else:
                self.reader_cov[segment] = targets.damped(self.stats.normed[segment].to(self.device), self.damping)
        return self.reader_cov[segment]

    def reader_map(self, segment: int) -> torch.Tensor:
        if self.consume:
            self.column_weight(segment)
        if segment not in self.reader_maps:
            self.reader_maps.clear()  # segments come in order: one A held at a time
            self.reader_maps[segment] = targets.segment_reader_map(segment, self.stats, self.damping, self.device)
        return self.reader_maps[segment]

    def token_rows(self, m: MatrixPlan) -> bool:
        """The embedding (stages F, W) and head (stage F): weighted by the token counts on their rows."""
        return (
            m.canon in ("embed", "lm_head")
            and self.stage in ("f", "w")
            and self.token_gram is not None
            and (m.canon == "embed" or self.stage == "f")
        )

    def tall_term(self, m: MatrixPlan, globals_, row_dtype):
        """A tall embedding or head (:class:`TallTerm`), weighted as :meth:`term`; a head's matched target a
        block of rows at a time."""
        col = right = None
        if self.weighted and m.canon == "lm_head":
            col = self.column_weight(m.segment)
            if self.matched:
                right = self.reader_map(m.segment)
        token = self.token_gram.diag if self.token_rows(m) else None
        return TallTerm(m, globals_, token, self.device, row_dtype, right, col).take()

    def term(self, m: MatrixPlan, layers, globals_) -> Term:
        """``m``'s term: its matrix (or matched target) with its row or column weight."""
        stats, device, consume = self.stats, self.device, self.consume
        row_metric = None  # a writer's damped input moments: its row weight (and matched_target's system)
        rows_gram = None  # ... or only Mᵀ G M of them (a reducible writer, its statistics consumed)
        if self.matched and m.canon != "embed":
            if consume and m.role == "writer" and _reducible(m):  # M handed over: freed once used
                M, rows_gram = targets.matched_target(
                    m, _matrix_of(m, layers, globals_).to(device), stats, self.damping, consume=True, rows_gram=True
                )
            else:
                M = _matrix_of(m, layers, globals_).to(device)
                M, row_metric = targets.matched_target(
                    m,
                    M,
                    stats,
                    self.damping,
                    consume=consume,
                    reader_map=self.reader_map(m.segment) if m.role == "reader" else None,
                )
        else:
            M = _matrix_of(m, layers, globals_).to(device)
            if self.weighted and m.canon in ("o", "down"):
                key = "attn_out" if m.canon == "o" else "mlp_hidden"
                G = getattr(stats, key)[m.layer]
                if consume:
                    getattr(stats, key)[m.layer] = None
                row_metric = targets.damped(G.to(device), self.damping, in_place=consume)
                del G
        term = Term(m.name, M, m.structure)
        del M
        if self.token_rows(m):
            term.row_gram = self.token_gram
        if self.weighted:
            if m.role == "reader" and term.row_gram is None:
                term.col_gram = self.column_weight(m.segment)
            elif rows_gram is not None:
                term.set_rows_gram(rows_gram)
            elif row_metric is not None:
                term.row_gram = st.Gram(matrix=row_metric)
                del row_metric
                if consume and term.reducible():  # its solve needs Mᵀ G M only: the [k, k] G goes now
                    term.release_row_weight()
        return term


def each_term(
    run, layers: list[Tensors], globals_: Tensors, stage: str, only: int | None = None, row_dtype=None, consume=False
):
    """``(MatrixPlan, Term)`` of each compressed matrix of ``run.plan`` (of segment ``only`` when given) on
    the norm-folded ``layers`` and ``globals_`` (:mod:`.folded`), weighted for ``stage`` by ``run.stats``
    (:class:`_Weighting`), on ``run.device``, made one at a time when asked for (unbalanced: λ = 1). A low-rank,
    GS (one row block) or Kronecker (``A_s`` of one row) embedding or untied head enters as its reduced
    term (:class:`TallTerm`, read a block of rows at a time; its row factor is lifted into ``row_dtype``,
    default float64). ``consume``: the writers' statistics are dropped from ``stats`` once their terms
    are built (see :func:`.targets.matched_target`)."""
    weighting = _Weighting(run.stats, stage, run.options, run.device, consume)
    for m in run.plan.matrices:
        if not m.compressed or (only is not None and m.segment != only):
            continue
        if TallTerm.applies(m):
            yield m, weighting.tall_term(m, globals_, row_dtype)
        else:
            yield m, weighting.term(m, layers, globals_)
