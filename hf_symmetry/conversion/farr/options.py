"""What a FaRR run is asked to do: the energy threshold τ or the parameter budget, the paths
(value/output, query/key) and the basis."""

from __future__ import annotations

from dataclasses import dataclass

from ...flags import flag
from ...solvers import fused


@dataclass(frozen=True)
class FarrOptions:
    """Exactly one of ``tau`` (per-group energy threshold) and ``params_fraction`` (the fraction of the
    parameters of the projections FaRR rewrites that the result keeps: ``v_proj`` + ``o_proj`` with
    ``vo``, ``q_proj`` + ``k_proj`` with ``qk``; weights and biases, all layers). ``basis`` other than
    ``"fused"`` selects the single-factor baselines of the benchmark (see :func:`fused.factor_basis_split`)."""

    tau: float | None = flag(
        None,
        "energy threshold in (0, 1]: each KV group keeps the fewest singular directions holding "
        "a fraction τ of its fused map's Σσ²; each layer takes the largest rank of its groups",
        type=float,
    )
    params_fraction: float | None = flag(
        None,
        "fraction in (0, 1] of the parameters of the projections FaRR rewrites (v_proj+o_proj "
        "for --vo, q_proj+k_proj for --qk, weights and biases, all layers) that the result keeps; "
        "spent greedily across layers on the most energy per parameter",
        type=float,
    )
    # the flag is off unless given; the command turns vo on where --qk is absent too
    vo: bool = flag(
        True, "reduce the value/output path (the default when --qk is absent)", action="store_true", unset=False
    )
    qk: bool = flag(
        False,
        "reduce the query/key path; only where W_Q^T W_K is exact (no RoPE, no QK-norm: BERT, RoBERTa, "
        "and SmolLM3's NoPE layers, while its RoPE layers keep their query/key heads)",
        action="store_true",
    )
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
