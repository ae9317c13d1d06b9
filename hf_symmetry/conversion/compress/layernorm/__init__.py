"""``compress`` on LayerNorm decoders (OPT, GPT-2, GPT-NeoX, GPT-J), through the RMS-decoder family.

The compressed family is a Llama (gated FFN, RoPE, no learned positions, no biases), so a LayerNorm
decoder is compressed into the RMS-decoder family (:mod:`hf_symmetry.modeling.modeling_rms_decoder`)
instead, after centring: every writer to the residual stream is mean-centred and each LayerNorm folded
into its readers, which leaves the function unchanged and makes the stream rotatable. The steps:

- :mod:`.centred` — the centred model as a tensor source, one layer at a time from the checkpoint;
- :mod:`.slice` — SliceGPT: one global PCA of the centred stream, the stream sliced;
- :mod:`.structured` — ProcrustesGPT (Kronecker sums, GS, low rank): the compressed family's plan,
  solvers and assembly on the centred model, biases and the position table kept dense;
- :mod:`.checks` — what this route refuses, before any work;
- here: the entry points on a loaded model and on a checkpoint folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ....architectures import Adapter
from ....checkpoint_io import CheckpointReader, ShardedWriter, atomic_output_dir, check_output_dir, write_config
from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ....modeling.modeling_rms_decoder import RMSDecoderForCausalLM
from ...rms_decoder import copy_remote_code
from ...stream import DictSink, DictSource
from ..moments import read_calibration
from ..options import CompressOptions
from ..report import finish_folder
from .centred import CentredSource
from .checks import check, through_rms_decoder
from .slice import centred_rotation, plan_width, slice_tensors, sliced_params
from .structured import layer_norm_plan, plan_structured, structured_tensors


def build(state: dict, config: dict, dtype: torch.dtype):
    """The RMS-decoder model holding ``state`` (strict), and its counted parameters (with the ±1 signs of
    orthogonal skips, as the compressed family counts them)."""
    model = RMSDecoderForCausalLM(RMSDecoderConfig.from_dict(config)).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("skip_signs")
    )
    return model.eval(), counted


def _run(source, config: dict, options: CompressOptions, calib_ids, sink, dtype, placement, progress):
    """Either route into ``sink`` (a :class:`DictSink` or a shard writer): (config dict, report)."""
    if options.slicing:
        return slice_tensors(source, config, options, calib_ids, sink, placement=placement, progress=progress)
    return structured_tensors(
        source, config, options, calib_ids, sink.add, dtype, placement=placement, progress=progress
    )


def compress_layer_norm_model(
    model,
    options: CompressOptions,
    calib_ids: torch.Tensor | None = None,
    progress: bool = False,
    width: int | None = None,
    placement=None,
):
    """In memory: a loaded OPT / GPT-2 / GPT-NeoX / GPT-J ``...ForCausalLM`` -> (RMSDecoderForCausalLM,
    report). ``width`` (SliceGPT only) overrides the planned residual width."""
    options.validate()
    dtype = next(model.parameters()).dtype
    source, config = DictSource({k: v.detach() for k, v in model.state_dict().items()}), model.config.to_dict()
    check(Adapter.from_config(config, source.keys()), options, source.keys())
    sink = DictSink()
    if width is not None:
        new_config, report = slice_tensors(
            source, config, options, calib_ids, sink, width=width, placement=placement, progress=progress
        )
    else:
        new_config, report = _run(source, config, options, calib_ids, sink, dtype, placement, progress)
    compressed, counted = build(dict(sink), new_config, dtype)
    report.accounting["compressed_model_params_counted"] = counted
    return compressed, report


def compress_layer_norm_checkpoint(
    reader: CheckpointReader,
    out: str | Path,
    options: CompressOptions,
    calib_text,
    overwrite: bool = False,
    progress: bool = True,
    placement=None,
):
    """:func:`hf_symmetry.conversion.compress.compress_checkpoint` for LayerNorm decoders: every input
    checked before any work, the checkpoint read one layer at a time, ``out`` written atomically
    (weights, config, the RMS-decoder family's remote code, tokenizer, report, card)."""
    options.validate()
    check_output_dir(out, overwrite)
    adapter = Adapter.from_config(reader.config, reader.keys())
    check(adapter, options, reader.keys())
    if options.slicing:  # an unreachable ratio fails here
        plan_width(adapter, reader, reader.keys(), options)
    else:
        layer_norm_plan(reader, reader.config, options)
    calib_ids = read_calibration(reader.path, calib_text, options)
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

            add.row_blocks = True  # the writer streams RowBlocks (Assembler.put)

        new_config, report = _run(reader, reader.config, options, calib_ids, _Counting(), dtype, placement, progress)
        writer.close()
        write_config(tmp, new_config)
        copy_remote_code(tmp)
        finish_folder(tmp, report, options, reader.path, reader.path, out, counted)
    return report


__all__ = [
    "CentredSource",
    "build",
    "centred_rotation",
    "check",
    "compress_layer_norm_checkpoint",
    "compress_layer_norm_model",
    "layer_norm_plan",
    "plan_structured",
    "plan_width",
    "slice_tensors",
    "sliced_params",
    "structured_tensors",
    "through_rms_decoder",
]
