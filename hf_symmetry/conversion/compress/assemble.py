"""Step 4, assembly: the compressed model's tensors and config from the solved rotations and factors: the
norm-folded dense matrices rotated into (and sliced to) their segments' bases, structured factors in place
of the compressed ones, written part by part as the solver finishes them (:class:`Assembler`)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...checkpoint_io import RowBlocks
from ...modeling import modeling_compressed_llama as family
from ...modeling.configuration_compressed_llama import CompressedLlamaConfig
from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM
from ...solvers import structures as st
from ...solvers.segments import cayley_encode
from ..layer_map import LayerMapRecorder
from ..stream import DictSink, TensorSink
from .folded import FoldedLayers, global_row_blocks
from .options import LAYER_MODULES, CompressOptions
from .plan import MatrixPlan, Plan
from .solve import Kept

Tensors = dict[str, torch.Tensor]


def module_tensors(m: MatrixPlan, factors: st.Factors) -> Tensors:
    """Matrix ``m``'s factors (M orientation) -> its module's parameters (``[out, in]`` orientation)."""
    f = factors if m.module_structure is m.structure else m.structure.transpose_factors(factors)
    return m.module_structure.module_tensors(f)


def _rotated_rows(globals_, key: str, Q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W Q`` for the global ``key`` (embedding, head) in ``dtype``, computed a block of rows at a time."""
    n, blocks = global_row_blocks(globals_, key)
    out = torch.empty(n, Q.shape[1], dtype=dtype)
    for i, block in blocks:
        out[i : i + len(block)] = block @ Q
    return out


class Assembler:
    """The compressed model's tensors in ``dtype``, handed to ``sink`` part by part: the embedding once segment 0
    is solved, layer i once segments 2i to 2i + 2 are, the head once the last one is, and what is left at the
    end (:meth:`finish`); each part's factors are dropped once written. A sink whose class sets ``row_blocks =
    True`` is handed vocabulary-sized row factors as :class:`...checkpoint_io.RowBlocks`, any other whole tensors."""

    def __init__(
        self, plan: Plan, layers, globals_, gamma: torch.Tensor, dtype: torch.dtype, sink: TensorSink | None = None
    ):
        self.plan, self.layers, self.globals = plan, layers, globals_
        self.gamma, self.dtype, self.sink = gamma, dtype, DictSink() if sink is None else sink
        self.done: set = set()  # "embed", "head", layer indices
        self.written: set = set()  # names of the layer matrices written
        # how each decoder layer's output relates to the original's (read by ``heal``)
        self.layer_map = LayerMapRecorder(plan.n_layers, plan.hidden, "compress")

    def put(self, prefix: str, tensors: Tensors) -> None:
        """Cast and hand on one module's tensors."""
        made = {
            f"{prefix}.{k}": v.to(self.dtype) if isinstance(v, RowBlocks) else v.to(self.dtype).contiguous()
            for k, v in tensors.items()
        }
        if not getattr(type(self.sink), "row_blocks", False):
            made = {k: v.materialise() if isinstance(v, RowBlocks) else v for k, v in made.items()}
        self.sink.add(made)

    def _basis(self, Qs, segment: int) -> torch.Tensor:
        """The kept columns of segment ``segment``'s rotation."""
        return Qs[segment][:, : self.plan.width(segment)]

    def _global(self, m: MatrixPlan, Qs, factors: dict) -> Tensors:
        """The embedding's or head's module: its factors, or its rows rotated into its segment's basis."""
        if m.compressed:
            return module_tensors(m, factors.pop(m.name))
        return {"weight": _rotated_rows(self.globals, f"{m.canon}.weight", self._basis(Qs, m.segment), self.dtype)}

    def embed(self, Qs, factors: dict) -> None:
        self.put(family.EMBED_MODULE, self._global(self.plan.by_name()["embed"], Qs, factors))
        self.done.add("embed")

    def matrix(self, m: MatrixPlan, Qs, factors: dict) -> None:
        """Layer matrix ``m``'s module: its factors, or the dense matrix rotated into (and sliced to) its
        segment's basis (readers ``W Q``, writers ``Qᵀ W``), with its bias."""
        W = self.layers[m.layer]
        Q = self._basis(Qs, m.segment)
        if m.compressed:
            tensors = module_tensors(m, factors.pop(m.name))
        else:
            w = W[f"{m.canon}.weight"]
            tensors = {"weight": w @ Q if m.role == "reader" else Q.T @ w}
        bias = W.get(f"{m.canon}.bias")
        if bias is not None:
            tensors["bias"] = bias if m.role == "reader" else Q.T @ bias
        self.put(family.LAYER_PREFIX.format(m.layer) + LAYER_MODULES[m.canon][0], tensors)
        self.written.add(m.name)

    def layer(self, i: int, Qs, factors: dict) -> None:
        """Decoder layer ``i``: its matrices not yet written, its QK norms and its two skip connections."""
        plan, W = self.plan, self.layers[i]
        prefix = family.LAYER_PREFIX.format(i)
        for m in plan.layer_matrices(i).values():
            if m.name not in self.written:
                self.matrix(m, Qs, factors)
        for canon, path in family.QK_NORM_MODULES.items():  # QK-norm: on the heads, untouched by the stream's rotations
            if f"{canon}.weight" in W:
                self.put(prefix + path, {"weight": W[f"{canon}.weight"]})
        dr = plan.residual
        for name, (a, b) in (("attn_skip", (2 * i, 2 * i + 1)), ("mlp_skip", (2 * i + 1, 2 * i + 2))):
            self.skip(prefix + name, Qs[a][:, :dr].T @ Qs[b][:, :dr])
        self.layer_map.add(i, Qs[2 * i + 2], plan.width(2 * i + 2))  # layer i writes segment 2i + 2
        self.done.add(i)

    def skip(self, prefix: str, S: torch.Tensor) -> None:
        """A skip connection's matrix ``S``, as the plan's ``skip`` writes it (orthogonal: by its Cayley
        encoding, checked to decode to ``S``)."""
        if self.plan.skip == "dense":
            self.put(prefix, {"weight": S.T})
        elif self.plan.skip == "orthogonal":
            k, signs = cayley_encode(S)
            err = (family.cayley_decode(k, signs) - S).abs().max().item()
            if err > 1e-8:
                raise RuntimeError(f"{prefix}: Cayley encoding of the skip rotation is inaccurate ({err:.1e})")
            self.put(prefix, {"skip_k": k, "skip_signs": signs})

    def head(self, Qs, factors: dict) -> None:
        plan, L = self.plan, self.plan.n_layers
        if plan.lm_head == "separate":
            self.put(family.LM_HEAD_MODULE, self._global(plan.by_name()["lm_head"], Qs, factors))
        elif plan.lm_head == "tied_mixed":
            # logits = RMSNorm(s) M Êᵀ
            M = self._basis(Qs, 2 * L).T @ (self.gamma[:, None] * self._basis(Qs, 0))
            self.put(family.HEAD_MIX_MODULE, {"weight": M.T})
        self.done.add("head")

    def segment_done(self, k: int, Qs: list, factors: dict) -> None:
        """Segments ``j ≤ k`` are final: write what they complete, and drop from ``Qs`` the rotations no later
        part reads (a ``[d, d]`` float64 rotation per segment would grow with depth, 19 MB at d = 1536)."""
        if k == 0:
            self.embed(Qs, factors)
        # the layer matrices of segment k at once (their factors need not wait for the layer's last segment)
        for m in self.plan.matrices:
            if m.segment == k and m.layer is not None and m.name not in self.written:
                self.matrix(m, Qs, factors)
        if k >= 2 and k % 2 == 0:
            i = k // 2 - 1
            self.layer(i, Qs, factors)
            if isinstance(self.layers, FoldedLayers):
                self.layers.drop(i)
            for j in (2 * i, 2 * i + 1):  # read by layer i only (and segment 0 by a tied, mixed head)
                if not (j == 0 and self.plan.lm_head == "tied_mixed"):
                    Qs[j] = None
        if k == self.plan.n_segments - 1:
            self.head(Qs, factors)

    def finish(self, res: Kept, progress: bool = True) -> TensorSink:
        """Write everything not yet written (consuming ``res.factors``); the sink."""
        if "embed" not in self.done:
            self.embed(res.Qs, res.factors)
        todo = [i for i in range(self.plan.n_layers) if i not in self.done]
        for i in tqdm(todo, desc="assemble", unit="layer", disable=not progress or not todo):
            self.layer(i, res.Qs, res.factors)
        if "head" not in self.done:
            self.head(res.Qs, res.factors)
        return self.sink


def structure_entries(plan: Plan, options: CompressOptions, source_model_type: str | None) -> dict:
    """The config entries both compressed families share: each module's structure (with its bias), the skip
    connections and the ``compression`` record."""
    ms = plan.by_name()

    def entry(m: MatrixPlan) -> dict:
        return {**m.module_structure.entry(), "bias": m.bias}

    return {
        "skip_connections": plan.skip,
        "layer_structures": [
            {LAYER_MODULES[c][0].split(".")[1]: entry(m) for c, m in plan.layer_matrices(i).items()}
            for i in range(plan.n_layers)
        ],
        "embed_structure": entry(ms["embed"]),
        "lm_head_structure": entry(ms["lm_head"]) if "lm_head" in ms else None,
        "compression": {
            "method": options.method,
            "label": options.label,
            "structure": options.structure_name,
            "stage": options.stage,
            "q_mode": options.q_mode,
            "ratio": options.ratio,
            "ratio_over_compressed": plan.accounting.ratio_over_compressed,
            "ratio_over_model": plan.accounting.ratio_over_model,
            "source_model_type": source_model_type,
        },
    }


def compressed_config(config: dict, plan: Plan, options: CompressOptions, hf_config=None) -> dict:
    """Config dict of the ``hf_symmetry_compressed_llama`` model."""
    rope = getattr(hf_config, "rope_parameters", None) if hf_config is not None else config.get("rope_parameters")
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}
    L = Adapter.from_config(config).layout
    return {
        "architectures": ["CompressedLlamaForCausalLM"],
        "model_type": CompressedLlamaConfig.model_type,
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": plan.hidden,
        "residual_size": plan.residual,
        **({"residual_sizes": list(plan.residual_sizes)} if plan.residual_sizes is not None else {}),
        "intermediate_size": int(config["intermediate_size"]),
        "num_hidden_layers": plan.n_layers,
        "num_attention_heads": L.n_heads,
        "num_key_value_heads": L.n_kv_heads,
        "head_dim": L.head_dim,
        "hidden_act": config.get("hidden_act", "silu"),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "initializer_range": float(config.get("initializer_range", 0.02)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        **{k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "attention_dropout": float(config.get("attention_dropout", 0.0) or 0.0),
        "rope_parameters": dict(rope),
        "lm_head": plan.lm_head,
        "qk_norm": L.qk_norm,
        **structure_entries(plan, options, config.get("model_type")),
    }


def config_object(config: dict):
    """The :class:`CompressedLlamaConfig` of a :func:`compressed_config` dict."""
    cfg = CompressedLlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    cfg.architectures = ["CompressedLlamaForCausalLM"]
    return cfg


def build_model(state: Tensors, config: dict, dtype: torch.dtype = torch.float32):
    """A :class:`CompressedLlamaForCausalLM` holding ``state``, and its counted parameters (:func:`loaded`)."""
    return loaded(CompressedLlamaForCausalLM(config_object(config)).to(dtype), state)


def loaded(model, state: Tensors):
    """``model`` holding ``state`` (every parameter accounted for), in eval mode, and its counted parameters
    (with the ±1 signs of orthogonal skips)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"compressed state does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs")
    )
    return model.eval(), counted
