"""Step 4, assembly: the compressed model's tensors and config from the solved rotations and factors.

Norms folded (read on demand: :mod:`.folded`), each dense matrix rotated into (and sliced to) its
segments' bases, structured factors in place of the compressed matrices: a
:class:`CompressedLlamaForCausalLM`, written part by part as the solver finishes it (:class:`Assembler`)."""

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
    """Matrix ``m``'s factors (M orientation) -> the parameters of its module of
    ``modeling_compressed_llama`` (``[out, in]`` orientation: :meth:`.Structure.module_tensors`)."""
    f = factors if m.module_structure is m.structure else m.structure.transpose_factors(factors)
    return m.module_structure.module_tensors(f)


def _rotated_rows(globals_, key: str, Q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W Q`` for the norm-folded global ``key`` (embedding, head), rounded to ``dtype``, computed in
    float64 a block of rows at a time (a vocabulary-sized matrix is never in memory whole in float64)."""
    n, blocks = global_row_blocks(globals_, key)
    out = torch.empty(n, Q.shape[1], dtype=dtype)
    for i, block in blocks:
        out[i : i + len(block)] = block @ Q
    return out


class Assembler:
    """The compressed model's tensors (cast to ``dtype``), part by part: the embedding once segment 0
    is solved, decoder layer i once segments 2i, 2i + 1 and 2i + 2 are, the head once the last one is
    (:meth:`segment_done`, for solvers that finish the segments in order; each part's factors are
    dropped once written), and whatever is left at the end (:meth:`finish`). Dense matrices are
    rotated and sliced one matrix at a time from the norm-folded layers and globals (the vocabulary-sized
    ones a block of rows at a time). ``sink`` (a :class:`..stream.TensorSink`, e.g. a
    :class:`..stream.DictSink`) receives each module's tensors as they are made (``sink.add``); a sink whose
    class sets ``row_blocks = True`` (:class:`.routes.CountingSink`) is handed vocabulary-sized row factors
    as :class:`...checkpoint_io.RowBlocks` (the shard writer streams them), any other gets whole tensors."""

    def __init__(self, plan: Plan, layers, globals_, gamma: torch.Tensor, dtype: torch.dtype, sink: TensorSink):
        self.plan, self.layers, self.globals = plan, layers, globals_
        self.gamma, self.dtype, self.sink = gamma, dtype, sink
        self.done: set = set()  # "embed", "head", layer indices
        self.written: set = set()  # names of the layer matrices written

        # how each decoder layer's output relates to the original's (read by ``heal``)
        self.layer_map = LayerMapRecorder(plan.n_layers, plan.hidden, "compress")

    def put(self, prefix: str, tensors: Tensors) -> None:
        """Cast and hand on one module's tensors (a :class:`...checkpoint_io.RowBlocks` factor is streamed
        into a sink that takes row blocks, else made whole)."""
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

    def _global(self, m: MatrixPlan, key: str, Qs, factors: dict, consume: bool) -> Tensors:
        if m.compressed:
            f = factors.pop(m.name) if consume else factors[m.name]
            return module_tensors(m, f)
        return {"weight": _rotated_rows(self.globals, key, self._basis(Qs, m.segment), self.dtype)}

    def embed(self, Qs, factors: dict, consume: bool = False) -> None:
        self.put(family.EMBED_MODULE, self._global(self.plan.by_name()["embed"], "embed.weight", Qs, factors, consume))
        self.done.add("embed")

    def matrix(self, m: MatrixPlan, Qs, factors: dict, consume: bool = False) -> None:
        """Layer matrix ``m``'s module: its factors, or the dense matrix rotated into (and sliced to) its
        segment's basis (readers ``W Q``, writers ``Qᵀ W``), with its bias. Needs only its own
        segment's rotation."""
        W = self.layers[m.layer]
        Q = self._basis(Qs, m.segment)
        if m.compressed:
            f = factors.pop(m.name) if consume else factors[m.name]
            tensors = module_tensors(m, f)
        else:
            w = W[f"{m.canon}.weight"]
            tensors = {"weight": w @ Q if m.role == "reader" else Q.T @ w}
        bias = W.get(f"{m.canon}.bias")
        if bias is not None:
            tensors["bias"] = bias if m.role == "reader" else Q.T @ bias
        self.put(family.LAYER_PREFIX.format(m.layer) + LAYER_MODULES[m.canon][0], tensors)
        self.written.add(m.name)

    def layer(self, i: int, Qs, factors: dict, consume: bool = False) -> None:
        """Decoder layer ``i``: its matrices not yet written (:meth:`matrix`), its QK norms and its
        two skip connections (which need both rotations around them)."""
        plan, W = self.plan, self.layers[i]
        prefix = family.LAYER_PREFIX.format(i)
        for m in plan.layer_matrices(i).values():
            if m.name not in self.written:
                self.matrix(m, Qs, factors, consume)
        for canon, path in family.QK_NORM_MODULES.items():  # QK-norm: on the heads, untouched by the stream's rotations
            if f"{canon}.weight" in W:
                self.put(prefix + path, {"weight": W[f"{canon}.weight"]})
        dr = plan.residual
        for name, (a, b) in (("attn_skip", (2 * i, 2 * i + 1)), ("mlp_skip", (2 * i + 1, 2 * i + 2))):
            _SKIP_TENSORS[plan.skip](self.put, prefix + name, Qs[a][:, :dr].T @ Qs[b][:, :dr])
        self.layer_map.add(i, Qs[2 * i + 2], plan.width(2 * i + 2))  # layer i writes segment 2i + 2
        self.done.add(i)

    def head(self, Qs, factors: dict, consume: bool = False) -> None:
        plan, L = self.plan, self.plan.n_layers
        if plan.lm_head == "separate":
            self.put(
                family.LM_HEAD_MODULE, self._global(plan.by_name()["lm_head"], "lm_head.weight", Qs, factors, consume)
            )
        elif plan.lm_head == "tied_mixed":
            # logits = RMSNorm(s) M Êᵀ
            M = self._basis(Qs, 2 * L).T @ (self.gamma[:, None] * self._basis(Qs, 0))
            self.put(family.HEAD_MIX_MODULE, {"weight": M.T})
        self.done.add("head")

    def segment_done(self, k: int, Qs: list, factors: dict) -> None:
        """Segment ``k``'s rotation and factors are final (``Qs[j]`` and the factors of every segment
        ``j ≤ k`` are): write what they complete, and drop its factors from ``factors`` and the
        rotations no later part reads from ``Qs`` (set to ``None``: a ``[d, d]`` float64 rotation per
        segment would otherwise grow with depth, 19 MB each at d = 1536)."""
        if k == 0:
            self.embed(Qs, factors, consume=True)
        # the layer matrices of segment k at once (their factors need not wait for the layer's last segment)
        for m in self.plan.matrices:
            if m.segment == k and m.layer is not None and m.name not in self.written:
                self.matrix(m, Qs, factors, consume=True)
        if k >= 2 and k % 2 == 0:
            i = k // 2 - 1
            self.layer(i, Qs, factors, consume=True)
            if isinstance(self.layers, FoldedLayers):
                self.layers.drop(i)
            for j in (2 * i, 2 * i + 1):  # read by layer i only (and segment 0 by a tied, mixed head)
                if not (j == 0 and self.plan.lm_head == "tied_mixed"):
                    Qs[j] = None
        if k == self.plan.n_segments - 1:
            self.head(Qs, factors, consume=True)

    def finish(self, res: Kept, progress: bool = True) -> None:
        """Everything not yet written, from the solved rotations and factors."""
        if "embed" not in self.done:
            self.embed(res.Qs, res.factors)
        todo = [i for i in range(self.plan.n_layers) if i not in self.done]
        for i in tqdm(todo, desc="assemble", unit="layer", disable=not progress or not todo):
            self.layer(i, res.Qs, res.factors)
        if "head" not in self.done:
            self.head(res.Qs, res.factors)


def assemble(
    plan: Plan,
    layers: list[Tensors],
    globals_: Tensors,
    gamma: torch.Tensor,
    res: Kept,
    dtype: torch.dtype,
    progress: bool = True,
) -> Tensors:
    """The compressed model's state dict (cast to ``dtype``) from the norm-folded layers and globals and
    the final norm's γ (:class:`Assembler` into a sink writes the parts as a solver finishes them)."""
    sink = DictSink()
    Assembler(plan, layers, globals_, gamma, dtype, sink).finish(res, progress)
    return dict(sink)


def _orthogonal_skip(put, prefix: str, S: torch.Tensor) -> None:
    """An orthogonal skip matrix, stored by its Cayley encoding (checked to decode to ``S``)."""
    k, signs = cayley_encode(S)
    err = (family.cayley_decode(k, signs) - S).abs().max().item()
    if err > 1e-8:
        raise RuntimeError(f"{prefix}: Cayley encoding of the skip rotation is inaccurate ({err:.1e})")
    put(prefix, {"skip_k": k, "skip_signs": signs})


#: how a skip connection's matrix ``S`` is written, by the plan's ``skip`` (the config's ``skip_connections``)
_SKIP_TENSORS = {
    "none": lambda put, prefix, S: None,
    "dense": lambda put, prefix, S: put(prefix, {"weight": S.T}),
    "orthogonal": _orthogonal_skip,
}


def structure_entries(plan: Plan, options: CompressOptions, source_model_type: str | None) -> dict:
    """The config entries both compressed families read the same way: each module's structure (with its
    bias), the skip connections and the ``compression`` record."""
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
    new = {
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
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
        "attention_dropout": float(config.get("attention_dropout", 0.0) or 0.0),
        "rope_parameters": dict(rope),
        "lm_head": plan.lm_head,
        "qk_norm": L.qk_norm,
        **structure_entries(plan, options, config.get("model_type")),
    }
    return new


def config_object(config: dict):
    """The :class:`CompressedLlamaConfig` of a :func:`compressed_config` dict."""
    cfg = CompressedLlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    cfg.architectures = ["CompressedLlamaForCausalLM"]
    return cfg


def build_model(state: Tensors, config: dict, dtype: torch.dtype = torch.float32):
    """A :class:`CompressedLlamaForCausalLM` holding ``state`` (strict: every parameter accounted for)."""
    model = CompressedLlamaForCausalLM(config_object(config)).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"compressed state does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs")
    )
    return model.eval(), counted
