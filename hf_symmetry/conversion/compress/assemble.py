"""Step 4, assembly: the compressed model's state dict and config from the solved rotations and factors.

Norms folded (:func:`actions.fold_layer_norms` / :func:`actions.fold_final_norm`), the rotations applied
with :func:`actions.rotate_residual_layer` / :func:`actions.rotate_residual_globals`, structured factors in
place of the compressed matrices: a :class:`CompressedLlamaForCausalLM`."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...symmetry import actions
from ...symmetry import structured as st
from ...symmetry.segments import cayley_encode
from ..stream import TensorSource, partition_keys
from ...modeling import modeling_compressed_llama as family
from .options import LAYER_MODULES, CompressOptions
from .plan import MatrixPlan, Plan
from .solve import SolveResult

Tensors = dict[str, torch.Tensor]


class FoldedLayers:
    """The norm-folded canonical float64 layers as a read-only sequence that reads each layer from
    the checkpoint when it is asked for and keeps only the last ``keep`` of them: the solvers and the
    assembly walk the layers in order, so memory holds a layer or two whatever the depth."""

    def __init__(self, source: TensorSource, adapter: Adapter, per_layer: dict[int, list[str]], keep: int = 2):
        self.source, self.adapter, self.per_layer, self.keep = source, adapter, per_layer, keep
        self._cache: dict[int, Tensors] = {}
        self.reads = 0

    def __len__(self) -> int:
        return self.adapter.n_layers

    def __getitem__(self, i: int) -> Tensors:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i not in self._cache:
            self.reads += 1
            self._cache[i] = actions.fold_layer_norms(self.adapter.read_layer(i, self.source.get(self.per_layer[i])))
            while len(self._cache) > self.keep:
                self._cache.pop(next(iter(self._cache)))
        return self._cache[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def read_folded(source: TensorSource, adapter: Adapter, keys: list[str], tied: bool, lazy: bool = False):
    """Canonical float64 layers with both norms folded, the globals with the final norm folded into an
    untied head (a tied head has none: the final γ goes into the head's change of basis), and that γ.
    ``lazy``: the layers as :class:`FoldedLayers` (read on demand, two in memory) instead of a list."""
    global_keys, per_layer, rest = partition_keys(adapter, keys)
    rest = [k for k in rest if not k.endswith("rotary_emb.inv_freq")]
    if rest:
        raise ValueError(f"checkpoint has tensors compress does not know how to carry: {rest[:4]}")
    g = adapter.read_globals(source.get(global_keys))
    if tied:
        g.pop("lm_head.weight", None)
    gamma = g["final_norm.weight"].clone()
    layers = FoldedLayers(source, adapter, per_layer)
    if not lazy:
        layers = list(layers)
    return layers, actions.fold_final_norm(g), gamma




def module_tensors(structure: st.Structure, factors: st.Factors) -> Tensors:
    """Factors (math layout, :mod:`..symmetry.structured`) -> the parameters of the matching module of
    ``modeling_compressed_llama`` (``[out, in]`` orientation)."""
    if structure.kind == "dense":
        return {"weight": factors[0]}
    if structure.kind == "lowrank":
        return {"lr_u": factors[0], "lr_v": factors[1]}
    if structure.kind == "kron":
        return {"kron_a": factors[0].permute(1, 0, 2), "kron_b": factors[1].permute(1, 0, 2)}
    if structure.kind == "gs":
        return {"gs_left": factors[0], "gs_right": factors[1]}
    raise AssertionError(structure.kind)


def _module_factors(m: MatrixPlan, res: SolveResult) -> st.Factors:
    f = res.factors[m.name]
    return f if m.module_structure is m.structure else m.structure.transpose_factors(f)


def assemble(plan: Plan, layers: list[Tensors], globals_: Tensors, gamma: torch.Tensor, res: SolveResult,
             dtype: torch.dtype, progress: bool = True, sink=None) -> Tensors:
    """The compressed model's state dict (cast to ``dtype``) from the norm-folded layers and globals and
    the final norm's γ. ``sink``: called with each module's tensors as they are made (e.g. a
    :class:`...checkpoint.ShardedWriter`'s ``add``) instead of collecting them; the result is then empty."""
    dr, Qs, L = plan.residual, res.Qs, plan.n_layers
    out: Tensors = {}

    def put(prefix: str, tensors: Tensors) -> None:
        made = {f"{prefix}.{k}": v.to(dtype).contiguous() for k, v in tensors.items()}
        if sink is not None:
            sink(made)
        else:
            out.update(made)

    def matrix(m: MatrixPlan, rotated: torch.Tensor, prefix: str, bias: torch.Tensor | None) -> None:
        """``rotated``: the exactly rotated ``[out, in]`` matrix, used when ``m`` stays dense."""
        if m.compressed:
            tensors = module_tensors(m.module_structure, _module_factors(m, res))
        else:
            w = plan.width(m.segment)
            sliced = rotated[:, :w] if (m.role == "reader" or m.canon == "embed") else rotated[:w, :]
            tensors = {"weight": sliced}
        if bias is not None:
            tensors["bias"] = bias if m.role == "reader" else bias[:plan.width(m.segment)]
        put(prefix, tensors)

    rot_g = actions.rotate_residual_globals(globals_, Qs[0], Qs[2 * L])
    ms = plan.by_name()
    matrix(ms["embed"], rot_g["embed.weight"], family.EMBED_MODULE, None)
    for i in tqdm(range(L), desc="assemble", unit="layer", disable=not progress):
        rot = actions.rotate_residual_layer(layers[i], Qs[2 * i], Qs[2 * i + 1], Qs[2 * i + 2])
        prefix = family.LAYER_PREFIX.format(i)
        for canon, m in plan.layer_matrices(i).items():
            path = LAYER_MODULES[canon][0]
            matrix(m, rot[f"{canon}.weight"], prefix + path, rot.get(f"{canon}.bias"))
        for canon, path in family.QK_NORM_MODULES.items():   # QK-norm: on the heads, untouched by the stream's rotations
            if f"{canon}.weight" in layers[i]:
                put(prefix + path, {"weight": layers[i][f"{canon}.weight"]})
        for name, (a, b) in (("attn_skip", (2 * i, 2 * i + 1)), ("mlp_skip", (2 * i + 1, 2 * i + 2))):
            _put_skip(put, prefix + name, plan.skip, Qs[a][:, :dr].T @ Qs[b][:, :dr])
    if plan.lm_head == "separate":
        matrix(ms["lm_head"], rot_g["lm_head.weight"], family.LM_HEAD_MODULE, None)
    elif plan.lm_head == "tied_mixed":
        # logits = RMSNorm(s) M Êᵀ
        M = Qs[2 * L][:, :plan.width(2 * L)].T @ (gamma[:, None] * Qs[0][:, :plan.width(0)])
        put(family.HEAD_MIX_MODULE, {"weight": M.T})
    return out


def _put_skip(put, prefix: str, kind: str, S: torch.Tensor) -> None:
    if kind == "none":
        return
    if kind == "dense":
        put(prefix, {"weight": S.T})
        return
    from ...modeling.modeling_compressed_llama import cayley_decode

    k, signs = cayley_encode(S)
    err = (cayley_decode(k, signs) - S).abs().max().item()
    if err > 1e-8:
        raise RuntimeError(f"{prefix}: Cayley encoding of the skip rotation is inaccurate ({err:.1e})")
    put(prefix, {"skip_k": k, "skip_signs": signs})


def compressed_config(config: dict, plan: Plan, options: CompressOptions, hf_config=None) -> dict:
    """Config dict of the ``hf_symmetry_compressed_llama`` model."""
    ms = plan.by_name()

    def spec(m: MatrixPlan) -> dict:
        return {**m.module_structure.spec(), "bias": m.bias}

    layer_structures = [{LAYER_MODULES[c][0].split(".")[1]: spec(m) for c, m in plan.layer_matrices(i).items()}
                        for i in range(plan.n_layers)]
    rope = getattr(hf_config, "rope_parameters", None) if hf_config is not None else config.get("rope_parameters")
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}
    L = Adapter.from_config(config).layout
    new = {
        "architectures": ["CompressedLlamaForCausalLM"],
        "model_type": "hf_symmetry_compressed_llama",
        "vocab_size": int(config["vocab_size"]), "hidden_size": plan.hidden, "residual_size": plan.residual,
        **({"residual_sizes": list(plan.residual_sizes)} if plan.residual_sizes is not None else {}),
        "intermediate_size": int(config["intermediate_size"]), "num_hidden_layers": plan.n_layers,
        "num_attention_heads": L.n_heads, "num_key_value_heads": L.n_kv_heads, "head_dim": L.head_dim,
        "hidden_act": config.get("hidden_act", "silu"),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "initializer_range": float(config.get("initializer_range", 0.02)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
        "attention_dropout": float(config.get("attention_dropout", 0.0) or 0.0),
        "rope_parameters": dict(rope), "skip_connections": plan.skip, "lm_head": plan.lm_head, "qk_norm": L.qk_norm,
        "layer_structures": layer_structures, "embed_structure": spec(ms["embed"]),
        "lm_head_structure": spec(ms["lm_head"]) if "lm_head" in ms else None,
        "compression": {"method": options.method, "label": options.label,
                        "structure": options.structure, "stage": options.stage, "q_mode": options.q_mode,
                        "ratio": options.ratio,
                        "ratio_over_compressed": plan.accounting["ratio_over_compressed"],
                        "ratio_over_model": plan.accounting["ratio_over_model"],
                        "source_model_type": config.get("model_type")},
    }
    return new


def config_object(config: dict):
    """The :class:`CompressedLlamaConfig` of a :func:`compressed_config` dict."""
    from ...modeling.configuration_compressed_llama import CompressedLlamaConfig

    cfg = CompressedLlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    cfg.architectures = ["CompressedLlamaForCausalLM"]
    return cfg


def build_model(state: Tensors, config: dict, dtype: torch.dtype = torch.float32):
    """A :class:`CompressedLlamaForCausalLM` holding ``state`` (strict: every parameter accounted for)."""
    from ...modeling.modeling_compressed_llama import CompressedLlamaForCausalLM

    model = CompressedLlamaForCausalLM(config_object(config)).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"compressed state does not match the model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs"))
    return model.eval(), counted

