"""What each family allows, derived from its structural facts (never from a list of names).

:func:`facts` gathers one checkpoint's facts: those a family always has come from its spec
(:mod:`.spec`: norm kind and placement, QK-norm, fused projections, embedding scaling, parallel
block), those that vary between checkpoints from its config (sliding windows, NoPE layers,
soft-capping, partial rotary, tying). :func:`reason` derives, for each symmetry and conversion,
``None`` (allowed) or the one-line structural reason it is not; :func:`require` raises
:class:`UnsupportedSymmetry` with that reason before any work. The adapter (:mod:`.adapter`) asks
these rules and this module never imports it: an adapter is read as what it holds (its spec and config).

The conversions that write a new model family (compress, SliceGPT, FaRR, to-tpa, and residual
rotation of LayerNorm decoders) can only write what that family can express. What an output
family can express is read from its configuration class (a ``qk_norm`` field means it has
QK-norm, ``no_rope_layers`` NoPE layers, ``layer_types`` per-layer sliding windows), so a family
that gains a feature unlocks the conversions that need it without any list changing here.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Callable

from transformers import CONFIG_MAPPING

from ..modeling.configuration_compressed_llama import CompressedLlamaConfig
from ..modeling.configuration_farr import FarrLlamaConfig
from ..modeling.configuration_rms_decoder import RMSDecoderConfig
from ..modeling.configuration_tpa import TPAConfig
from .spec import SPECS, ArchSpec, NormPosition, spec_for_model_type


class UnsupportedSymmetry(ValueError):
    """The model family does not have the requested symmetry; refusing beats a wrong model."""


SYMMETRIES = ("qk_rotation", "qk_scaling", "vo_rotation", "vo_scaling", "ffn_permutation", "residual_rotation")
CONVERSIONS = ("match", "merge", "compress", "slicegpt", "farr_vo", "farr_qk", "to_tpa")

# (key, column header) in table order; "scaling" is rotate --scaling: QK and VO scalings together
COLUMNS: tuple[tuple[str, str], ...] = (
    ("qk_rotation", "rotate QK"),
    ("vo_rotation", "rotate VO"),
    ("residual_rotation", "rotate residual"),
    ("ffn_permutation", "rotate FFN"),
    ("scaling", "rotate scaling"),
    ("match", "match"),
    ("merge", "merge"),
    ("compress", "compress"),
    ("slicegpt", "SliceGPT"),
    ("farr_vo", "FaRR V/O"),
    ("farr_qk", "FaRR Q/K"),
    ("to_tpa", "to-tpa"),
)

LABELS = {
    "qk_rotation": "QK rotation",
    "qk_scaling": "QK scaling",
    "vo_rotation": "VO rotation",
    "vo_scaling": "VO scaling",
    "ffn_permutation": "FFN permutation",
    "residual_rotation": "residual rotation",
    "scaling": "QK/VO scaling",
    "match": "match",
    "merge": "merge",
    "compress": "compress",
    "slicegpt": "SliceGPT",
    "farr_vo": "FaRR V/O",
    "farr_qk": "FaRR Q/K",
    "to_tpa": "to-tpa",
    "to_tpa_key_rank": "to-tpa below full key rank",
}


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class Facts:
    """The structural facts of one checkpoint (or of a family's default config)."""

    family: str
    model_type: str
    decoder: bool
    norm_kind: str  # rms, rms_1p, layer
    placement: NormPosition  # the spec's norm position (pre, sandwich, output, post), as measured
    qk_norm: str | None  # None, "head" or "all"
    fused_qkv: str | None  # None, "blocks" or "per_head"
    fused_gate_up: bool
    gated: bool
    rope: str  # rotate_half, interleaved, none
    partial_rotary: bool  # RoPE on only part of each head
    nope_layers: tuple[int, ...]  # layers without RoPE
    sliding: tuple[int | None, ...]  # per layer: window length, or None for global attention
    embed_scale: str  # none, sqrt_hidden
    attn_softcap: float | None
    final_softcap: float | None
    parallel_block: bool
    tied: bool
    learned_positions: bool
    embed_projection: bool  # OPT-350m style project_in/project_out around the layers

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, w in enumerate(self.sliding) if w is not None]


def _get(config, name: str, default=None):
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def _config_object(config):
    """A transformers config object (raw ``config.json`` dicts go through their own class, so
    defaults such as Qwen2's ``use_sliding_window`` or Gemma2's ``layer_types`` apply)."""
    if not isinstance(config, dict):
        return config

    model_type = config.get("model_type")
    if model_type in CONFIG_MAPPING:
        try:
            return CONFIG_MAPPING[model_type].from_dict(dict(config))
        except Exception:  # noqa: BLE001 - a partial dict (tests, tables): read it as it is
            return config
    return config


def sliding_window_layers(config) -> tuple[int | None, ...]:
    """Per layer, the sliding-window length, or None where the layer attends globally.

    The one reading of sliding windows: ``layer_types`` when the config has it (Gemma2/3,
    Qwen2/3, where ``use_sliding_window=False`` leaves every layer global), otherwise one
    ``sliding_window`` for every layer (Mistral, Phi-3)."""
    cfg = _config_object(config)
    spec = spec_for_model_type(_get(cfg, "model_type"))
    n = int(next(_get(cfg, a) for a in spec.n_layers_attr if _get(cfg, a) is not None))
    window = _get(cfg, "sliding_window")
    if isinstance(cfg, dict) and cfg.get("use_sliding_window") is False:
        window = None
    types = _get(cfg, "layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * n


def _partial_rotary(cfg, spec: ArchSpec) -> bool:
    if spec.rope_in(cfg) == "none":
        return False
    rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = factor if factor is not None else _get(cfg, "partial_rotary_factor", 1.0)
    rotary_dim = _get(cfg, "rotary_dim")
    if rotary_dim is not None:
        heads = next(_get(cfg, a) for a in spec.heads_attr if _get(cfg, a) is not None)
        hidden = next(_get(cfg, a) for a in spec.hidden_attr if _get(cfg, a) is not None)
        return int(rotary_dim) < (_get(cfg, "head_dim") or hidden // heads)
    return float(factor) < 1.0


def facts(obj) -> Facts:
    """Facts of an :class:`~.adapter.Adapter` (anything holding its :class:`ArchSpec` as ``spec``
    and its config as ``config``), a config (object or dict), or a spec (its first model type's
    transformers default config)."""
    if isinstance(getattr(obj, "spec", None), ArchSpec):  # an Adapter
        cfg, spec = _config_object(obj.config), obj.spec
    elif isinstance(obj, ArchSpec):
        spec, cfg = obj, CONFIG_MAPPING[obj.model_types[0]]()
    else:
        cfg = _config_object(obj)
        spec = spec_for_model_type(_get(cfg, "model_type"))
    a = spec.attention
    placement = spec.norm_position
    if _get(cfg, "do_layer_norm_before") is False:  # OPT-350m: post-LN
        placement = "post"
    hidden = next(_get(cfg, n) for n in spec.hidden_attr if _get(cfg, n) is not None)
    rope = spec.rope_in(cfg)
    proj = _get(cfg, "word_embed_proj_dim")
    no_rope = _get(cfg, "no_rope_layers")
    return Facts(
        family=spec.family,
        model_type=_get(cfg, "model_type", spec.model_types[0]),
        decoder=spec.is_decoder,
        norm_kind=spec.norm_kind,
        placement=placement,
        qk_norm=a.qk_norm_scope if a.qk_norm else None,
        fused_qkv=a.qkv_layout if a.qkv else None,
        fused_gate_up=spec.ffn.gate_up is not None,
        gated=spec.is_gated,
        rope=rope,
        partial_rotary=_partial_rotary(cfg, spec),
        nope_layers=tuple(i for i, f in enumerate(no_rope or []) if not f) if rope != "none" else (),
        sliding=sliding_window_layers(cfg) if spec.is_decoder else (),
        embed_scale=spec.embed_scale,
        attn_softcap=_get(cfg, "attn_logit_softcapping"),
        final_softcap=_get(cfg, "final_logit_softcapping"),
        parallel_block=spec.parallel_block or bool(spec.parallel_attr and _get(cfg, spec.parallel_attr)),
        tied=bool(_get(cfg, "tie_word_embeddings", True)),
        learned_positions=bool(spec.pos_embed) and (spec.rope_attr is None or rope == "none"),
        embed_projection=proj is not None and int(proj) != int(hidden),
    )


# Config entries outside the spec's own attribute names that fix the function of a given set of
# tensor shapes (activation, RoPE, attention scale).
_SHARED_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "head_dim",
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "hidden_act",
    "hidden_activation",
    "activation_function",
    "rope_parameters",
    "rope_theta",
    "partial_rotary_factor",
    "rotary_dim",
    "query_pre_attn_scalar",
)


def structural_config(config) -> dict:
    """What must agree for two checkpoints to be one architecture (matching, merging): the
    shape entries the family's spec reads, the entries above, and every structural fact except
    tying (a tied head may be untied by folding)."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    spec = spec_for_model_type(cfg.get("model_type"))
    names = (
        _SHARED_CONFIG_KEYS
        + spec.hidden_attr
        + spec.n_layers_attr
        + spec.heads_attr
        + spec.kv_heads_attr
        + spec.eps_attr
    )
    out = {k: cfg[k] for k in names if cfg.get(k) is not None}
    out.update({f"{k} (structure)": v for k, v in asdict(facts(cfg)).items() if k != "tied"})
    return out


# --------------------------------------------------------------------------- output families


@dataclass(frozen=True)
class Target:
    """A model family a conversion writes, and what it can express. Features that a config
    field switches on are read from the configuration class itself."""

    name: str
    config_class: Callable[[], type]
    norm: str = "rms"  # the norm the family builds: rms (Llama-like) or rms_noweight
    gated_ffn: bool = True  # Llama's gate/up/down MLP only
    learned_positions: bool = False
    rope_layouts: tuple[str, ...] = ("rotate_half", "none")
    fused: bool = True  # reads source layers through the adapter (fused projections split)
    rope_partial: bool = False  # RoPE on part of each head, through ``rope_parameters`` (GPT-NeoX's rotary)
    # (the RMS-decoder conversion re-pairs interleaved RoPE dims as rotate-half: actions.interleaved_to_half)

    @functools.cached_property
    def fields(self) -> frozenset[str]:
        try:
            return frozenset(self.config_class()().to_dict())
        except ImportError:
            return frozenset()

    @property
    def available(self) -> bool:
        return bool(self.fields)

    @property
    def qk_norm(self) -> bool:
        return "qk_norm" in self.fields

    @property
    def nope(self) -> bool:
        return "no_rope_layers" in self.fields

    @property
    def sliding(self) -> bool:
        return "layer_types" in self.fields or "sliding_window" in self.fields

    @property
    def partial_rotary(self) -> bool:
        return self.rope_partial or "partial_rotary_factor" in self.fields

    @property
    def parallel(self) -> bool:
        return "parallel_block" in self.fields


def _compressed():
    return CompressedLlamaConfig


def _farr():
    return FarrLlamaConfig


def _tpa():
    return TPAConfig


def _ln_decoder():
    return RMSDecoderConfig


COMPRESSED = Target("the compressed family", _compressed)
FARR = Target("the FaRR decoder family", _farr, fused=False)
TPA = Target("the TPA family", _tpa, rope_partial=True)  # to-tpa reads its source through the adapter
RMS_DECODER = Target(
    "the RMS-decoder family",
    _ln_decoder,
    norm="rms_noweight",
    gated_ffn=False,
    learned_positions=True,
    rope_layouts=("none", "rotate_half", "interleaved"),
    rope_partial=True,
)


# --------------------------------------------------------------------------- derivations

_NORM_NAMES = {"rms": "RMSNorm", "rms_1p": "RMSNorm with (1+γ)", "layer": "LayerNorm"}


def _qk_norm_text(f: Facts) -> str:
    return "per head" if f.qk_norm == "head" else "over all heads at once"


def _stream_reason(f: Facts) -> str | None:
    """Why the residual stream cannot be rotated at all (placement), or None."""
    if f.placement == "post":
        return f"{f.model_type} is post-LN: its LayerNorms act on the residual stream itself"
    if f.placement in ("sandwich", "output"):
        return f"{f.model_type} normalises each sublayer's output before the residual add"
    if f.embed_projection:
        return f"{f.model_type} projects embeddings to a different width around the layers (word_embed_proj_dim)"
    return None


def _target_reason(f: Facts, t: Target, *, needs_rotation: bool) -> str | None:
    """Why ``t`` cannot express a model with facts ``f`` (after the conversion), or None."""
    if not t.available:
        return f"{t.name} is not available in this installation"
    r = _stream_reason(f)
    if r and (needs_rotation or f.placement != "pre"):
        return r if needs_rotation else f"{r}, and {t.name} is pre-norm"
    if t.norm == "rms" and f.norm_kind == "layer":
        return f"{f.model_type} uses LayerNorm and {t.name} is RMSNorm-based"
    if f.embed_scale != "none":
        return f"{f.model_type} scales its embeddings by √hidden, which {t.name} does not"
    if f.attn_softcap or f.final_softcap:
        return f"{f.model_type} soft-caps logits, which {t.name} does not"
    if f.parallel_block and not t.parallel:
        return f"{f.model_type} runs attention and FFN in parallel, {t.name} sequentially"
    if f.gated and not t.gated_ffn:
        return f"{f.model_type} has a gated FFN and {t.name} an ungated one"
    if not f.gated and t.gated_ffn:
        return f"{f.model_type} has an ungated FFN and {t.name} a gated (Llama) one"
    if f.learned_positions and not t.learned_positions:
        return f"{f.model_type} uses learned position embeddings, which {t.name} does not have"
    if f.rope not in t.rope_layouts:
        return f"{f.model_type} uses {f.rope} rotary embeddings, which {t.name} does not implement"
    if f.partial_rotary and not t.partial_rotary:
        return f"{f.model_type} applies RoPE to part of each head, {t.name} to whole heads"
    if f.nope_layers and not t.nope:
        return f"{f.model_type} has layers without RoPE, which {t.name} does not express"
    if f.qk_norm and (not t.qk_norm or f.qk_norm == "all"):
        return f"{f.model_type} applies QK-norm {_qk_norm_text(f)}, which {t.name} does not implement"
    if f.sliding_layers and not t.sliding:
        return (
            f"{f.model_type} uses sliding-window attention on {len(f.sliding_layers)} of {len(f.sliding)} layers "
            f"(window {f.sliding[f.sliding_layers[0]]}) and {t.name} attends globally"
        )
    if (f.fused_qkv or f.fused_gate_up) and not t.fused:
        fused = " and ".join(n for n, on in (("q/k/v", f.fused_qkv), ("gate/up", f.fused_gate_up)) if on)
        return f"{f.model_type} fuses {fused} into one projection, which {t.name}'s conversion does not split yet"
    return None


def _residual(f: Facts) -> str | None:
    r = _stream_reason(f)
    if r:
        return r
    if f.norm_kind == "layer":
        # mean-centring every writer makes LayerNorm an RMSNorm without weight, written as a new family
        r = _target_reason(f, RMS_DECODER, needs_rotation=True)
        return None if r is None else f"rotating a LayerNorm model needs mean-centring into {RMS_DECODER.name}: " + r
    return None


def _scaling(f: Facts) -> str | None:
    if f.qk_norm:
        return (
            f"{f.model_type} applies QK-norm {_qk_norm_text(f)}, which divides a scale on q or k out again up to "
            "its ε: not an exact symmetry (VO scaling alone is)"
        )
    return None


def _qk_rotation(f: Facts) -> str | None:
    if f.qk_norm:
        return (
            f"{f.model_type} applies QK-norm {_qk_norm_text(f)}: its learned γ on q and k does not commute with "
            "head rotations (VO rotation is available)"
        )
    return None


def _farr(f: Facts, path: str) -> str | None:
    if f.decoder:
        r = _target_reason(f, FARR, needs_rotation=False)
        if r:
            return r
    elif f.placement != "post" or f.norm_kind != "layer":
        return f"{f.model_type}: FaRR writes pre-norm decoders and post-LN encoders"
    if path == "qk":
        if f.qk_norm:
            return f"{f.model_type} applies QK-norm, so W_Q W_Kᵀ is not a fixed bilinear map"
        if f.rope != "none" and not f.nope_layers:
            return (
                f"{f.model_type} applies RoPE to every query/key dim of every layer, so the score map has no "
                "position-free part to fuse"
            )
    return None


def _slicegpt(f: Facts) -> str | None:
    """SliceGPT writes the compressed family; LayerNorm decoders instead go through the RMS-decoder family
    (centred, then one global PCA rotation and a narrower ``residual_size``)."""
    if f.norm_kind != "layer" or not f.decoder:
        return _compress(f)
    r = _residual(f)
    if r is None and "residual_size" not in RMS_DECODER.fields:
        r = f"{RMS_DECODER.name} has no sliced residual stream"
    return r


def _tpa_key_rank(f: Facts) -> str | None:
    """to-tpa below full key rank mixes the KV heads' key maps (a head-mode reduction)."""
    if f.qk_norm:
        return (
            f"{f.model_type} applies QK-norm {_qk_norm_text(f)}, which does not commute with mixing key heads "
            "(reduce v_rank only, or keep k_rank = num_key_value_heads)"
        )
    return None


def _compress(f: Facts) -> str | None:
    """The compressed family; LayerNorm decoders instead go through the RMS-decoder family (centred, then
    its structured linears and orthogonal skips)."""
    if f.norm_kind == "layer" and f.decoder:
        r = _residual(f)
        if r is None and "layer_structures" not in RMS_DECODER.fields:
            r = f"{RMS_DECODER.name} has no structured linears"
        return r
    return _target_reason(f, COMPRESSED, needs_rotation=True)


_RULES: dict[str, Callable[[Facts], str | None]] = {
    "qk_rotation": _qk_rotation,
    "qk_scaling": _scaling,
    "vo_rotation": lambda f: None,  # V and O are linear around the attention weights
    "vo_scaling": lambda f: None,
    "ffn_permutation": lambda f: None,  # element-wise activations commute with permutations
    "residual_rotation": _residual,
    "scaling": _scaling,
    "match": lambda f: None,  # at least VO rotations and FFN permutations everywhere
    "merge": lambda f: None,
    "compress": _compress,
    "slicegpt": _slicegpt,
    "farr_vo": lambda f: _farr(f, "vo"),
    "farr_qk": lambda f: _farr(f, "qk"),
    "to_tpa": lambda f: _target_reason(f, TPA, needs_rotation=False),
    "to_tpa_key_rank": _tpa_key_rank,
}


def reason(obj, what: str) -> str | None:
    """None when ``what`` (a symmetry, ``scaling``, or a conversion) is allowed for ``obj``
    (adapter, config or spec), else the one-line structural reason."""
    if what not in _RULES:
        raise ValueError(f"unknown symmetry or conversion {what!r}; choose from {', '.join(_RULES)}")
    return _RULES[what](obj if isinstance(obj, Facts) else facts(obj))


def allows(obj, what: str) -> bool:
    return reason(obj, what) is None


def require(obj, what: str) -> None:
    """Raise :class:`UnsupportedSymmetry` naming the structural reason, before any work."""
    why = reason(obj, what)
    if why is not None:
        raise UnsupportedSymmetry(f"{LABELS[what]}: {why}")


# --------------------------------------------------------------------------- the table


def table_rows() -> list[tuple[str, dict[str, str | None]]]:
    """One row per supported model type (its transformers default config): column key -> reason or None."""
    rows = []
    for spec in SPECS:
        for model_type in spec.model_types:
            f = facts(CONFIG_MAPPING[model_type]())
            rows.append((model_type, {key: _RULES[key](f) for key, _ in COLUMNS}))
    return rows


def _cell(why: str | None, markdown: bool) -> str:
    if why is None:
        return "yes"
    return f"no: {why}".replace("|", "\\|") if markdown else f"no: {why}"


def families_markdown() -> str:
    """The family × conversion table as Markdown (the README's table is this text)."""
    head = "| model type | " + " | ".join(h for _, h in COLUMNS) + " |"
    sep = "|" + "---|" * (len(COLUMNS) + 1)
    lines = [head, sep]
    for model_type, cells in table_rows():
        lines.append(f"| {model_type} | " + " | ".join(_cell(cells[k], True) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def families_text(model_type: str | None = None) -> str:
    """The table for a terminal: one block per model type, one line per column."""
    out = []
    width = max(len(h) for _, h in COLUMNS)
    for mt, cells in table_rows():
        if model_type and mt != model_type:
            continue
        out.append(mt)
        out += [f"  {h:<{width}}  {_cell(cells[k], False)}" for k, h in COLUMNS]
    return "\n".join(out) + "\n"
