"""SliceGPT on LayerNorm decoders (OPT, GPT-2), through the RMS-decoder family.

The compressed family is a Llama (gated FFN, RoPE, no learned positions), so a LayerNorm decoder takes
SliceGPT's own route instead (Ashkboos et al., 2024, §3.2): every writer to the residual stream (token
and position embeddings, attention and FFN output projections with their biases) is mean-centred, which
leaves the function unchanged and makes each LayerNorm an RMSNorm followed by its γ and β; those fold
into the readers. The stream of this centred model is ``P x`` (``P = I − 11ᵀ/d``), so its second moment
per residual segment is ``P C P`` with ``C`` measured on the original model; one global rotation ``Q``
(the principal directions of all segments, each normalised by its trace, as the compressed family's
global SliceGPT) then maps the stream, and only its first ``w`` coordinates are kept. The result is the
RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`) with ``residual_size = w``: its
norms still divide by the original width, and the head (untied, as the centring requires) reads the
sliced stream. At ``w = d`` this is an exact residual rotation.

``w`` is chosen as the compressed family's SliceGPT chooses it: the width whose total parameter count is
closest to ``dense − ratio × (parameters of the matrices on the stream)``, so equal ratios mean equal
model sizes across families.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ...architectures import Adapter
from ...architectures.capabilities import facts, require
from ...checkpoint import CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, copy_side_files, \
    write_config
from ..rotate import RotateOptions, _rotate_layer_norm_decoder, copy_remote_code
from ..stream import DictSink, DictSource, TensorSource, partition_keys
from .calibration import collect_statistics, pca
from .options import CompressOptions
from .plan import source_numels

_READERS, _WRITERS = ("q", "k", "v", "up"), ("o", "down")


def through_rms_decoder(config) -> bool:
    """True for the decoders whose SliceGPT runs here (LayerNorm, so not the compressed family)."""
    f = facts(config)
    return f.decoder and f.norm_kind == "layer"


def check(adapter: Adapter, options: CompressOptions, keys: list[str]) -> None:
    """Refuse, before any work, what this route cannot do, with the reason."""
    if not options.slicing:
        require(adapter, "compress")   # the structured classes need the compressed family: its reason
    require(adapter, "slicegpt")
    if options.sequential:
        raise ValueError(f"sequential SliceGPT on a LayerNorm decoder ({adapter.family}) is not implemented: drop "
                         "--sequential (one pass of the original model, one global PCA of the centred stream)")
    if options.q_mode != "global":
        raise ValueError(f"SliceGPT on a LayerNorm decoder ({adapter.family}) writes the RMS-decoder family, which has "
                         "one basis for the whole stream and no skip matrices: use --q-mode global (the default)")
    if options.allocation != "uniform":
        raise ValueError(f"SliceGPT on a LayerNorm decoder ({adapter.family}) keeps one width for every segment: "
                         "--allocation uniform")
    _, _, rest = partition_keys(adapter, keys)
    if rest:
        raise ValueError(f"checkpoint has tensors SliceGPT does not know how to carry: {rest[:4]}")


def centred_rotation(stream: list[torch.Tensor]) -> torch.Tensor:
    """``Q`` (``[d, d]``, principal directions first) of the centred model's stream, from the original
    model's per-segment second moments ``C``: eigenvectors of ``Σ P C P / tr(P C P)``."""
    d = stream[0].shape[0]
    P = torch.eye(d, dtype=torch.float64) - torch.full((d, d), 1.0 / d, dtype=torch.float64)
    total = torch.zeros(d, d, dtype=torch.float64)
    for C in stream:
        PCP = P @ C.to(torch.float64) @ P
        total += PCP / PCP.trace().clamp_min(1e-300)
    return pca(total)


def _shapes(adapter: Adapter, source: TensorSource, keys: list[str]) -> dict:
    """Shapes that fix the parameter count at a given width (layer 0 read through the adapter, which
    splits fused and transposed projections; globals from the checkpoint's header)."""
    _, per_layer, _ = partition_keys(adapter, keys)
    layer0 = adapter.read_layer(0, source.get(per_layer[0]))
    shapes = source.shapes()
    rows = sum(shapes[f"{adapter.prefix}{name}.weight"][0] for name in adapter.spec.pos_embed)
    return {"out": {c: layer0[f"{c}.weight"].shape[0] for c in _READERS},
            "in": {c: layer0[f"{c}.weight"].shape[1] for c in _WRITERS},
            "vocab": shapes[f"{adapter.prefix}{adapter.spec.embed}.weight"][0], "rows": rows}


def sliced_params(shapes: dict, n_layers: int, w: int) -> int:
    """Parameters of the RMS-decoder model at residual width ``w`` (reader biases kept whole, writer
    biases sliced, untied head with its bias, no norm weights)."""
    readers = sum(shapes["out"].values())
    per_layer = readers * (w + 1) + sum((k + 1) * w for k in shapes["in"].values())
    return n_layers * per_layer + shapes["vocab"] * (2 * w + 1) + shapes["rows"] * w


def plan_width(adapter: Adapter, source: TensorSource, keys: list[str], options: CompressOptions) -> tuple[int, dict]:
    """The residual width and the parameter accounting (the keys the compressed family's reports use)."""
    d, L = adapter.hidden, adapter.n_layers
    shapes = _shapes(adapter, source, keys)
    dense_total = source_numels(source, keys, adapter.tied_embeddings)
    layer_params = L * (sum(shapes["out"].values()) + sum(shapes["in"].values())) * d
    embed_params = (shapes["vocab"] * (1 if adapter.tied_embeddings else 2) + shapes["rows"]) * d
    p_compressed = layer_params + (embed_params if options.compress_embeddings else 0)
    target = dense_total - options.ratio * p_compressed
    w = min(range(1, d + 1), key=lambda x: abs(sliced_params(shapes, L, x) - target))
    total = sliced_params(shapes, L, w)
    per_matrix = {f"layers.{i}.{c}": {"structure": {"type": "dense", "width": w}, "params": k * w,
                                      "dense_params": k * d, "ratio": 1 - w / d}
                  for i in range(L) for c, k in (*shapes["out"].items(), *shapes["in"].items())}
    accounting = {"hidden": d, "residual": w, "dense_model_params": dense_total, "compressed_model_params": total,
                  "ratio_over_model": (dense_total - total) / dense_total,
                  "ratio_over_compressed": (dense_total - total) / p_compressed,
                  "ratio_per_matrix_mean": 1 - w / d, "skip_params": 0, "head_mix_params": 0,
                  "untied_head_params": shapes["vocab"] * (w + 1) if adapter.tied_embeddings else 0,
                  "output_family": "hf_symmetry_rms_decoder", "per_matrix": per_matrix}
    if abs(accounting["ratio_over_compressed"] - options.ratio) > options.tolerance:
        raise ValueError(f"SliceGPT on {adapter.family} cannot meet ratio {options.ratio:g} within {options.tolerance:g} "
                         f"(nearest: {accounting['ratio_over_compressed']:.4f}; a tied head is untied by the centring "
                         "and costs vocab × width)")
    return w, accounting


def slice_tensors(source: TensorSource, config: dict, options: CompressOptions, calib_ids: torch.Tensor | None,
                  sink, width: int | None = None, rotation: torch.Tensor | None = None, placement=None,
                  progress: bool = True):
    """The whole route on tensors into ``sink``: (RMS-decoder config dict, report). ``width`` overrides
    the planned width (``d``: the exact, unsliced rotation); ``rotation`` the measured ``Q``."""
    from .pipeline import CompressReport, _require_calibration

    t0 = time.perf_counter()
    keys = source.keys()
    adapter = Adapter.from_config(config, keys)
    check(adapter, options, keys)
    w, accounting = plan_width(adapter, source, keys, options)
    if width is not None:
        w = int(width)
        accounting.update(residual=w, compressed_model_params=sliced_params(_shapes(adapter, source, keys),
                                                                            adapter.n_layers, w))
    tokens = 0
    if rotation is None:
        _require_calibration(options, calib_ids)
        stats = collect_statistics(source, config, calib_ids[: options.calib_tokens], options.calib_seq_len,
                                   want_normed=False, want_stream=True, placement=placement, progress=progress)
        rotation, tokens = centred_rotation(stats.stream), stats.tokens
    t1 = time.perf_counter()
    new_config = _rotate_layer_norm_decoder(source, adapter, config, RotateOptions(heads="none", ffn=False),
                                            rotation[:, :w].contiguous(), sink, progress, desc="slice")
    report = CompressReport(source="", output=None, family=adapter.family, options=options.as_dict(),
                            accounting=accounting, relative_errors={}, objective={}, calibration_tokens=tokens,
                            seconds={"calibration": t1 - t0, "solve": 0.0, "assemble": time.perf_counter() - t1},
                            method=f"{options.label}, centred into the RMS-decoder family")
    return new_config, report


def build(state: dict, config: dict, dtype: torch.dtype):
    """The RMS-decoder model holding ``state`` (strict), and its counted parameters."""
    from ...modeling.configuration_rms_decoder import RMSDecoderConfig
    from ...modeling.modeling_rms_decoder import RMSDecoderForCausalLM

    model = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(config)).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.eval(), sum(p.numel() for p in model.parameters())


def compress_layer_norm_model(model, options: CompressOptions, calib_ids: torch.Tensor | None = None,
                              progress: bool = False, width: int | None = None, placement=None):
    """In memory: a loaded OPT / GPT-2 ``...ForCausalLM`` -> (RMSDecoderForCausalLM, report)."""
    options.validate()
    dtype = next(model.parameters()).dtype
    sink = DictSink()
    new_config, report = slice_tensors(DictSource({k: v.detach() for k, v in model.state_dict().items()}),
                                       model.config.to_dict(), options, calib_ids, sink, width=width,
                                       placement=placement, progress=progress)
    sliced, counted = build(dict(sink), new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return sliced, report


def compress_layer_norm_checkpoint(reader: CheckpointReader, out: str | Path, options: CompressOptions,
                                   calib_text, overwrite: bool = False, progress: bool = True, placement=None):
    """:func:`hf_symmetry.conversion.compress.compress_checkpoint` for LayerNorm decoders: every input
    checked before any work, the checkpoint read one layer at a time, ``out`` written atomically
    (weights, config, the RMS-decoder family's remote code, tokenizer, report, card)."""
    from ...evaluation.compare import load_tokenizer
    from ...evaluation.perplexity import read_text, tokenize_text
    from .card import write_card
    from .pipeline import _write_report

    options.validate()
    check_output_dir(out, overwrite)
    adapter = Adapter.from_config(reader.config, reader.keys())
    check(adapter, options, reader.keys())
    plan_width(adapter, reader, reader.keys(), options)          # an unreachable ratio fails here
    calib = read_text(calib_text) if calib_text is not None else None
    if calib is None:
        raise ValueError(f"--calib is required for {options.label} (calibration text: a UTF-8 file or an embedded name)")
    calib_ids = tokenize_text(load_tokenizer(reader.path), calib, max_tokens=options.calib_tokens)
    if calib_ids.numel() < 2:
        raise ValueError(f"calibration text {calib_text} has fewer than two tokens")
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, 2 * 10**9, metadata={"hf_symmetry": "compress"})
        new_config, report = slice_tensors(reader, reader.config, options, calib_ids, writer, placement=placement,
                                           progress=progress)
        writer.close()
        write_config(tmp, new_config)
        copy_remote_code(tmp)
        copy_side_files(reader.path, tmp)
        report.source, report.output = str(reader.path), str(out)
        _write_report(tmp, report)
        write_card(tmp, report, options)
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, 0o644)
    return report
