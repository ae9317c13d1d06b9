"""One global rotation (``--q-mode global``): stage F/W with one Q for every residual segment, over all the
compressed matrices at once, the weights streamed from the checkpoint.

Between projections the alternation needs only the matrices' summaries: the rotation step minimises
``C − 2 tr(QᵀK) + Σ_p tr(Σ_p Q H_p Qᵀ)``, where C, ``K`` (``d × d``) and one ``H_p`` per segment with
compressed readers (``Σ_p``: its column weight) are sums over the matrices. So each alternation is one
*sweep* over the segments: each matrix is read, weighted, fitted at the current Q, added to the summaries
and dropped. Held across sweeps: Q, the summaries and the warm starts of the alternating least squares fits
(weighted Kronecker/GS), spilled to safetensors files: memory does not grow with depth. The last sweep fits
at the final Q in float64 and keeps the factors. The result equals ``solve_segment`` on all the terms at
once, to round-off."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ...solvers.segments import (
    Alternation,
    Summary,
    Term,
    nearest_orthogonal,
    over_relaxed,
    weighted_procrustes,
    work_term,
)

Tensor = torch.Tensor


class _Spill:
    """Warm-start factors by matrix name, one safetensors file each in a new folder under ``root``."""

    def __init__(self, root: str):
        self.folder = Path(tempfile.mkdtemp(dir=root))
        self.files: dict[str, Path] = {}

    def put(self, name: str, factors: tuple[Tensor, ...]) -> None:
        path = self.folder / f"{len(self.files)}.safetensors"
        save_file({str(i): f.detach().cpu().contiguous() for i, f in enumerate(factors)}, str(path))
        self.files[name] = path

    def get(self, name: str, dtype: torch.dtype, device) -> tuple[Tensor, ...]:
        loaded = load_file(str(self.files[name]))
        return tuple(loaded[str(i)].to(device=device, dtype=dtype) for i in range(len(loaded)))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _warm_started(t: Term) -> bool:
    """Whether ``t``'s fit starts from its previous factors (weighted Kronecker/GS: alternating least
    squares; low rank and unweighted fits are closed form)."""
    return not t.is_dense and t.structure.iterative and (t.row_gram is not None or t.col_gram is not None)


class GlobalSolve:
    """``schedule``'s alternations with one ``d × d`` rotation over the segments' terms (``terms(k)``: segment
    ``k``'s, balanced), on ``device``."""

    def __init__(self, terms, n_segments: int, schedule: Alternation, d: int, device=None):
        self.terms, self.n_segments, self.schedule = terms, n_segments, schedule
        self.d, self.device = d, torch.device(device or "cpu")

    def _fit(self, t: Term, Q: Tensor, dtype: torch.dtype, warm: _Spill | None, grams: dict):
        """``t``'s working term fitted at ``Q`` in ``dtype`` (from ``warm``'s factors where the fit uses them), and
        ``R`` to lift it back (:func:`...solvers.segments.work_term`)."""
        w, R = work_term(t, keep_weights=False)
        if dtype != w.M.dtype:
            w = w.cast(dtype, grams)
        if warm is not None and _warm_started(w):
            w.factors = warm.get(w.name, dtype, w.M.device)
        w.fit(Q, self.schedule.als_iters)
        return w, R

    def sweep(self, Q: Tensor, dtype: torch.dtype, warm: _Spill | None, spill: _Spill) -> Summary:
        """Every matrix fitted at ``Q`` (the warm starts of the new fits put in ``spill``): their summary."""
        summary = Summary(torch.zeros(self.d, self.d, dtype=dtype, device=Q.device))
        for k in range(self.n_segments):
            grams: dict = {}  # the segment's column weight, cast once for its readers
            for t in self.terms(k):
                w, _ = self._fit(t, Q, dtype, warm, grams)
                del t
                summary.add(w, at=Q)
                w._summary = None
                if _warm_started(w):
                    spill.put(w.name, w.factors)
                del w
        return summary

    def finish(self, Q: Tensor, warm: _Spill | None, kept) -> float:
        """The last sweep: every matrix fitted at ``Q`` in float64, lifted, kept (``kept``: a :class:`.solve.Kept`)
        and dropped, each segment handed on once kept. Returns the objective."""
        total, Qs = 0.0, [Q.cpu()] * self.n_segments
        for k in range(self.n_segments):
            for t in self.terms(k):
                w, R = self._fit(t, Q, torch.float64, warm, {})
                if not w.is_dense:
                    total += w.weight * w.error(Q)
                w._summary = None
                if R is not None:
                    t.lift(w, R)
                kept.keep([t], Q)
                del t, w, R
            kept.on_segment(k, Qs, kept.factors)
        return total

    def solve(
        self, Q0: Tensor, progress: bool, desc: str, kept, scratch: str | Path | None, final: bool = True
    ) -> tuple[Tensor, list[float]]:
        """Alternate sweeps and rotation steps from ``Q0`` as ``solve_segment`` does, then :meth:`finish` at the
        final Q where ``final``; warm starts spilled under ``scratch`` (None: the system's temporary folder)."""
        schedule = self.schedule
        iters, dtype = schedule.iters, schedule.dtype
        fast = dtype != torch.float64 and iters > 0
        loop_dtype = dtype if fast else torch.float64
        Qw = Q0.to(device=self.device, dtype=torch.float64).clone().to(loop_dtype)
        trace: list[float] = []
        before, Q_prev, beta = None, None, 1.0
        with tempfile.TemporaryDirectory(prefix="hf_symmetry-global-q-", dir=scratch) as root:
            warm = None
            bar = tqdm(total=iters, desc=desc, unit="alternation", disable=not progress or iters == 0)
            for _ in range(iters):
                new = _Spill(root)
                S = self.sweep(Qw, loop_dtype, warm, new)
                if schedule.extrapolate and Q_prev is not None:
                    # over-relaxation, as solve_segment: kept only if its fitted objective is lower
                    Qc = over_relaxed(Qw, Q_prev, beta)
                    cand = _Spill(root)
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
                Qw, _ = weighted_procrustes(S.K, S.pairs, Qw, iters=schedule.wopp_iters, tol=schedule.wopp_tol)
                trace.append(S.value(Qw))
                del S
                bar.update(1)
                bar.set_postfix(J=f"{trace[-1]:.4g}")
                if schedule.tol > 0 and before - trace[-1] <= schedule.tol * abs(before):
                    break
                before = trace[-1]
            bar.close()
            Q = nearest_orthogonal(Qw) if fast else Qw
            if final:
                trace.append(self.finish(Q, warm, kept))
        return Q, trace
