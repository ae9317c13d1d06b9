"""``compress`` on LayerNorm decoders (OPT, GPT-2, GPT-NeoX, GPT-J), through the RMS-decoder family.

The compressed family is a Llama (gated FFN, RoPE, no learned positions, no biases), so a LayerNorm
decoder is compressed into the RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`)
instead, after centring: every writer to the residual stream is mean-centred and each LayerNorm folded
into its readers, which leaves the function unchanged and makes the stream rotatable. The steps:

- :mod:`.centred` — the centred model as a tensor source, one layer at a time from the checkpoint;
- :mod:`.slice` — SliceGPT: one global PCA of the centred stream, the stream sliced;
- :mod:`.structured` — ProcrustesGPT (Kronecker sums, GS, low rank): the compressed family's plan,
  solvers and assembly on the centred model, biases and the position table kept dense;
- here: the checks (before any work), the entry points on a loaded model and on a checkpoint folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ....architectures import Adapter
from ....architectures.capabilities import facts, require
from ....checkpoint import CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, copy_side_files, \
    write_config
from ...rotate import copy_remote_code
from ...stream import DictSink, DictSource, partition_keys
from ..options import CompressOptions
from .centred import CentredSource
from .slice import centred_rotation, plan_width, sliced_params, slice_tensors
from .structured import layer_norm_plan, plan_structured, structured_tensors


def through_rms_decoder(config) -> bool:
    """True for the decoders compressed here (LayerNorm, so not the compressed family)."""
    f = facts(config)
    return f.decoder and f.norm_kind == "layer"


def check(adapter: Adapter, options: CompressOptions, keys: list[str]) -> None:
    """Refuse, before any work, what this route cannot do, with the reason."""
    require(adapter, "slicegpt" if options.slicing else "compress")
    where = f"on a LayerNorm decoder ({adapter.family})"
    if options.slicing:
        if options.sequential:
            raise ValueError(f"sequential SliceGPT {where} is not implemented: drop --sequential (one pass of the "
                             "original model, one global PCA of the centred stream)")
        if options.q_mode != "global":
            raise ValueError(f"SliceGPT {where} writes the RMS-decoder family, which has one basis for the whole "
                             "stream and no skip matrices: use --q-mode global (the default)")
        if options.allocation != "uniform":
            raise ValueError(f"SliceGPT {where} keeps one width for every segment: --allocation uniform")
    else:
        if options.sequential:
            raise ValueError(f"sequential calibration {where} is not implemented (the layer-wise engine would "
                             "replace the embedding without its position table): drop --sequential")
        if options.allocation != "uniform":
            raise ValueError(f"--allocation sensitivity {where} is not implemented: use --allocation uniform")
        if facts(adapter).parallel_block:     # attention and FFN both read the layer input
            if options.segment_rotations:
                raise ValueError(f"one rotation per residual segment {where}: {adapter.family} runs attention and "
                                 "FFN in parallel, so there is no segment between them: use --q-mode global")
            if options.weighted:
                raise ValueError(f"stage w {where}: {adapter.family} runs attention and FFN in parallel, and the "
                                 "calibration statistics of stage w are taken per sequential segment: use --stage f")
    _, _, rest = partition_keys(adapter, keys)
    if rest:
        raise ValueError(f"checkpoint has tensors compress does not know how to carry: {rest[:4]}")


def build(state: dict, config: dict, dtype: torch.dtype):
    """The RMS-decoder model holding ``state`` (strict), and its counted parameters (with the ±1 signs of
    orthogonal skips, as the compressed family counts them)."""
    from ....modeling.configuration_rms_decoder import RMSDecoderConfig
    from ....modeling.modeling_rms_decoder import RMSDecoderForCausalLM

    model = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(config)).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs"))
    return model.eval(), counted


def _run(source, config: dict, options: CompressOptions, calib_ids, sink, dtype, placement, progress):
    """Either route into ``sink`` (a :class:`DictSink` or a shard writer): (config dict, report)."""
    if options.slicing:
        return slice_tensors(source, config, options, calib_ids, sink, placement=placement, progress=progress)
    return structured_tensors(source, config, options, calib_ids, sink.add, dtype, placement=placement,
                              progress=progress)


def compress_layer_norm_model(model, options: CompressOptions, calib_ids: torch.Tensor | None = None,
                              progress: bool = False, width: int | None = None, placement=None):
    """In memory: a loaded OPT / GPT-2 / GPT-NeoX / GPT-J ``...ForCausalLM`` -> (RMSDecoderForCausalLM,
    report). ``width`` (SliceGPT only) overrides the planned residual width."""
    options.validate()
    dtype = next(model.parameters()).dtype
    source, config = DictSource({k: v.detach() for k, v in model.state_dict().items()}), model.config.to_dict()
    check(Adapter.from_config(config, source.keys()), options, source.keys())
    sink = DictSink()
    if width is not None:
        new_config, report = slice_tensors(source, config, options, calib_ids, sink, width=width,
                                           placement=placement, progress=progress)
    else:
        new_config, report = _run(source, config, options, calib_ids, sink, dtype, placement, progress)
    compressed, counted = build(dict(sink), new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return compressed, report


def compress_layer_norm_checkpoint(reader: CheckpointReader, out: str | Path, options: CompressOptions,
                                   calib_text, overwrite: bool = False, progress: bool = True, placement=None):
    """:func:`hf_symmetry.conversion.compress.compress_checkpoint` for LayerNorm decoders: every input
    checked before any work, the checkpoint read one layer at a time, ``out`` written atomically
    (weights, config, the RMS-decoder family's remote code, tokenizer, report, card)."""
    from ....evaluation.compare import load_tokenizer
    from ....text import read_text, tokenize_text
    from ..card import write_card
    from ..pipeline import _write_report

    options.validate()
    check_output_dir(out, overwrite)
    adapter = Adapter.from_config(reader.config, reader.keys())
    check(adapter, options, reader.keys())
    if options.slicing:                                           # an unreachable ratio fails here
        plan_width(adapter, reader, reader.keys(), options)
    else:
        layer_norm_plan(reader, reader.config, options)
    calib = read_text(calib_text) if calib_text is not None else None
    calib_ids = None
    if options.needs_calibration:
        if calib is None:
            raise ValueError(f"--calib is required for {options.label} (calibration text: a UTF-8 file or an "
                             "embedded name)")
        calib_ids = tokenize_text(load_tokenizer(reader.path), calib, max_tokens=options.calib_tokens)
        if calib_ids.numel() < 2:
            raise ValueError(f"calibration text {calib_text} has fewer than two tokens")
    dtype = reader.config.get("dtype") or reader.config.get("torch_dtype") or "float32"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, 2 * 10**9, metadata={"hf_symmetry": "compress"})
        counted = 0

        class _Counting:
            def add(self, tensors):
                nonlocal counted
                counted += sum(t.numel() for t in tensors.values())
                writer.add(tensors)
            add.row_blocks = True                   # the writer streams RowBlocks (Assembler.put)

        new_config, report = _run(reader, reader.config, options, calib_ids, _Counting(), dtype, placement, progress)
        writer.close()
        report.accounting["compressed_model_params_counted"] = counted
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


__all__ = ["CentredSource", "build", "centred_rotation", "check", "compress_layer_norm_checkpoint",
           "compress_layer_norm_model", "layer_norm_plan", "plan_structured", "plan_width", "slice_tensors",
           "sliced_params", "structured_tensors", "through_rms_decoder"]
