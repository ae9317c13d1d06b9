"""What a conversion reports: per-layer errors (:class:`LayerError`), the conversion's
:class:`ToTPAReport` (ranks, exactness, cache sizes; ``tpa_conversion.json``) and its model card."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...architectures import Adapter
from ...modeling.configuration_tpa import TPAConfig
from .target import heads


@dataclass
class LayerError:
    layer: int
    k_weight_rel_err: float
    v_weight_rel_err: float
    k_activation_rel_err: float | None = None  # on the calibration text (when given)
    v_activation_rel_err: float | None = None


@dataclass
class ToTPAReport:
    source: str
    family: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    k_rank: int
    v_rank: int
    exact: bool
    calibrated: bool
    calib_tokens: int = 0
    cache_elements_per_token_source: int = 0  # all layers
    cache_elements_per_token_tpa: int = 0  # all layers (A is stored once, not per token)
    layers: list[LayerError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    verification: dict | None = None

    @classmethod
    def start(
        cls,
        src: str,
        adapter: Adapter,
        tcfg: TPAConfig,
        k_rank: int,
        v_rank: int,
        exact: bool,
        calibrated: bool,
        calib_tokens: int,
    ) -> ToTPAReport:
        """The report of a conversion about to run: its source, ranks and cache sizes (no layer yet)."""
        h, n_kv, dh = heads(adapter)
        return cls(
            source=src,
            family=str(getattr(adapter.config, "model_type", "")),
            num_attention_heads=h,
            num_key_value_heads=n_kv,
            head_dim=dh,
            k_rank=k_rank,
            v_rank=v_rank,
            exact=exact,
            calibrated=calibrated,
            calib_tokens=calib_tokens,
            cache_elements_per_token_source=2 * n_kv * dh * adapter.n_layers,
            cache_elements_per_token_tpa=tcfg.kv_cache_elements_per_token(per_layer=False),
        )

    def as_dict(self) -> dict:
        return asdict(self)


def tpa_card_data(src, out, report) -> dict:
    """The model card of a conversion: ranks and cache size (per-layer errors stay in
    ``tpa_conversion.json``; exactness and perplexity are added by the verification)."""
    params = {"k_rank": report.k_rank, "v_rank": report.v_rank, "exact": report.exact}
    if report.calibrated:
        params.update(calibrated=True, calib_tokens=report.calib_tokens)
    return {
        "title": Path(out).name,
        "inputs": [str(src)],
        "method": "to-tpa",
        "parameters": params,
        "notes": "\n".join(f"- {n}" for n in report.notes) or None,
        "extra": {
            "cache_elements_per_token": {
                "source": report.cache_elements_per_token_source,
                "tpa": report.cache_elements_per_token_tpa,
            },
            "report": "tpa_conversion.json",
        },
    }
