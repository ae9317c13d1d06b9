"""One global rotation (``--q-mode global``): stage F/W with one Q for every residual segment, solved
over all the compressed matrices together, with the weights streamed from the checkpoint.

The alternation of :func:`...solvers.segments.solve_segment` needs every matrix at each projection
step, but between projections only their summaries: the rotation step minimises
``C − 2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)``, where the constant C, ``K`` (``d × d``) and one ``H_p`` per
segment with compressed readers (stage W; ``Σ_p`` is that segment's column weight) are sums over the
matrices. So each alternation here is one *sweep* over the segments in order. A segment's matrices are
read from the checkpoint, norm-folded, weighted and balanced as the per-segment path makes them
(:func:`.terms.each_term`). Each is then fitted at the current Q, added to the summaries and dropped.

Held across sweeps: Q, the summaries (with each segment's ``Σ_p``, which the rotation step needs
itself), and warm starts. Where a fit is an alternating least squares started from the previous
factors (Kronecker/GS with a weight), those factors are kept, spilled to safetensors files in a
scratch folder. Nothing holds a matrix between sweeps, so memory does not grow with depth beyond
those summaries. The last sweep fits the matrices at the final Q in float64, keeps their factors
and hands each finished segment on (``on_segment``). The solve equals
:func:`~...solvers.segments.solve_segment` on all the terms at once, to round-off (tested)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ...solvers.segments import (
    Summary,
    Term,
    balance,
    nearest_orthogonal,
    over_relaxed,
    weighted_procrustes,
    work_term,
)

Tensor = torch.Tensor


class _Spill:
    """Warm-start factors by matrix name, one safetensors file each in ``folder`` (created)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        self.files: dict[str, Path] = {}

    def put(self, name: str, factors: tuple[Tensor, ...]) -> None:
        path = self.folder / f"{len(self.files)}.safetensors"
        save_file({str(i): f.detach().cpu().contiguous() for i, f in enumerate(factors)}, str(path))
        self.files[name] = path

    def get(self, name: str, dtype: torch.dtype, device) -> tuple[Tensor, ...] | None:
        if name not in self.files:
            return None
        loaded = load_file(str(self.files[name]))
        return tuple(loaded[str(i)].to(device=device, dtype=dtype) for i in range(len(loaded)))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _warm_started(t: Term) -> bool:
    """Whether ``t``'s fit starts from its previous factors (weighted Kronecker/GS: alternating least
    squares; low rank and unweighted fits are closed form)."""
    return not t.is_dense and t.structure.iterative and (t.row_gram is not None or t.col_gram is not None)


class GlobalSolve:
    """Stage ``stage`` with one rotation over every segment (see the module docstring). ``terms(k)``
    yields ``(MatrixPlan, Term)`` of segment ``k`` as :func:`.terms.each_term` makes them."""

    def __init__(self, terms, n_segments: int, stage: str, options, d: int, device=None):
        self.terms, self.n_segments, self.stage, self.options = terms, n_segments, stage, options
        self.d, self.device = d, torch.device(device or "cpu")

    def _segment(self, k: int) -> list[Term]:
        terms, readers = [], []
        for m, t in self.terms(k):
            terms.append(t)
            if m.role == "reader":
                readers.append(t)
        if self.stage != "none":
            balance(terms, readers)
        return terms

    def sweep(self, Q: Tensor, dtype: torch.dtype, warm: _Spill | None, spill: _Spill | None) -> Summary:
        """Fit every matrix at ``Q`` (iterations in ``dtype``, started from ``warm``'s factors where the
        fit uses them, the new ones put in ``spill``): the summary of the fitted factors."""
        summary = Summary(torch.zeros(self.d, self.d, dtype=dtype, device=Q.device))
        for k in range(self.n_segments):
            grams: dict = {}  # the segment's column weight, cast once for its readers
            for t in self._segment(k):
                w, _ = work_term(t, keep_weights=False)
                del t
                if dtype != w.M.dtype:
                    w = w.cast(dtype, grams)
                if warm is not None and _warm_started(w):
                    w.factors = warm.get(w.name, dtype, w.M.device)
                w.fit(Q, self.options.als_iters)
                summary.add(w, at=Q)
                w._summary = None
                if spill is not None and _warm_started(w):
                    spill.put(w.name, w.factors)
                del w
        return summary

    def finish(self, Q: Tensor, warm: _Spill | None, keep, on_segment=None) -> float:
        """The last sweep: every matrix fitted at ``Q`` in float64 (from ``warm``'s factors), lifted,
        handed to ``keep(term)`` (e.g. :func:`.solve._keep`) and dropped; ``on_segment(k)`` once segment
        ``k``'s matrices are kept. ``keep`` and ``on_segment`` also receive Q. Returns the objective at Q."""
        total = 0.0
        for k in range(self.n_segments):
            for t in self._segment(k):
                w, R = work_term(t, keep_weights=False)
                if warm is not None and _warm_started(w):
                    w.factors = warm.get(w.name, torch.float64, w.M.device)
                w.fit(Q, self.options.als_iters)
                if not w.is_dense:
                    total += w.weight * w.error(Q)
                w._summary = None
                if R is not None:
                    t.lift(w, R)
                keep(t, Q)
                del t, w, R
            if on_segment is not None:
                on_segment(k, Q)
        return total

    def solve(
        self,
        Q0: Tensor,
        iters: int,
        progress: bool = True,
        desc: str = "global Q",
        final: bool = True,
        keep=None,
        on_segment=None,
        scratch: str | Path | None = None,
    ) -> tuple[Tensor, list[float]]:
        """Alternate sweeps and rotation steps from ``Q0`` as :func:`...solvers.segments.solve_segment`
        does (its stopping rule, over-relaxation and float32 iterations of ``options``), then
        :meth:`finish` at the final Q (``final=False``: the factors are not wanted, e.g. stage F's
        before stage W; the trace then ends with the objective after the last rotation step).
        Returns (Q, objective trace)."""
        rule = self.options.stopping(self.stage)
        dtype = getattr(torch, self.options.solver_dtype)
        fast = dtype != torch.float64 and iters > 0
        loop_dtype = dtype if fast else torch.float64
        Q = Q0.to(device=self.device, dtype=torch.float64).clone()
        Qw = Q.to(loop_dtype)
        trace: list[float] = []
        before, Q_prev, beta = None, None, 1.0
        with tempfile.TemporaryDirectory(prefix="hf_symmetry-global-q-", dir=scratch) as root:
            serial = iter(range(10**9))

            def spill() -> _Spill:
                return _Spill(Path(root) / str(next(serial)))

            warm = None
            bar = tqdm(total=iters, desc=desc, unit="alternation", disable=not progress or iters == 0)
            for _ in range(iters):
                new = spill()
                S = self.sweep(Qw, loop_dtype, warm, new)
                if rule["extrapolate"] and Q_prev is not None:
                    # over-relaxation, as solve_segment: kept only if its fitted objective is lower
                    Qc = over_relaxed(Qw, Q_prev, beta)
                    cand = spill()
                    Sc = self.sweep(Qc, loop_dtype, new, cand)
                    if Sc.J < S.J:
                        new.remove()
                        Qw, S, new, beta = Qc, Sc, cand, min(2 * beta, 8.0)
                    else:
                        cand.remove()
                        beta = max(beta / 2, 0.25)
                if warm is not None:
                    warm.remove()
                warm = new
                trace.append(S.J)
                if before is None:
                    before = S.J
                if S.dense_only:
                    break
                Q_prev = Qw
                Qw, _ = weighted_procrustes(S.K, S.pairs, Qw, iters=self.options.wopp_iters, tol=rule["wopp_tol"])
                trace.append(S.value(Qw))
                del S
                bar.update(1)
                bar.set_postfix(J=f"{trace[-1]:.4g}")
                if rule["tol"] > 0 and before - trace[-1] <= rule["tol"] * abs(before):
                    break
                before = trace[-1]
            bar.close()
            if not fast:
                Q = Qw
            elif iters:
                Q = nearest_orthogonal(Qw)
            if final:
                trace.append(self.finish(Q, warm, keep, on_segment))
        return Q, trace
