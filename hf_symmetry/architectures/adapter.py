"""Reads a checkpoint layer into the canonical form the symmetry engine works on, and back.

Canonical form: a dict of float64 tensors in ``nn.Linear`` orientation ``[out, in]``:

* attention ``q.weight k.weight v.weight o.weight`` (+ ``.bias`` where the checkpoint has one),
  and ``q_norm.weight``/``k_norm.weight`` for QK-norm families;
* FFN ``up.weight down.weight`` and ``gate.weight`` for gated FFNs (+ biases);
* norms ``attn_norm.weight ffn_norm.weight`` (+ ``.bias`` for LayerNorm), always as the plain
  multiplier γ: Gemma's ``(1 + w)`` norms are read as ``γ = 1 + w`` and written back as ``γ - 1``.

Globals use ``embed.weight``, ``pos{j}.weight`` (learned position/token-type embeddings),
``embed_norm.*``, ``final_norm.*`` and ``lm_head.weight``/``.bias``.

Conv1D transposition and the splitting of fused projections (``[q | k | v]`` blocks, GPT-NeoX's
per-head ``[q_h k_h v_h]``, Phi-3's ``[gate | up]``) happen only here, so the math never sees them.
Canonical tensors are always fresh copies: callers own them and may update them in place.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from ..symmetry.layout import HeadLayout
from .capabilities import SYMMETRIES, require
from .spec import ArchSpec, spec_for_model_type

Tensors = dict[str, torch.Tensor]


def _cfg_get(config, names: tuple[str, ...], default=None):
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def _rotary_dim(config, head_dim: int) -> int:
    rope = _cfg_get(config, ("rope_parameters", "rope_scaling")) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = factor if factor is not None else _cfg_get(config, ("partial_rotary_factor",), 1.0)
    explicit = _cfg_get(config, ("rotary_dim",))  # GPT-J names the rotary width directly
    return int(explicit) if explicit is not None else int(head_dim * factor)


@dataclass
class Adapter:
    spec: ArchSpec
    config: object  # PretrainedConfig or dict
    prefix: str  # e.g. "" or "bert."
    layout: HeadLayout
    n_layers: int
    hidden: int
    head: str | None = None  # the head's module name in this checkpoint (spec.lm_head or one of its aliases)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, config, keys: list[str] | None = None) -> "Adapter":
        model_type = _cfg_get(config, ("model_type",))
        spec = spec_for_model_type(model_type)
        hidden = _cfg_get(config, spec.hidden_attr)
        n_heads = _cfg_get(config, spec.heads_attr)
        n_kv = _cfg_get(config, spec.kv_heads_attr, n_heads) if spec.kv_heads_attr else n_heads
        head_dim = _cfg_get(config, ("head_dim",)) or hidden // n_heads
        rope = spec.rope_in(config)
        rotary_dim = _rotary_dim(config, head_dim) if rope != "none" else 0
        layout = HeadLayout(
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_layout=rope if rotary_dim else "none",
            qk_norm=spec.attention.qk_norm is not None,
        )
        prefix = cls._detect_prefix(spec, keys) if keys is not None else spec.base_prefixes[0]
        head = spec.lm_head
        if keys is not None and spec.lm_head_aliases and f"{head}.weight" not in set(keys):
            head = next((a for a in spec.lm_head_aliases if f"{a}.weight" in set(keys)), head)
        return cls(spec, config, prefix, layout, _cfg_get(config, spec.n_layers_attr), hidden, head)

    @staticmethod
    def _detect_prefix(spec: ArchSpec, keys: list[str]) -> str:
        keyset = set(keys)
        for prefix in spec.base_prefixes:
            if f"{prefix}{spec.embed}.weight" in keyset:
                return prefix
        raise ValueError(f"checkpoint does not look like a {spec.family} model: no '{spec.embed}.weight' tensor")

    # ---------------------------------------------------------------- facts
    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def eps(self) -> float:
        return float(_cfg_get(self.config, self.spec.eps_attr, 1e-5)) if self.spec.eps_attr else 1e-5

    @property
    def tied_embeddings(self) -> bool:
        return bool(_cfg_get(self.config, ("tie_word_embeddings",), True))

    def layer_layout(self, i: int) -> HeadLayout:
        """Layer ``i``'s head layout: the model's, except on NoPE layers (SmolLM3, Llama 4:
        ``no_rope_layers[i] == 0``), whose query/key dims RoPE leaves alone. The model-wide
        ``layout`` stays valid on NoPE layers for every symmetry (its RoPE commutant is a subgroup of
        what they allow); per-layer consumers such as FaRR use this one."""
        flags = _cfg_get(self.config, ("no_rope_layers",))
        if flags is None or self.layout.rope_layout == "none" or flags[i]:
            return self.layout
        return dataclasses.replace(self.layout, rotary_dim=0, rope_layout="none")

    def layer_prefix(self, i: int) -> str:
        return f"{self.prefix}{self.spec.layers}.{i}."

    def layer_of(self, key: str) -> int | None:
        m = re.match(re.escape(f"{self.prefix}{self.spec.layers}.") + r"(\d+)\.", key)
        return int(m.group(1)) if m else None

    # ---------------------------------------------------------------- refusals
    def check_supports(self, symmetry: str) -> None:
        """Raise :class:`~.capabilities.UnsupportedSymmetry` (with the structural reason) when
        ``symmetry`` is not one of this checkpoint's; see :mod:`hf_symmetry.architectures.capabilities`.

        ``symmetry`` is one of ``qk_rotation``, ``qk_scaling``, ``vo_rotation``, ``vo_scaling``,
        ``ffn_permutation``, ``residual_rotation``."""
        if symmetry not in SYMMETRIES:
            raise ValueError(f"unknown symmetry {symmetry!r}")
        require(self, symmetry)

    # ---------------------------------------------------------------- layer I/O
    def _layer_names(self) -> dict[str, str]:
        """canonical module name -> checkpoint module name (relative to the layer prefix)."""
        a, f, s = self.spec.attention, self.spec.ffn, self.spec
        names = {"o": a.o, "down": f.down, "attn_norm": s.attn_norm.name, "ffn_norm": s.ffn_norm.name}
        if f.up:
            names["up"] = f.up
        if a.qkv is None:
            names.update(q=a.q, k=a.k, v=a.v)
        if f.gate:
            names["gate"] = f.gate
        if a.qk_norm:
            names.update(q_norm=a.qk_norm[0], k_norm=a.qk_norm[1])
        return names

    def _is_linear(self, canon: str) -> bool:
        return canon in ("q", "k", "v", "o", "up", "down", "gate")

    def modeled_layer_keys(self, i: int) -> set[str]:
        """Checkpoint keys of layer ``i`` that the canonical form covers (others pass through)."""
        p = self.layer_prefix(i)
        fused = [n for n in (self.spec.attention.qkv, self.spec.ffn.gate_up) if n]
        names = list(self._layer_names().values()) + fused
        return {f"{p}{n}.{param}" for n in names for param in ("weight", "bias")}

    def layer_keys_of(self, i: int, modules: set[str]) -> set[str]:
        """Checkpoint keys (weight and bias, where present) of layer ``i`` that hold the canonical
        modules ``modules`` (e.g. ``{"gate", "up"}``; a fused qkv or gate_up tensor for any of its
        parts), for readers that take a layer one group of tensors at a time."""
        p, spec = self.layer_prefix(i), self.spec
        names = [n for c, n in self._layer_names().items() if c in modules]
        if spec.attention.qkv and modules & {"q", "k", "v"}:
            names.append(spec.attention.qkv)
        if spec.ffn.gate_up and modules & {"gate", "up"}:
            names.append(spec.ffn.gate_up)
        return {f"{p}{n}.{param}" for n in names for param in ("weight", "bias")}

    def read_layer(
        self,
        i: int,
        tensors: Tensors,
        dtype: torch.dtype | None = torch.float64,
        norm_dtype: torch.dtype | None = None,
        partial: bool = False,
    ) -> Tensors:
        """Canonical float64 view of layer ``i`` from its checkpoint tensors (owned copies; ``dtype=None``:
        each tensor's own dtype, for tensors a conversion passes through unchanged). ``norm_dtype``: the
        norms' dtype instead (e.g. float64 norms beside matrices in their own dtype: a ``γ − 1`` norm is
        then made ``γ`` exactly). ``partial``: ``tensors`` holds only some of the layer's tensors
        (:meth:`canonical_sources`); only what they give is returned."""
        p = self.layer_prefix(i)
        out: Tensors = {}
        for canon, name in self._layer_names().items():
            want = norm_dtype if (norm_dtype is not None and not self._is_linear(canon)) else dtype
            for param in ("weight", "bias"):
                t = tensors.get(f"{p}{name}.{param}")
                if t is None:
                    continue
                t = t.to(want or t.dtype, copy=True)
                if param == "weight" and self.spec.conv1d and self._is_linear(canon):
                    t = t.T
                if param == "weight" and self._one_plus(canon):
                    t = t + 1.0
                out[f"{canon}.{param}"] = t.contiguous()
        if self.spec.attention.qkv and not (partial and f"{p}{self.spec.attention.qkv}.weight" not in tensors):
            self._split_qkv(tensors, p, out, dtype)
        if self.spec.ffn.gate_up:
            self._split_gate_up(tensors, p, out, dtype)
        missing = [
            k for k in ("q.weight", "k.weight", "v.weight", "o.weight", "up.weight", "down.weight") if k not in out
        ]
        if missing and not partial:
            raise ValueError(f"layer {i}: checkpoint lacks tensors for {missing} (prefix {p!r})")
        return out

    def canonical_sources(self, i: int, keys) -> dict[str, list[str]]:
        """Canonical module name (``q``, ``gate``, ``attn_norm``, …) -> the checkpoint keys of layer ``i``
        it is read from (weight, bias; a fused qkv or gate_up tensor serves each of its parts), so that
        :meth:`read_layer` with ``partial=True`` can read one module at a time."""
        p, keyset = self.layer_prefix(i), set(keys)

        def present(name: str) -> list[str]:
            return [f"{p}{name}.{param}" for param in ("weight", "bias") if f"{p}{name}.{param}" in keyset]

        out = {c: present(n) for c, n in self._layer_names().items() if n}
        if self.spec.attention.qkv:
            out.update({c: present(self.spec.attention.qkv) for c in "qkv"})
        if self.spec.ffn.gate_up:
            out.update({c: present(self.spec.ffn.gate_up) for c in ("gate", "up")})
        return {c: ks for c, ks in out.items() if ks}

    def _one_plus(self, canon: str) -> bool:
        """Norm weights stored as ``γ - 1`` (Gemma): every RMSNorm of an ``rms_1p`` family."""
        return self.spec.norm_kind == "rms_1p" and canon in ("attn_norm", "ffn_norm", "q_norm", "k_norm", "final_norm")

    def _qkv_parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Rows of a fused qkv weight (or bias) as [q, k, v]."""
        L = self.layout
        if self.spec.attention.qkv_layout == "per_head":  # [q_h k_h v_h] for each head h
            per_head = t.reshape(L.n_heads, 3, L.head_dim, *t.shape[1:])
            return [per_head[:, j].reshape(L.n_heads * L.head_dim, *t.shape[1:]) for j in range(3)]
        sizes = [L.n_heads * L.head_dim, L.n_kv_heads * L.head_dim, L.n_kv_heads * L.head_dim]
        return list(torch.split(t, sizes, dim=0))

    def _join_qkv(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.spec.attention.qkv_layout == "per_head":
            L = self.layout
            stacked = torch.stack([q.reshape(L.n_heads, L.head_dim, *q.shape[1:]) for q in parts], dim=1)
            return stacked.reshape(3 * L.n_heads * L.head_dim, *parts[0].shape[1:])
        return torch.cat(parts, dim=0)

    def _split_qkv(self, tensors: Tensors, p: str, out: Tensors, dtype: torch.dtype | None = torch.float64) -> None:
        name = self.spec.attention.qkv
        w = tensors[f"{p}{name}.weight"]
        w = w.to(dtype or w.dtype, copy=True)
        w = w.T if self.spec.conv1d else w
        for canon, part in zip("qkv", self._qkv_parts(w)):
            out[f"{canon}.weight"] = part.contiguous()
        b = tensors.get(f"{p}{name}.bias")
        if b is not None:
            for canon, part in zip("qkv", self._qkv_parts(b.to(dtype or b.dtype, copy=True))):
                out[f"{canon}.bias"] = part.contiguous()

    def _split_gate_up(self, tensors: Tensors, p: str, out: Tensors, dtype: torch.dtype | None = torch.float64) -> None:
        name = self.spec.ffn.gate_up
        for param in ("weight", "bias"):
            t = tensors.get(f"{p}{name}.{param}")
            if t is not None:
                gate, up = t.to(dtype or t.dtype, copy=True).chunk(2, dim=0)
                out[f"gate.{param}"], out[f"up.{param}"] = gate.contiguous(), up.contiguous()

    def write_layer(self, i: int, canon: Tensors, like: dict) -> Tensors:
        """Checkpoint tensors of layer ``i`` from canonical ones, each cast to the dtype of the
        tensor it replaces in ``like`` (the layer as read, or just its dtypes)."""
        p = self.layer_prefix(i)
        out: Tensors = {}
        for cname, name in self._layer_names().items():
            for param in ("weight", "bias"):
                t = canon.get(f"{cname}.{param}")
                if t is None:
                    continue
                if param == "weight" and self.spec.conv1d and self._is_linear(cname):
                    t = t.T
                if param == "weight" and self._one_plus(cname):
                    t = t - 1.0
                key = f"{p}{name}.{param}"
                t = t.to(_dtype_of(like[key]) if key in like else self._dtype(like)).contiguous()
                if key in out and not torch.equal(out[key], t):  # one norm read under two names
                    raise ValueError(f"layer {i}: {key} would be written with two different values")
                out[key] = t
        qkv = self.spec.attention.qkv
        if qkv:
            key = f"{p}{qkv}.weight"
            w = self._join_qkv([canon["q.weight"], canon["k.weight"], canon["v.weight"]])
            out[key] = (w.T if self.spec.conv1d else w).to(_dtype_of(like[key])).contiguous()
            if "q.bias" in canon:
                key = f"{p}{qkv}.bias"
                out[key] = (
                    self._join_qkv([canon["q.bias"], canon["k.bias"], canon["v.bias"]])
                    .to(_dtype_of(like[key]))
                    .contiguous()
                )
        gate_up = self.spec.ffn.gate_up
        if gate_up:
            for param in ("weight", "bias"):
                if f"gate.{param}" in canon:
                    key = f"{p}{gate_up}.{param}"
                    t = torch.cat([canon[f"gate.{param}"], canon[f"up.{param}"]], dim=0)
                    out[key] = t.to(_dtype_of(like[key]) if key in like else self._dtype(like)).contiguous()
        return out

    @staticmethod
    def _dtype(like: dict) -> torch.dtype:
        return _dtype_of(next(iter(like.values()))) if like else torch.float32

    # ---------------------------------------------------------------- calibration sites
    def site_modules(self) -> dict[str, tuple[str, str]]:
        """Calibration site -> ``(module path inside a decoder layer, "in" | "out")``: whose input
        or output the site's activations are (see :mod:`hf_symmetry.calibration.statistics`)."""
        a, f = self.spec.attention, self.spec.ffn
        sites = {
            "attn_in": (a.qkv or a.q, "in"),
            "v_in": (a.v or a.qkv, "in"),
            "o_in": (a.o, "in"),
            "ffn_norm_in": (self.spec.ffn_norm.name, "in"),
            "ffn_in": (f.up or f.gate_up, "in"),
            "down_in": (f.down, "in"),
        }
        if a.qkv is None:
            sites.update(q_out=(a.q, "out"), k_out=(a.k, "out"), v_out=(a.v, "out"))
        return sites

    def input_global_keys(self, keys: list[str]) -> list[str]:
        """Checkpoint keys of what runs before the first layer (token/position embeddings and
        their norm): all the calibration engine reads besides one layer at a time."""
        names = {n for c, n in self._global_names().items() if c not in ("final_norm", "lm_head")}
        return [k for k in keys if k.rsplit(".", 1)[0] in names]

    def final_norm_keys(self, keys: list[str]) -> list[str]:
        """Checkpoint keys of the final norm (empty for families without one)."""
        name = self._global_names().get("final_norm")
        return [k for k in keys if name and k.rsplit(".", 1)[0] == name]

    # ---------------------------------------------------------------- globals I/O
    def _global_names(self) -> dict[str, str]:
        s, p = self.spec, self.prefix
        names = {"embed": p + s.embed}
        for j, name in enumerate(s.pos_embed):
            names[f"pos{j}"] = p + name
        if s.embed_norm:
            names["embed_norm"] = p + s.embed_norm
        if s.final_norm:
            names["final_norm"] = p + s.final_norm
        if s.lm_head:
            names["lm_head"] = self.head or s.lm_head  # heads live outside the base-model prefix
        return names

    def global_keys(self, keys: list[str]) -> list[str]:
        wanted = {f"{n}.{k}" for n in self._global_names().values() for k in ("weight", "bias")}
        return [k for k in keys if k in wanted]

    def read_globals(self, tensors: Tensors, dtype: torch.dtype | None = torch.float64, copy: bool = True) -> Tensors:
        """Canonical globals: owned copies in ``dtype`` (``None``: each tensor's own dtype, for
        callers that compute on vocabulary-sized matrices a block of rows at a time). ``copy=False``
        with ``dtype=None``: the tensors themselves where no conversion changes them (pass-through)."""
        out: Tensors = {}
        for canon, name in self._global_names().items():
            for param in ("weight", "bias"):
                t = tensors.get(f"{name}.{param}")
                if t is not None:
                    t = t.to(dtype or t.dtype, copy=copy)
                    out[f"{canon}.{param}"] = t + 1.0 if param == "weight" and self._one_plus(canon) else t
        return out

    def write_globals(self, canon: Tensors, like: dict) -> Tensors:
        """Checkpoint tensors from canonical globals (any subset), cast like ``like`` (the
        tensors as read, or their dtypes)."""
        out: Tensors = {}
        embed_key = f"{self._global_names()['embed']}.weight"
        default = _dtype_of(like[embed_key] if embed_key in like else next(iter(like.values()), torch.float32))
        for cname, name in self._global_names().items():
            for param in ("weight", "bias"):
                t = canon.get(f"{cname}.{param}")
                if t is not None:
                    key = f"{name}.{param}"
                    t = t - 1.0 if param == "weight" and self._one_plus(cname) else t
                    out[key] = t.to(_dtype_of(like[key]) if key in like else default).contiguous()
        return out


def _dtype_of(t) -> torch.dtype:
    return t if isinstance(t, torch.dtype) else t.dtype


def adapter_for(config, keys: list[str] | None = None) -> Adapter:
    return Adapter.from_config(config, keys)
