"""``rotate``: a functionally equivalent checkpoint with different weights.

Applies, from one seed: a residual-stream rotation (after norm fusion; RMSNorm families),
per-KV-group QK rotations inside the RoPE commutant, per-KV-group VO rotations, optional
QK/VO scalings, and an FFN neuron permutation. For Llama/Mistral/Qwen2 the result is the
stock architecture with all norm weights equal to 1.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..architectures import Adapter
from ..checkpoint import (CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, copy_side_files,
                          parse_size, write_config)
from ..hub.cards import write_card
from ..symmetry import actions, groups
from .stream import DictSink, DictSource, TensorSource, partition_keys, transform_checkpoint

Tensors = dict[str, torch.Tensor]

# Stream ids, so each component draws from its own reproducible generator.
_RESIDUAL, _QK, _VO, _QK_SCALE, _VO_SCALE, _FFN = range(6)


@dataclass(frozen=True)
class RotateOptions:
    residual: Literal["none", "hadamard", "random"] = "hadamard"
    heads: Literal["none", "qk", "vo", "random"] = "random"     # random = qk and vo
    ffn: bool = True
    scaling: bool = False
    seed: int = 0

    @property
    def rotate_qk(self) -> bool:
        return self.heads in ("qk", "random")

    @property
    def rotate_vo(self) -> bool:
        return self.heads in ("vo", "random")

    def symmetries(self) -> list[str]:
        wanted = []
        if self.residual != "none":
            wanted.append("residual_rotation")
        if self.rotate_qk:
            wanted.append("qk_rotation")
        if self.rotate_vo:
            wanted.append("vo_rotation")
        if self.scaling:
            wanted += ["qk_scaling", "vo_scaling"]
        if self.ffn:
            wanted.append("ffn_permutation")
        return wanted


@dataclass
class RotateReport:
    source: str
    output: str | None
    family: str
    options: dict
    applied: list[str]
    untied_embeddings: bool = False
    seconds: float = 0.0
    verification: dict = field(default_factory=dict)


def residual_rotation(options: RotateOptions, hidden: int) -> torch.Tensor | None:
    gen = groups.rng(options.seed, _RESIDUAL)
    if options.residual == "hadamard":
        return groups.random_hadamard(hidden, gen)
    if options.residual == "random":
        return groups.haar_orthogonal(hidden, gen)
    return None


def _log_uniform(gen, n: int) -> torch.Tensor:
    return torch.from_numpy(2.0 ** gen.uniform(-1.0, 1.0, n))


def transform_layer(i: int, layer: Tensors, adapter: Adapter, options: RotateOptions,
                    Q: torch.Tensor | None) -> Tensors:
    """Every per-layer action of ``options``, drawn from layer ``i``'s own random streams."""
    L, seed = adapter.layout, options.seed
    if Q is not None:
        layer = actions.rotate_residual_layer(actions.fold_layer_norms(layer), Q)
    if options.rotate_qk:
        gen = groups.rng(seed, _QK, i)
        layer = actions.rotate_qk(layer, L, [groups.random_rope_commutant(L, gen) for _ in range(L.n_kv_heads)])
    if options.rotate_vo:
        gen = groups.rng(seed, _VO, i)
        layer = actions.rotate_vo(layer, L, [groups.haar_orthogonal(L.head_dim, gen) for _ in range(L.n_kv_heads)])
    if options.scaling:
        layer = actions.scale_qk(layer, L, _log_uniform(groups.rng(seed, _QK_SCALE, i), L.n_kv_heads))
        layer = actions.scale_vo(layer, L, _log_uniform(groups.rng(seed, _VO_SCALE, i), L.n_kv_heads))
    if options.ffn:
        n = layer["up.weight"].shape[0]
        layer = actions.permute_ffn(layer, groups.random_permutation(n, groups.rng(seed, _FFN, i)))
    return layer


def transform_globals(g: Tensors, adapter: Adapter, Q: torch.Tensor | None) -> Tensors:
    """Fold the final norm and rotate. ``g`` is owned (fresh copies from the stream, in the
    checkpoint's dtype), so the vocabulary-sized matrices are updated in place, in float64 a
    block of rows at a time."""
    if Q is None:
        return g
    g = dict(g)
    if "lm_head.weight" not in g:  # tied: the head is the embedding until the final norm folds in
        g["lm_head.weight"] = g["embed.weight"].clone()
    return actions.fold_and_rotate_globals_(g, Q)


def plan_checks(adapter: Adapter, options: RotateOptions, source_keys: list[str]) -> None:
    """Refuse, before any work, everything this family or checkpoint cannot do exactly."""
    for s in options.symmetries():
        adapter.check_supports(s)
    if options.residual != "none":
        _, _, rest = partition_keys(adapter, source_keys)
        if rest:
            raise ValueError(f"residual rotation would leave tensors outside the known layout unrotated: {rest[:4]}")
        if options.residual == "hadamard":
            groups.hadamard_factors(adapter.hidden)  # raises a clear error if no construction exists


def _rotate(source: TensorSource, config: dict, options: RotateOptions, sink, progress: bool) -> tuple[dict, bool]:
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    plan_checks(adapter, options, keys)
    Q = residual_rotation(options, adapter.hidden)
    transform_checkpoint(source, adapter, sink,
                         layer_fn=lambda i, layer: transform_layer(i, layer, adapter, options, Q),
                         globals_fn=lambda g: transform_globals(g, adapter, Q), progress=progress, desc="rotate",
                         globals_dtype=None, give_layers=True)
    new_config = dict(config)
    untied = Q is not None and adapter.spec.lm_head is not None and adapter.tied_embeddings
    if untied:
        new_config["tie_word_embeddings"] = False
    return new_config, untied


def rotate_state_dict(state_dict: Tensors, config, options: RotateOptions = RotateOptions(),
                      progress: bool = False) -> tuple[Tensors, dict]:
    """In-memory rotation: returns (new state dict, new config dict)."""
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    sink = DictSink()
    new_config, _ = _rotate(DictSource(state_dict), config, options, sink, progress)
    return dict(sink), new_config


def rotate_card_data(src, out, options: RotateOptions, family: str, untied: bool) -> dict:
    """What the model card says about a rotation (exactness figures are added once verified)."""
    params = {k: v for k, v in asdict(options).items() if k != "seed"}
    return {"title": Path(out).name, "inputs": [str(src)], "parameters": params, "seed": options.seed,
            "extra": {"applied": options.symmetries(), "untied_embeddings": untied, "family": family}}


def rotate_checkpoint(src: str | Path, out: str | Path, options: RotateOptions = RotateOptions(),
                      overwrite: bool = False, max_shard_size: str | int = "2GB", progress: bool = True) -> RotateReport:
    """Stream ``src`` (an HF safetensors folder) into a rotated copy at ``out``."""
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    adapter = Adapter.from_config(reader.config, reader.keys())  # unsupported families fail before any output
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "rotate"})
        new_config, untied = _rotate(reader, reader.config, options, writer, progress)
        writer.close()
        write_config(tmp, new_config)
        copy_side_files(reader.path, tmp)
        write_card(tmp, "rotate", rotate_card_data(src, out, options, adapter.family, untied))
    return RotateReport(source=str(src), output=str(out), family=adapter.family, options=asdict(options),
                        applied=options.symmetries(), untied_embeddings=untied,
                        seconds=time.perf_counter() - start)

