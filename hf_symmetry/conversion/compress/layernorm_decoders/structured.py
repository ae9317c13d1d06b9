"""ProcrustesGPT (Kronecker sums, GS, low rank) on LayerNorm decoders, through the RMS-decoder family.

The centred model (:class:`.centred.CentredSource`: every writer mean-centred, each LayerNorm folded into
its readers) is an RMS-decoder model whose residual stream any orthogonal ``Q`` rotates exactly, one
global ``Q`` or one per residual segment (the skip connections then carry ``Q_prevᵀ Q_next``). From there
the compressed family's own pipeline runs on it as on any source (:func:`..core.compress_into`): the
plan's structures (:func:`..plan.structure_for`), calibration on the layer-wise engine (the centred model's
normalised stream measured directly), the solvers (stage F / W, :func:`..solve.solve`) and the assembly of
factors and rotations (:class:`..assemble.Assembler`, whose module names the RMS-decoder family shares),
written as the RMS-decoder family (:class:`RMSDecoderStructures`). What the compressed family's plan does
not know is added here: every linear keeps a dense bias (readers' biases unchanged,
writers' rotated with the stream), the learned position table stays dense and rotates with the
embedding's segment, and the head (untied by the centring) keeps the final LayerNorm's β as its bias.

Parameter accounting as the compressed family's: ``ratio`` is the fraction of the parameters of the
compressed matrices (q, k, o, up, down, embedding, and the head where the source has its own; V dense as in
the paper) removed from the whole model, skip matrices and the untied head of a tied source included, so
equal ratios mean equal total parameter counts."""

from __future__ import annotations

from dataclasses import replace

import torch

from ....architectures import Adapter
from ....modeling.configuration_rms_decoder import RMSDecoderConfig
from ....solvers import structures as st
from ...stream import TensorSource, partition_keys
from ..assemble import structure_entries
from ..core import Output, compress_into
from ..folded import FoldedLayers
from ..options import LAYER_MODULES, SEGMENT_OFFSET, CompressOptions
from ..plan import (
    MatrixPlan,
    Plan,
    accounting,
    in_policy,
    rotation_overhead,
    shared_factor,
    source_numels,
    structure_for,
)
from ..routes import CompressRun
from .centred import CentredSource

Tensors = dict[str, torch.Tensor]
CANONICAL = ("q", "k", "v", "o", "up", "down")


def _entries(centred: CentredSource) -> list[MatrixPlan]:
    """Every linear of the centred model, dense, as :func:`..plan.matrix_entries` gives the compressed
    family's (the embedding and head last: no bias of their own here)."""
    adapter, cfg = centred.adapter, centred.config
    d, L = adapter.hidden, adapter.n_layers
    inner = cfg["num_attention_heads"] * cfg["head_dim"]
    k_of = {
        "q": inner,
        "k": inner,
        "v": inner,
        "o": inner,
        "up": cfg["intermediate_size"],
        "down": cfg["intermediate_size"],
    }
    entries = [
        MatrixPlan(
            f"layers.{i}.{LAYER_MODULES[c][0].split('.')[1]}",
            c,
            i,
            LAYER_MODULES[c][1],
            2 * i + SEGMENT_OFFSET[c],
            st.Dense((k_of[c], d)),
            True,
        )
        for i in range(L)
        for c in CANONICAL
    ]
    vocab = int(cfg["vocab_size"])
    return entries + [
        MatrixPlan("embed", "embed", None, "writer", 0, st.Dense((vocab, d))),
        MatrixPlan("lm_head", "lm_head", None, "reader", 2 * L, st.Dense((vocab, d))),
    ]


def plan_structured(centred: CentredSource, dense_total: int, options: CompressOptions) -> Plan:
    """The structures of ``options`` on the centred model, sized so that the whole model meets the ratio
    (or, with a preset, each compressed matrix keeps ``matrix_keep`` of its parameters)."""
    adapter, cfg = centred.adapter, centred.config
    d, L = adapter.hidden, adapter.n_layers
    entries = _entries(centred)
    vocab = int(cfg["vocab_size"])
    tied = adapter.tied_embeddings
    # the budget, as the compressed family's: a tied head counts once (here it is untied, and pays for it)
    compressed = [e for e in entries if in_policy(e.canon, options)]
    p_compressed = sum(e.structure.params() for e in compressed if not (tied and e.canon == "lm_head"))
    struct_size = sum(e.structure.params() for e in compressed)
    rows = int(cfg["max_position_embeddings"] + cfg["position_offset"]) if not cfg.get("rotary") else 0
    extra = rows * d + vocab  # the position table and the head's bias, both dense
    skip = "orthogonal" if options.segment_rotations else "none"
    fixed = (
        sum(e.structure.params() for e in entries if not in_policy(e.canon, options))
        + sum(e.shape[0] if e.role == "reader" else d for e in entries if e.bias)
        + extra
        + rotation_overhead(d, L, options.segment_rotations, "separate")
    )
    target = dense_total - options.ratio * p_compressed
    kappa = options.matrix_keep if options.matrix_keep is not None else (target - fixed) / struct_size
    if kappa <= 0:
        raise ValueError(
            f"ratio {options.ratio} cannot be met on {adapter.family}: what stays dense (V, biases, "
            f"positions{', skip rotations' if skip != 'none' else ''}) already needs {fixed:,} of "
            f"{target:,.0f} parameters; use a smaller ratio" + (" or --q-mode global" if skip != "none" else "")
        )
    kron_q = shared_factor(options, d, kappa)
    embedding = ("embed", "lm_head")
    matrices = [
        replace(e, structure=structure_for(options, e.name, *e.shape, kappa, kron_q, e.canon in embedding))
        if in_policy(e.canon, options)
        else e
        for e in entries
    ]
    plan = Plan(adapter.family, d, d, L, False, skip, "separate", matrices)
    acc = plan.accounting = accounting(plan, dense_total, p_compressed, options)
    total = acc.compressed_model_params + extra
    acc.compressed_model_params = total
    acc.ratio_over_compressed = (dense_total - total) / p_compressed
    acc.ratio_over_model = 1 - total / dense_total
    acc.uniform_keep, acc.kron_factor = kappa, kron_q
    acc.target_params = round(target) if options.matrix_keep is None else total
    acc.untied_head_params = plan.by_name()["lm_head"].structure.params() if tied else 0
    acc.output_family = RMSDecoderConfig.model_type
    if options.matrix_keep is None and abs(acc.ratio_over_compressed - options.ratio) > options.ratio_slack:
        raise ValueError(
            f"no {options.structure} configuration meets ratio {options.ratio:g} within "
            f"{options.ratio_slack:g} on {adapter.family} (nearest: {acc.ratio_over_compressed:.4f})"
            + ("; try another --kron-factor" if kron_q is not None else "")
        )
    return plan


def structured_config(centred: CentredSource, plan: Plan, options: CompressOptions, source_config: dict) -> dict:
    """The RMS-decoder config of the compressed model: the centred model's, plus each module's structure."""
    cfg = {**centred.config, **structure_entries(plan, options, source_config.get("model_type"))}
    if source_config.get("dtype") or source_config.get("torch_dtype"):
        cfg["dtype"] = source_config.get("dtype") or source_config.get("torch_dtype")
    return cfg


class RMSDecoderStructures(Output):
    """What :func:`..core.compress_into` writes for the centred model of a LayerNorm decoder: the RMS-decoder
    family (its config: :func:`structured_config`), the layers and globals read from the centred source (no
    norm to fold), and what the plan's modules do not hold: the head's bias (the final LayerNorm's β) and
    the position table, which writes segment 0 as the embedding does. Written at the end, not as each
    segment is solved."""

    streams = False

    def __init__(self, centred: CentredSource, source_config: dict):
        self.centred, self.source_config = centred, source_config

    def read(self, run: CompressRun, plan: Plan):
        writer = self.centred.writer
        _, per_layer, _ = partition_keys(writer, self.centred.keys())
        layers = FoldedLayers(self.centred, writer, per_layer)  # norm folding is a no-op: the norms have no weight
        return layers, self.centred.globals(), torch.ones(plan.hidden, dtype=torch.float64)

    def config(self, run: CompressRun, plan: Plan) -> dict:
        return structured_config(self.centred, plan, run.options, self.source_config)

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
    """The whole route of ``run`` (a :class:`..routes.CompressRun`) into ``run.sink`` (in ``run.dtype``):
    (RMS-decoder config dict, report). The centred model (:class:`.centred.CentredSource`) goes through the
    compressed family's pipeline (:func:`..core.compress_into`) with this route's plan
    (:func:`plan_structured`) and output (:class:`RMSDecoderStructures`); ``run`` may hand in the planned
    structures, the measured statistics and the starting rotations, as there."""
    source, config = run.source, run.config
    centred = CentredSource(source, config)
    plan = run.plan
    if plan is None:
        dense_total = source_numels(source, source.keys(), centred.adapter.tied_embeddings)
        plan = plan_structured(centred, dense_total, run.options)
    centred_run = replace(run, source=centred, config=centred.config, plan=plan)
    new_config, report, _ = compress_into(centred_run, RMSDecoderStructures(centred, config))
    return new_config, report


def layer_norm_plan(source: TensorSource, config: dict, options: CompressOptions) -> Plan:
    """The plan alone (tests, dry runs): reads layer 0 and the checkpoint's shapes."""
    centred = CentredSource(source, config)
    return plan_structured(
        centred, source_numels(source, source.keys(), Adapter.from_config(config).tied_embeddings), options
    )
