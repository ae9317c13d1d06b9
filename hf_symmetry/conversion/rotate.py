"""``rotate``: a functionally equivalent checkpoint with different weights.

Applies, from one seed: a residual-stream rotation (after norm fusion), per-KV-group QK
rotations inside the RoPE commutant, per-KV-group VO rotations, optional QK/VO scalings, and an
FFN neuron permutation — each only where the family's structure allows it
(:mod:`hf_symmetry.architectures.capabilities`). For RMSNorm families the result is the stock
architecture with all norm weights equal to 1. LayerNorm decoders (OPT, GPT-2) are first
mean-centred, which turns each LayerNorm into an RMSNorm without weight: the result is the
RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`), saved with its remote code.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoTokenizer

from ..architectures import Adapter
from ..calibration.data import calibration_ids
from ..checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
    write_config,
)
from ..flags import flag
from ..hub.cards import write_card
from ..symmetry import actions, groups
from .quantization.imatrix import write_imatrix
from .quantization.llamacpp import FTYPES
from .quantization.preset import (
    applied_transforms,
    learn_checkpoint_rotation,
    options_in_force,
    quant_layer,
    written_imatrix,
)
from .quantization.rotation import hadamard_except
from .quantization.scales import layer_stats, permute_stats, residual_order
from .rms_decoder import centre_globals, centre_layer, check_layer_norm_decoder, copy_remote_code, rms_decoder_config
from .stream import DictSink, DictSource, StreamOptions, TensorSource, partition_keys, transform_checkpoint

Tensors = dict[str, torch.Tensor]

# Stream ids, so each component draws from its own reproducible generator.
_RESIDUAL, _QK, _VO, _QK_SCALE, _VO_SCALE, _FFN = range(6)


def channel_list(text: str) -> tuple[int, ...]:
    """``--hold-out``'s ``I,J,...`` as channel indices."""
    return tuple(int(c) for c in text.split(",") if c.strip())


@dataclass(frozen=True)
class RotateOptions:
    """What ``rotate`` applies, each field with its flag (:mod:`hf_symmetry.flags`). Where the command leaves a
    flag unset (None), ``commands/rotate.resolve_quantization_preset`` fills it before the options are built."""

    residual: Literal["none", "hadamard", "random"] = flag(
        "hadamard",
        "residual-stream rotation after norm fusion (pre-norm RMSNorm families stay stock; LayerNorm "
        "decoders are mean-centred into the hf_symmetry_rms_decoder family; default: hadamard, none with "
        "--for-quantization)",
        choices=["none", "hadamard", "random"],
        unset=None,
    )
    heads: Literal["none", "qk", "vo", "random"] = flag(  # random = qk and vo
        "random",
        "per-KV-group head rotations: QK (inside the RoPE commutant), VO, or both (default)",
        choices=["none", "qk", "vo", "random"],
    )
    ffn: bool = flag(True, "randomly permute FFN neurons (default: on)", action=argparse.BooleanOptionalAction)
    scaling: bool = flag(False, "also apply random per-group QK and VO scalings", action="store_true")
    seed: int = flag(0, type=int)
    # --for-quantization: residual rotation (Hadamard, or learned against ``learn``'s quantizer grid),
    # per-head V/O Hadamards and the exact column scalings of :mod:`.quantization.rotation`; ``heads``/``ffn``/
    # ``scaling`` are then ignored (QK rotations, permutations and row scalings cannot change the error
    # of a row-grouped weight quantizer)
    for_quantization: bool = flag(
        False,
        "write a stock checkpoint that loses less under low-bit weight quantization, exact in float. "
        "Default preset: AWQ-style exact scales searched against --scales (default Q4_0) on "
        "--calibration-text; no rotation. "
        "QuaRot-style: --residual hadamard --vo-hadamard --scales none (on SmolLM2 that quantizes worse "
        "than the original; docs/quantization.md). --heads/--ffn/--scaling are ignored. Which pipeline it helps: "
        "quantization WITHOUT an importance matrix (SmolLM2 through llama.cpp: Q4_0 0.58x, Q4_K_M 0.67x the "
        "original's loss; --target gguf-imatrix --scales Q4_K_M 0.59x and 0.47x); with llama-quantize --imatrix "
        "the original quantized better (the default preset 1.56x at Q4_K_M, 1.20x at Q3_K_M) and --target "
        "gguf-imatrix only broke even (0.95x, 1.08x): with an imatrix, quantize the original",
        action="store_true",
    )
    learn: str | None = flag(
        None,
        "with --for-quantization: learn the residual rotation against this weight quantizer "
        "(Q4_0, Q4_1, Q5_0, Q8_0, MXFP4 through gguf; hqq<bits>g<group>[-rtn] through hqq; "
        "bnb-nf4, bnb-fp4 through bitsandbytes), "
        "from the randomised Hadamard",
        metavar="QTYPE",
    )
    learn_iterations: int = flag(8, "alternating quantize / Procrustes steps of --learn (default: 8)", type=int)
    balance_alpha: float = flag(
        1.0,
        "with --for-quantization: exponent of the column balancing (1 equalises every "
        "column's max-abs, 0 leaves them; default: 1)",
        type=float,
    )
    hold_out: tuple[int, ...] = flag(  # (massive activations)
        (),
        "with --for-quantization: residual channels the Hadamard leaves alone (e.g. the "
        "massive-activation channels; the remaining width needs a Hadamard construction)",
        metavar="I,J,...",
        unset="",
        parse=channel_list,
    )
    # activation-aware exact scales (AWQ's search, :mod:`.quantization.scales`) against this quantizer, on the
    # calibration engine's second moments of ``calibration_tokens`` tokens of ``calibration_text``
    scales: str | None = flag(
        None,
        "with --for-quantization: choose the exact norm->readers, V->O and up->down scales from "
        "calibration activations by AWQ's search against this quantizer: Q4_0, Q4_1, Q5_0, Q8_0, MXFP4 "
        "(gguf), bnb-nf4, bnb-fp4 (bitsandbytes), hqq<bits>g<group>[-rtn] (default: Q4_0; 'none': the "
        "data-free max-abs balancing)",
        metavar="QTYPE",
    )
    calibration_text: str = flag(
        "britannica-calib", "with --scales: calibration text file or embedded name (default: britannica-calib)"
    )
    calibration_tokens: int = flag(2048, "with --scales: tokens (default: 2048)", type=int)
    vo_hadamard: bool = flag(
        True,
        "with --for-quantization: per-head V/O Hadamard rotations (default: off; on with a residual rotation)",
        action=argparse.BooleanOptionalAction,
        unset=None,
    )
    scales_pow2: bool = flag(
        False,
        "with --scales: round every factor to a power of two (only exponents change: the float "
        "logits stay bitwise equal; quantizes somewhat worse)",
        name="--pow2-scales",
        action="store_true",
    )
    sort_channels: bool = flag(
        False,
        "with --for-quantization --scales and no residual rotation: permute the residual channels into "
        "the order of their calibration activation RMS, so that channels of like scale share a quantization "
        "block (exact; default: off: it helps some quantizers and hurts others, docs/quantization.md)",
        action=argparse.BooleanOptionalAction,
        unset=None,
    )
    # what ``scales`` names: "weights" (None): a quantizer of :mod:`hf_symmetry.evaluation.weight_quant`, applied
    # without activation data; "gguf" / "gguf-imatrix": a llama-quantize file type (Q4_K_M, Q3_K_M, ...), its
    # mixture emulated without / with the importance matrix of the scaled model (:mod:`.quantization.llamacpp`)
    target: str | None = flag(
        None,
        "with --for-quantization: what --scales names and how the search measures the error. 'weights' "
        "(default): a weight quantizer, rounding without activation data. 'gguf': a llama-quantize type "
        "(Q4_K_M by default; Q4_0, Q3_K_M, IQ4_NL, ...) with llama.cpp's per-tensor mixture, its quantizers "
        "emulated bit for bit, no importance matrix. 'gguf-imatrix': the same with llama-quantize --imatrix, "
        "the importance matrix being the scaled model's own (write it with --write-imatrix)",
        choices=["weights", "gguf", "gguf-imatrix"],
    )

    @property
    def rotate_qk(self) -> bool:
        return self.heads in ("qk", "random")

    @property
    def rotate_vo(self) -> bool:
        return self.heads in ("vo", "random")

    def symmetries(self) -> list[str]:
        """The symmetry kinds this rotation needs the family to support (checked before any work). What a
        ``--for-quantization`` run actually applied is :func:`.quantization.preset.applied_transforms`."""
        if self.for_quantization:
            return (
                (["residual_rotation"] if self.residual != "none" else [])
                + (["vo_rotation"] if self.vo_hadamard else [])
                + ["vo_scaling"]
            )
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
    if options.residual == "hadamard" and options.hold_out:
        return hadamard_except(hidden, tuple(options.hold_out), gen)
    if options.residual == "hadamard":
        return groups.random_hadamard(hidden, gen)
    if options.residual == "random":
        return groups.haar_orthogonal(hidden, gen)
    return None


def _log_uniform(gen, n: int) -> torch.Tensor:
    return torch.from_numpy(2.0 ** gen.uniform(-1.0, 1.0, n))


def transform_layer(
    i: int,
    layer: Tensors,
    adapter: Adapter,
    options: RotateOptions,
    Q: torch.Tensor | None,
    stats: list[Tensors] | None = None,
    record: dict | None = None,
) -> Tensors:
    """Every per-layer action of ``options``, drawn from layer ``i``'s own random streams (``record[i]``: what a
    ``--for-quantization`` layer step did, :func:`.quantization.preset.quant_layer`)."""
    L, seed = adapter.layout, options.seed
    if options.for_quantization:
        return quant_layer(i, layer, adapter, options, Q, stats, record)
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


# ---------------------------------------------------------------- LayerNorm decoders


def centres_layer_norms(adapter: Adapter, options: RotateOptions) -> bool:
    """True when this rotation mean-centres a LayerNorm decoder into the RMS-decoder family."""
    return options.residual != "none" and adapter.spec.norm_kind == "layer"


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


def permuted_layer(layer: Tensors, perm: torch.Tensor | None) -> Tensors:
    return layer if perm is None else actions.permute_residual_layer(layer, perm)


def permuted_globals(g: Tensors, perm: torch.Tensor | None) -> Tensors:
    return g if perm is None else actions.permute_residual_globals(g, perm)


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
    if options.sort_channels and (not options.for_quantization or not options.scales or options.residual != "none"):
        raise ValueError("--sort-channels needs --scales and --residual none (a rotation mixes every channel)")
    if options.target not in (None, "weights", "gguf", "gguf-imatrix"):
        raise ValueError(f"unknown --target {options.target!r} (weights, gguf, gguf-imatrix)")
    if options.target in ("gguf", "gguf-imatrix"):
        if not (options.for_quantization and options.scales):
            raise ValueError(f"--target {options.target} needs --for-quantization and --scales (a llama-quantize type)")
        if options.scales not in FTYPES:
            raise ValueError(
                f"--target {options.target}: --scales {options.scales!r} is no emulated llama-quantize type "
                f"({', '.join(FTYPES)})"
            )
        if options.learn:
            raise ValueError(f"--learn fits the rotation to a weight_quant quantizer, not to --target {options.target}")


def _rotate(
    source: TensorSource,
    config: dict,
    options: RotateOptions,
    sink,
    progress: bool,
    calibration=None,
    placement=None,
    record: dict | None = None,
) -> tuple[dict, bool, list[str]]:
    """Rotate ``source`` into ``sink``: ``(new config, embeddings untied, transforms applied)``; ``record`` gets each
    ``--for-quantization`` layer's log (:func:`.quantization.preset.quant_layer`)."""
    record = {} if record is None else record
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    plan_checks(adapter, options, keys)
    Q = residual_rotation(options, adapter.hidden)
    if options.for_quantization:
        if adapter.spec.norm_kind != "rms" or not adapter.spec.is_gated:
            raise ValueError(
                "--for-quantization supports RMSNorm families with a gated FFN (Llama, Mistral, Qwen2, ...)"
            )
        if options.learn and Q is not None:
            _, per_layer, _ = partition_keys(adapter, source.keys())
            Q = learn_checkpoint_rotation(source, per_layer, adapter, options, Q, progress)
    stats = None
    if options.for_quantization and options.scales:
        if calibration is None:
            raise ValueError(
                "--scales needs calibration: token ids, or the layer statistics of quantization.scales.layer_stats"
            )
        stats = (
            calibration
            if isinstance(calibration, list)
            else layer_stats(source, config, calibration, progress, placement=placement)
        )
    perm = None
    if options.sort_channels:
        perm = residual_order(stats)  # plan_checks made sure there are statistics and no rotation
        stats = permute_stats(stats, perm)
    if centres_layer_norms(adapter, options):
        new_config = rotate_layer_norm_decoder(source, adapter, config, options, Q, sink, progress)
        return new_config, True, options.symmetries()
    transform_checkpoint(
        source,
        adapter,
        sink,
        layer_fn=lambda i, layer: transform_layer(i, permuted_layer(layer, perm), adapter, options, Q, stats, record),
        globals_fn=lambda g: transform_globals(permuted_globals(g, perm), adapter, Q),
        progress=progress,
        desc="rotate",
        options=StreamOptions(globals_dtype=None, give_layers=True),
    )
    new_config = dict(config)
    untied = Q is not None and adapter.spec.lm_head is not None and adapter.tied_embeddings
    if untied:
        new_config["tie_word_embeddings"] = False
    if options.for_quantization:
        return new_config, untied, applied_transforms(options, Q is not None, record)
    return new_config, untied, options.symmetries()


def rotate_layer_norm_decoder(
    source: TensorSource,
    adapter: Adapter,
    config: dict,
    options: RotateOptions,
    Q: torch.Tensor,
    sink,
    progress: bool,
    desc: str = "rotate",
) -> dict:
    """Centre, fold and rotate a LayerNorm decoder, written as the RMS-decoder family. ``Q`` is
    ``[d, w]`` with orthonormal columns: ``w = d`` rotates exactly (``rotate``); ``w < d`` would also slice the
    stream to its first ``w`` rotated coordinates (compress slices through ``compress.pca.slice_into`` instead)."""
    check_layer_norm_decoder(config)
    # the output config needs two shapes: the FFN width (layer 0) and the position table's rows
    layer0 = adapter.read_layer(0, source.get([k for k in source.keys() if adapter.layer_of(k) == 0]))
    pos_keys = [f"{adapter.prefix}{name}.weight" for name in adapter.spec.pos_embed[:1]]  # none with rotary
    rows = source.get(pos_keys)[pos_keys[0]].shape[0] if pos_keys else 0
    new_config = rms_decoder_config(adapter, config, layer0["up.weight"].shape[0], rows, residual_size=Q.shape[1])
    del layer0

    def layer_fn(i, layer):
        layer = transform_layer(i, centre_layer(layer), adapter, options, Q)
        if adapter.layout.rope_layout == "interleaved":  # GPT-J: the family's RoPE pairs rotate-half
            layer = actions.interleaved_to_half(layer, adapter.layout)
        return layer

    transform_checkpoint(
        source,
        adapter,
        sink,
        layer_fn=layer_fn,
        globals_fn=lambda g: actions.rotate_residual_globals(centre_globals(g), Q),
        progress=progress,
        desc=desc,
        options=StreamOptions(globals_dtype=torch.float64, writer=Adapter.from_config(new_config)),
    )
    return new_config


def rotate_state_dict(
    state_dict: Tensors,
    config,
    options: RotateOptions = RotateOptions(),
    progress: bool = False,
    calibration=None,
    placement=None,
    info: dict | None = None,
) -> tuple[Tensors, dict]:
    """In-memory rotation: returns (new state dict, new config dict). ``calibration`` (with
    ``options.scales``): calibration token ids, or precomputed :func:`.quantization.scales.layer_stats`;
    ``placement``: where those statistics' forward passes run (default: the CPU). ``info`` gets ``applied``
    (the transforms that changed weights) and ``record`` (each ``--for-quantization`` layer's log)."""
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    sink = DictSink()
    record: dict = {}
    new_config, _, applied = _rotate(
        DictSource(state_dict), config, options, sink, progress, calibration, placement, record
    )
    if info is not None:
        info.update(applied=applied, record=record)
    return dict(sink), new_config


def rotate_card_data(
    src, out, options: RotateOptions, family: str, untied: bool, applied: list[str] | None = None
) -> dict:
    """What the model card says about a rotation (exactness figures are added once verified): the options in
    force (:func:`.quantization.preset.options_in_force`) and the transforms ``applied``."""
    return {
        "title": Path(out).name,
        "inputs": [str(src)],
        "parameters": options_in_force(options),
        "seed": options.seed,
        "extra": {
            "applied": options.symmetries() if applied is None else applied,
            "untied_embeddings": untied,
            "family": family,
            "for_quantization": options.for_quantization,
        },
    }


def rotate_checkpoint(
    src: str | Path,
    out: str | Path,
    options: RotateOptions = RotateOptions(),
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
    placement=None,
    imatrix_out: str | Path | None = None,
) -> RotateReport:
    """Stream ``src`` (an HF safetensors folder) into a rotated copy at ``out``. ``placement``
    (:func:`hf_symmetry.devices.resolve`): where ``--scales``' calibration forward passes run, one layer
    at a time (default: the CPU); the rotation itself streams on the CPU in float64. ``imatrix_out``: also
    write the importance matrix of the output model over the calibration tokens (llama.cpp's GGUF imatrix
    format, :mod:`.quantization.imatrix`), for ``llama-quantize --imatrix``."""
    if imatrix_out is not None and not (options.for_quantization and options.scales):
        raise ValueError("--write-imatrix needs --for-quantization with activation-aware --scales")
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    reader = CheckpointReader(src)
    adapter = Adapter.from_config(reader.config, reader.keys())  # unsupported families fail before any output
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size), metadata={"hf_symmetry": "rotate"})
        calibration = None
        if options.for_quantization and options.scales:
            calibration = calibration_ids(
                AutoTokenizer.from_pretrained(src), options.calibration_text, options.calibration_tokens
            )
        record: dict = {}
        new_config, untied, applied = _rotate(
            reader, reader.config, options, writer, progress, calibration, placement, record
        )
        writer.close()
        write_config(tmp, new_config)
        if centres_layer_norms(adapter, options):
            copy_remote_code(tmp)
        copy_side_files(reader.path, tmp)
        write_card(tmp, "rotate", rotate_card_data(src, out, options, adapter.family, untied, applied))
    if imatrix_out is not None:
        seq = 512  # layer_stats' sequence length: one chunk per 512 calibration tokens
        write_imatrix(
            imatrix_out,
            written_imatrix(record, adapter.n_layers, int(calibration.numel())),
            [options.calibration_text],
            chunk_count=-(-int(calibration.numel()) // seq),
            chunk_size=seq,
        )
    return RotateReport(
        source=str(src),
        output=str(out),
        family=adapter.family,
        options=asdict(options),
        applied=applied,
        untied_embeddings=untied,
        seconds=time.perf_counter() - start,
    )
