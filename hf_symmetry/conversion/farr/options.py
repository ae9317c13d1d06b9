"""What a FaRR run is asked to do: the energy threshold τ or the parameter budget, the paths
(value/output, query/key) and the basis."""

from __future__ import annotations

from dataclasses import dataclass

from ...solvers import fused


@dataclass(frozen=True)
class FarrOptions:
    """Exactly one of ``tau`` (per-group energy threshold) and ``params_fraction`` (the fraction of the
    parameters of the projections FaRR rewrites that the result keeps: ``v_proj`` + ``o_proj`` with
    ``vo``, ``q_proj`` + ``k_proj`` with ``qk``; weights and biases, all layers). ``basis`` other than
    ``"fused"`` selects the single-factor baselines of the benchmark (see :func:`fused.factor_basis_split`)."""

    tau: float | None = None
    params_fraction: float | None = None
    vo: bool = True
    qk: bool = False
    basis: fused.Basis = "fused"

    def validate(self) -> None:
        if (self.tau is None) == (self.params_fraction is None):
            raise ValueError("give exactly one of tau (energy threshold) and params_fraction (parameter budget)")
        if self.tau is not None:
            fused.check_tau(self.tau)
        if self.params_fraction is not None and not 0.0 < self.params_fraction <= 1.0:
            raise ValueError(f"params_fraction must be in (0, 1], got {self.params_fraction}")
        if not (self.vo or self.qk):
            raise ValueError("nothing to reduce: enable the value/output path, the query/key path or both")
        if self.basis not in ("fused", "input", "output"):
            raise ValueError(f"unknown basis {self.basis!r}; choose fused, input or output")

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, on in (("vo", self.vo), ("qk", self.qk)) if on)
