"""The FaRR family a source checkpoint becomes (:class:`FarrTarget`: facts read from its config and
keys, the config of the result, the parameters of each rewritten path), the refusals made before
any work (:func:`farr_target`), and which layers have a fusable score map (:func:`qk_layers`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import CONFIG_MAPPING

from ...architectures import Adapter
from ...architectures.capabilities import require
from ...modeling import configuration_farr, modeling_farr
from ...modeling.configuration_farr import qk_parameters, vo_parameters
from ...solvers import fused
from .options import FarrOptions


@dataclass(frozen=True)
class FarrTarget:
    """What the FaRR model of a source checkpoint looks like (facts read from config and keys)."""

    encoder: bool  # a BERT-like encoder (else a decoder)
    source_config: dict  # normalised by the source's own config class
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    q_bias: bool
    k_bias: bool  # after FaRR: encoders drop it (exact without RoPE)
    o_bias: bool  # after FaRR: holds the folded value bias
    qk_norm: bool
    mlp_bias: bool

    def path_params(self, path: str, rank: int) -> int:
        """Parameters of one layer's rewritten projections for ``path`` at ``rank``."""
        if path == "vo":
            return vo_parameters(self.hidden, self.n_heads, self.n_kv, rank, self.o_bias)
        return qk_parameters(self.hidden, self.n_heads, self.n_kv, rank, self.q_bias, self.k_bias)

    def make_config(self, vo_dims: list[int] | None, qk_dims: list[int] | None):
        cfg = {
            k: v
            for k, v in self.source_config.items()
            if k not in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")
        }
        if not self.encoder:
            fields = {f.name for f in dataclasses.fields(configuration_farr.FarrLlamaConfig)}
            cfg = {k: v for k, v in cfg.items() if k in fields or k.endswith("_token_id")}
            cfg.update(
                attention_bias=self.q_bias,
                o_bias=self.o_bias,
                qk_norm=self.qk_norm,
                mlp_bias=self.mlp_bias,
                head_dim=self.head_dim,
                num_key_value_heads=self.n_kv,
                v_head_dims=vo_dims,
                qk_head_dims=[self.head_dim if r is None else r for r in qk_dims] if qk_dims else None,
            )
            config = configuration_farr.FarrLlamaConfig(**cfg)
        else:
            source_class = CONFIG_MAPPING[self.source_config["model_type"]]  # the FaRR encoder of that class
            cls = next(
                c
                for c in (configuration_farr.FarrRobertaConfig, configuration_farr.FarrBertConfig)
                if issubclass(c, source_class)
            )
            config = cls(**cfg, qk_head_dims=qk_dims, v_head_dims=vo_dims)
        config.architectures = [next(iter(farr_classes(config).values())).__name__]
        return config


def normalised_config(config) -> dict:
    """The source config as its own transformers class writes it (legacy keys such as a top-level
    ``rope_theta`` become ``rope_parameters``)."""
    if not isinstance(config, dict):
        return config.to_dict()
    return CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)).to_dict()


def farr_target(adapter: Adapter, config: dict, keys: list[str], options: FarrOptions) -> FarrTarget:
    """The FaRR family for this checkpoint; refuses, before any work, what FaRR cannot do exactly."""
    options.validate()
    model_type = config.get("model_type")
    require(adapter, "farr_vo")  # the FaRR families can express this checkpoint (else: the structural reason)
    src = normalised_config(config)
    encoder = not adapter.spec.is_decoder
    if encoder:
        if adapter.prefix:
            raise ValueError(
                f"this {model_type} checkpoint wraps the encoder under {adapter.prefix!r} with a task head; "
                "FaRR encoders are base models: convert the base model"
            )
        if src.get("is_decoder") or src.get("add_cross_attention"):
            raise ValueError("FaRR encoders do not support is_decoder / add_cross_attention BERT models")
    L = adapter.layout
    if options.qk:
        layers = qk_layers(adapter)
        if not layers:
            raise ValueError(f"--qk is not possible for {model_type}: {fused.qk_fusion_blocker(L)}; reduce V/O only")
        if any(adapter.layer_layout(i).rotary_dim for i in layers):
            raise ValueError(
                f"--qk is not possible for {model_type}: partially rotary heads are not supported "
                "(the FaRR decoder applies RoPE to whole heads); reduce V/O only"
            )
    has = lambda module: f"{adapter.layer_prefix(0)}{module}.bias" in set(keys)  # noqa: E731
    a, f = adapter.spec.attention, adapter.spec.ffn
    return FarrTarget(
        encoder=encoder,
        source_config=src,
        hidden=adapter.hidden,
        n_heads=L.n_heads,
        n_kv=L.n_kv_heads,
        head_dim=L.head_dim,
        q_bias=has(a.q),
        k_bias=has(a.k) and not encoder,
        o_bias=has(a.o) or has(a.v),
        qk_norm=L.qk_norm,
        mlp_bias=has(f.up),
    )


def qk_fusable(layout) -> bool:
    return fused.qk_fusion_blocker(layout) is None


def qk_layers(adapter: Adapter) -> list[int]:
    """Layers with a fusable score map: no QK-norm and some query/key dims RoPE leaves alone
    (encoders, NoPE layers such as SmolLM3's every 4th, the free dims of partially rotary heads)."""
    return [i for i in range(adapter.n_layers) if qk_fusable(adapter.layer_layout(i))]


def farr_classes(farr_config) -> dict[str, type]:
    return {
        configuration_farr.FarrLlamaConfig.model_type: {
            "AutoModelForCausalLM": modeling_farr.FarrLlamaForCausalLM,
            "AutoModel": modeling_farr.FarrLlamaModel,
        },
        configuration_farr.FarrBertConfig.model_type: {"AutoModel": modeling_farr.FarrBertModel},
        configuration_farr.FarrRobertaConfig.model_type: {"AutoModel": modeling_farr.FarrRobertaModel},
    }[farr_config.model_type]
