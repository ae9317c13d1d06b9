"""The RMS-decoder output family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`), which every rotated or
compressed LayerNorm decoder (OPT, GPT-2, GPT-NeoX, GPT-J) is written as: mean-centring a layer and the globals
(each LayerNorm becomes a weightless RMSNorm, its γ and β folded into the readers), the family's config made from
the source's, and its flat remote-code files copied next to the weights. ``rotate --residual`` and compress's
LayerNorm route both use it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CONFIG_MAPPING

from ..architectures import Adapter
from ..architectures.capabilities import facts
from ..modeling.configuration_rms_decoder import RMSDecoderConfig
from ..modeling.modeling_rms_decoder import RMSDecoderForCausalLM, RMSDecoderModel
from ..symmetry import actions
from .remote_code import copy_family_files, family_auto_map, family_modules

Tensors = dict[str, torch.Tensor]
#: the auto classes the family's ``auto_map`` names
MODEL_CLASSES = {"AutoModel": RMSDecoderModel, "AutoModelForCausalLM": RMSDecoderForCausalLM}


def centre_layer(layer: Tensors) -> Tensors:
    """Centre the writers, fold each LayerNorm's γ and β into its readers, and drop the norms
    (they become weightless RMSNorms); every linear gets a bias (the RMS-decoder family has them)."""
    layer = actions.fold_layer_norms(actions.centre_writers(layer))
    for key in [k for k in layer if k.split(".")[0] in ("attn_norm", "ffn_norm")]:
        del layer[key]
    for name in ("q", "k", "v", "o", "up", "down"):
        W = layer[f"{name}.weight"]
        if f"{name}.bias" not in layer:
            layer[f"{name}.bias"] = torch.zeros(W.shape[0], dtype=W.dtype)
    return layer


def centre_globals(g: Tensors) -> Tensors:
    """Untie the head (it reads the final norm, not the centred embedding), centre every embedding
    row, fold the final LayerNorm (γ and β) into the head, which gains a bias."""
    g = dict(g)
    if "lm_head.weight" not in g:
        g["lm_head.weight"] = g["embed.weight"].clone()
    for key in [k for k in g if k == "embed.weight" or (k.startswith("pos") and k.endswith(".weight"))]:
        g[key] = actions.centre_rows(g[key].to(torch.float64))
    g = actions.fold_final_norm(g)
    g.pop("final_norm.weight", None)
    g.pop("final_norm.bias", None)
    if "lm_head.bias" not in g:
        g["lm_head.bias"] = torch.zeros(g["lm_head.weight"].shape[0], dtype=torch.float64)
    return g


def rms_decoder_config(
    adapter: Adapter, config: dict, intermediate_size: int, position_rows: int, residual_size: int | None = None
) -> dict:
    """The RMS-decoder config of a centred LayerNorm decoder (OPT, GPT-2); ``residual_size`` below the
    hidden size for a sliced one (SliceGPT)."""

    def get(*names, default=None):
        return next((config[n] for n in names if config.get(n) is not None), default)

    f = facts(config)
    rotary = {}
    if f.rope != "none":  # the family's own config object standardises old rotary fields (rotary_pct, ...)
        rope = getattr(CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)), "rope_parameters", None) or {}
        L = adapter.layout  # GPT-J names its rotary width (rotary_dim) and has no rope_parameters
        rope = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            **rope,
            "partial_rotary_factor": L.rotary_dim / L.head_dim,
        }
        rotary = {"rotary": True, "rope_parameters": rope}
    max_pos = int(get("max_position_embeddings", "n_positions", default=position_rows))
    cfg = RMSDecoderConfig(
        **rotary,
        parallel_block=f.parallel_block,
        vocab_size=int(config["vocab_size"]),
        hidden_size=adapter.hidden,
        residual_size=residual_size,
        head_dim=adapter.layout.head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=adapter.n_layers,
        num_attention_heads=adapter.layout.n_heads,
        hidden_act=get("hidden_act", "activation_function", default="gelu_new"),
        max_position_embeddings=max_pos,
        position_offset=position_rows - max_pos if position_rows else 0,
        positions_from_mask=adapter.spec.positions_from_mask,
        rms_norm_eps=adapter.eps,
        pad_token_id=get("pad_token_id"),
        bos_token_id=get("bos_token_id"),
        eos_token_id=get("eos_token_id"),
        tie_word_embeddings=False,
        architectures=["RMSDecoderForCausalLM"],
        auto_map=family_auto_map(RMSDecoderConfig, MODEL_CLASSES),
    )
    out = cfg.to_dict()
    if config.get("dtype") or config.get("torch_dtype"):
        out["dtype"] = config.get("dtype") or config.get("torch_dtype")
    return out


def check_layer_norm_decoder(config: dict) -> None:
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("scale_attn_weights") is False:
        raise ValueError(
            "residual rotation of this GPT-2 checkpoint: its attention is not scaled by 1/√head_dim "
            "(scale_attn_weights / scale_attn_by_inverse_layer_idx), which the RMS-decoder family assumes"
        )


def copy_remote_code(dst: Path) -> None:
    """The RMS-decoder family's flat files next to the weights (``trust_remote_code`` loading)."""
    copy_family_files(dst, *family_modules(RMSDecoderConfig, MODEL_CLASSES))
