"""ProcrustesGPT (Kronecker sums, GS, low rank) on LayerNorm decoders, through the RMS-decoder family.

The centred model (:class:`.centred.CentredSource`) is an RMS-decoder model whose residual stream any
orthogonal ``Q`` rotates exactly, globally or per segment (orthogonal skips). The compressed family's
pipeline (:func:`..core.compress_into`) runs on it as on any source, written as the RMS-decoder family
(:class:`RMSDecoderStructures`). Added here: every linear keeps a dense bias (a writer's rotated with the
stream), the position table stays dense and rotates with the embedding's segment, and the head (untied by
the centring) keeps the final LayerNorm's β as its bias. The budget is the compressed family's, the untied
head of a tied source paid for."""

from __future__ import annotations

from dataclasses import replace

import torch

from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ...stream import partition_keys
from ..assemble import structure_entries
from ..core import Output, compress_into
from ..folded import FoldedLayers
from ..options import CompressOptions
from ..plan import (
    Plan,
    accounting,
    budget,
    check_ratio,
    dense_entries,
    in_policy,
    sized,
    source_numels,
)
from ..routes import CompressRun
from .centred import CentredSource


def plan_structured(centred: CentredSource, options: CompressOptions) -> Plan:
    """The structures of ``options`` on the centred model, sized so that the whole model meets the ratio
    (a preset: each compressed matrix keeps ``matrix_keep`` of its parameters)."""
    adapter, cfg = centred.adapter, centred.config
    d, L, tied = adapter.hidden, adapter.n_layers, adapter.tied_embeddings
    vocab = int(cfg["vocab_size"])
    # a bias on every linear, the head untied by the centring (its bias, the final LayerNorm's β, is carried)
    entries = dense_entries(adapter, cfg["intermediate_size"], vocab, lambda _: True, head=True)
    dense_total = source_numels(centred.source, tied)
    p_compressed, target = budget(entries, dense_total, options, tied)  # the head, untied here, pays for itself
    carried = centred.position_rows * d + vocab  # the position table and the head's bias, both dense
    skip = "orthogonal" if options.segment_rotations else "none"
    plan = Plan(adapter.family, d, d, L, skip, "separate", entries, carried=carried)
    struct_size = sum(e.structure.params() for e in entries if in_policy(e.canon, options))
    fixed = plan.params() - struct_size  # what stays dense: all but the policy's matrices, and the skips
    kappa = options.matrix_keep if options.matrix_keep is not None else (target - fixed) / struct_size
    if kappa <= 0:
        raise ValueError(
            f"ratio {options.ratio} cannot be met on {adapter.family}: what stays dense (V, biases, "
            f"positions{', skip rotations' if skip != 'none' else ''}) already needs {fixed:,} of "
            f"{target:,.0f} parameters; use a smaller ratio" + (" or --q-mode global" if skip != "none" else "")
        )
    kron_q, plan.matrices = sized(entries, options, d, kappa)
    acc = plan.accounting = accounting(
        plan,
        dense_total,
        p_compressed,
        target,
        options,
        uniform_keep=kappa,
        kron_factor=kron_q,
        untied_head_params=plan.by_name()["lm_head"].structure.params() if tied else 0,
        output_family=RMSDecoderConfig.model_type,
    )
    check_ratio(acc, options, adapter.family)
    return plan


class RMSDecoderStructures(Output):
    """What :func:`..core.compress_into` writes for a centred LayerNorm decoder: the RMS-decoder family, read
    from the centred source, plus what the plan's modules do not hold (the head's bias, the position table),
    written at the end."""

    streams = False

    def __init__(self, centred: CentredSource, source_config: dict):
        self.centred, self.source_config = centred, source_config

    def read(self, run: CompressRun, plan: Plan):
        writer = self.centred.writer
        _, per_layer, _ = partition_keys(writer, self.centred.keys())
        layers = FoldedLayers(self.centred, writer, per_layer)  # norm folding is a no-op: the norms have no weight
        return layers, self.centred.globals(), torch.ones(plan.hidden, dtype=torch.float64)

    def config(self, run: CompressRun, plan: Plan) -> dict:
        """The centred model's RMS-decoder config with each module's structure."""
        src = self.source_config
        cfg = {**self.centred.config, **structure_entries(plan, run.options, src.get("model_type"))}
        if src.get("dtype") or src.get("torch_dtype"):
            cfg["dtype"] = src.get("dtype") or src.get("torch_dtype")
        return cfg

    def finish(self, run: CompressRun, res, globals_) -> None:
        extras = {"lm_head.bias": globals_["lm_head.bias"]}
        if "pos0.weight" in globals_:  # the position table writes segment 0, as the embedding
            extras["pos0.weight"] = globals_["pos0.weight"] @ res.Qs[0]
        dtype = run.dtype
        tensors = self.centred.writer.write_globals(extras, {"": dtype})
        run.sink.add({k: v.to(dtype).contiguous() for k, v in tensors.items()})

    def method(self, run: CompressRun) -> str:
        return f"{run.options.label}, centred into the RMS-decoder family"


def structured_tensors(run: CompressRun):
    """The whole route of ``run`` into ``run.sink``: (RMS-decoder config dict, report); ``run`` may hand in
    the plan, the statistics and the starting rotations, as to :func:`..core.compress_into`."""
    centred = CentredSource(run.source, run.config)
    plan = run.plan if run.plan is not None else plan_structured(centred, run.options)
    centred_run = replace(run, source=centred, config=centred.config, plan=plan)
    new_config, report, _ = compress_into(centred_run, RMSDecoderStructures(centred, run.config))
    return new_config, report
