"""Step 1, the plan (no work yet): which matrices are compressed, into which structure and size.

The matrices are q, k, o, gate, up, down, the embedding and an untied head (V stays dense as in the paper).
Every route sizes on one budget (:func:`budget`): ``ratio`` is the fraction of those matrices' dense
parameters removed from the whole model, skip matrices, head mix or untied head paid for, so that every
method at one ratio has the same total. Sizes may also be non-uniform (``keep``, :mod:`.allocate`) or the
paper's fixed per-matrix size (the ``procrustesgpt-llama`` preset)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ...architectures import Adapter, UnsupportedSymmetry
from ...architectures.capabilities import require
from ...solvers import structures as st
from ..stream import TensorSource
from .options import LAYER_MODULES, SEGMENT_OFFSET, CompressOptions


@dataclass
class MatrixPlan:
    """One matrix as the solver sees it: ``M [k, d]``, the residual dimension on its columns (readers ``W``,
    writers ``Wᵀ``, embedding ``E``, head ``W_head``), in its planned structure."""

    name: str  # "layers.3.q_proj", "embed", "lm_head"
    canon: str  # canonical key ("q", ..., "embed", "lm_head")
    layer: int | None
    role: str  # reader | writer
    segment: int
    structure: st.Structure  # on M [k, d]
    bias: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """``M``'s shape in its structure (``[k, d]``; sliced: ``[k, d′]``)."""
        return self.structure.shape

    @property
    def module_structure(self) -> st.Structure:
        """The structure in the module's ``[out, in]`` orientation."""
        return self.structure if self.role == "reader" or self.canon == "embed" else self.structure.transpose()

    @property
    def compressed(self) -> bool:
        return not isinstance(self.structure, st.Dense)


@dataclass
class Accounting:
    """A compressed model's parameters against its source's (``compression_report.json``'s ``accounting``);
    the optional fields are those of one route."""

    dense_model_params: int
    compressed_model_params: int
    # removed parameters (norm weights, which fold away, included) per dense parameter of the
    # compressed matrices: equal for equal totals, whatever the method
    ratio_over_compressed: float
    ratio_over_model: float
    ratio_per_matrix_mean: float
    skip_params: int
    head_mix_params: int
    per_matrix: dict[str, dict]
    target_ratio: float | None = None  # None: a preset's fixed size
    target_params: int | None = None  # the total every allocation at these options must meet
    dense_params_of_compressed_matrices: int | None = None
    structured_params_of_compressed_matrices: int | None = None
    residual_sizes: list[int] | None = None
    uniform_keep: float | None = None
    kron_factor: int | None = None  # None: not Kronecker
    allocation: str | None = None  # "sensitivity" where the sizes were allocated
    allocation_report: dict | None = None
    untied_head_params: int | None = None
    output_family: str | None = None  # None: the compressed family
    hidden: int | None = None
    residual: int | None = None
    norm_params: int | None = None
    width_unrounded: int | None = None
    round_to: int | None = None  # None: a width given, not rounded
    stock_class: str | None = None
    norm_constant: float | None = None
    rms_norm_eps: float | None = None
    source_rms_norm_eps: float | None = None
    compressed_model_params_counted: int | None = None  # as the written model counts them

    @classmethod
    def of(cls, dense_total: int, total: int, p_compressed: int, kept: float, per_matrix: dict, **fields):
        """The accounting of a model of ``total`` parameters on the budget ``p_compressed``; ``kept``: the
        fraction of the compressed matrices' parameters their structures keep; ``fields``: the route's."""
        return cls(
            dense_model_params=dense_total,
            compressed_model_params=total,
            ratio_over_compressed=(dense_total - total) / p_compressed,
            ratio_per_matrix_mean=1 - kept,
            per_matrix=per_matrix,
            **{"ratio_over_model": 1 - total / dense_total, "skip_params": 0, "head_mix_params": 0, **fields},
        )

    def to_dict(self) -> dict:
        """The JSON record: the fields set; of those ``None``, only :data:`NULL_WHERE`'s."""
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None or (k in NULL_WHERE and d[NULL_WHERE[k]] is not None)}


#: the fields written as ``null`` where the field beside them is set (their route has them)
NULL_WHERE = {"target_ratio": "target_params", "kron_factor": "uniform_keep", "round_to": "stock_class"}


@dataclass
class Plan:
    family: str
    hidden: int
    residual: int  # width of the compressed residual stream (< hidden for SliceGPT)
    n_layers: int
    skip: str  # none | orthogonal | dense
    lm_head: str  # tied | tied_mixed | separate
    matrices: list[MatrixPlan]
    accounting: Accounting | None = None
    residual_sizes: list[int] | None = None  # per-segment widths (SliceGPT, one global Q), else None
    # parameters outside the planned matrices, kept as they are: QK-norm γ; a LayerNorm decoder's position
    # table and head bias
    carried: int = 0

    @property
    def tied(self) -> bool:  # the head is the embedding (mixed or not)
        return self.lm_head != "separate"

    @property
    def n_segments(self) -> int:
        return 2 * self.n_layers + 1

    def width(self, segment: int) -> int:
        """Width of residual segment ``segment`` in the compressed model."""
        return self.residual if self.residual_sizes is None else self.residual_sizes[segment]

    def layer_matrices(self, i: int) -> dict[str, MatrixPlan]:
        return {m.canon: m for m in self.matrices if m.layer == i}

    def by_name(self) -> dict[str, MatrixPlan]:
        return {m.name: m for m in self.matrices}

    def overhead(self, width=None) -> tuple[int, int]:
        """Parameters of the skip matrices (orthogonal: Cayley, d(d+1)/2 each; dense: one width, squared) and
        of the tied head's mix, where segment ``s`` is ``width(s)`` wide (default: the plan's widths)."""
        width, d, last = width or self.width, self.hidden, 2 * self.n_layers
        skip = {"orthogonal": d * (d + 1) // 2, "dense": width(0) * width(0), "none": 0}[self.skip]
        return last * skip, width(0) * width(last) if self.lm_head == "tied_mixed" else 0

    def params(self, width=None) -> int:
        """The compressed model's parameters: the matrices, the overhead and the carried."""
        return params_at(self.matrices, width or self.width) + sum(self.overhead(width)) + self.carried


def check_family(config: dict, keys: list[str]) -> Adapter:
    """The adapter of a checkpoint the compressed family can express, or the structural reason not."""
    adapter = Adapter.from_config(config, keys)
    require(adapter, "compress")
    if adapter.spec.norm_kind == "layer":  # compressed, but through the RMS-decoder family (.layernorm_decoders)
        raise UnsupportedSymmetry(
            f"compress: {adapter.family} uses LayerNorm and the compressed family is "
            "RMSNorm-based (compress_model / compress_checkpoint write it as the RMS-decoder "
            "family)"
        )
    return adapter


def dense_entries(adapter: Adapter, intermediate: int, vocab: int, bias, head: bool) -> list[MatrixPlan]:
    """Every matrix, dense: each layer's ``M [k, d]`` (the gate where the FFN is gated; a bias where
    ``bias(key)``), the embedding and, where ``head``, an untied head."""
    d, n_layers, L = adapter.hidden, adapter.n_layers, adapter.layout
    q, kv, inter = L.n_heads * L.head_dim, L.n_kv_heads * L.head_dim, intermediate
    rows = {"q": q, "k": kv, "v": kv, "o": q, "gate": inter, "up": inter, "down": inter}
    if not adapter.spec.is_gated:
        del rows["gate"]
    entries = []
    for i in range(n_layers):
        for c, k in rows.items():
            module, role = LAYER_MODULES[c]
            name = f"layers.{i}.{module.split('.')[1]}"
            entries.append(MatrixPlan(name, c, i, role, 2 * i + SEGMENT_OFFSET[c], st.Dense((k, d)), bias(c)))
    entries.append(MatrixPlan("embed", "embed", None, "writer", 0, st.Dense((vocab, d))))
    if head:
        entries.append(MatrixPlan("lm_head", "lm_head", None, "reader", 2 * n_layers, st.Dense((vocab, d))))
    return entries


def matrix_entries(config: dict, keys: list[str], adapter: Adapter) -> list[MatrixPlan]:
    """Every matrix of an RMSNorm checkpoint before its structure is chosen (dense)."""
    keyset = set(keys)

    def bias(canon):
        return f"{adapter.layer_prefix(0)}{LAYER_MODULES[canon][0]}.bias" in keyset

    inter, vocab = int(config.get("intermediate_size")), int(config["vocab_size"])
    return dense_entries(adapter, inter, vocab, bias, not adapter.tied_embeddings)


def carried_params(adapter: Adapter) -> int:
    """The QK-norm γ (q_norm, k_norm of every layer), kept as they are."""
    return 2 * adapter.n_layers * adapter.layout.head_dim if adapter.layout.qk_norm else 0


def in_policy(canon: str, options: CompressOptions) -> bool:
    """Compressed under the ProcrustesGPT policy (also the budget SliceGPT's ratio is measured on)."""
    if canon in ("embed", "lm_head"):
        return options.compress_embeddings
    return canon not in options.dense_modules


def budget(entries, dense_total: int, options: CompressOptions, tied: bool, counted=None) -> tuple[int, float]:
    """``(p_compressed, target)``: the dense parameters of the matrices the ratio is measured on (``counted``,
    default :func:`in_policy`; a tied head once) and the total it asks for, ``dense_total − ratio · p``."""
    counted = counted or (lambda e: in_policy(e.canon, options))
    p = sum(e.shape[0] * e.shape[1] for e in entries if counted(e) and not (tied and e.canon == "lm_head"))
    return p, dense_total - options.ratio * p


def check_ratio(acc: Accounting, options: CompressOptions, family: str, hint: str = "") -> None:
    """Refuse a plan whose ratio misses ``options.ratio`` by more than its slack (a preset has no ratio)."""
    achieved = acc.ratio_over_compressed
    if options.matrix_keep is None and abs(achieved - options.ratio) > options.ratio_slack:
        raise ValueError(
            f"no {options.structure_name} configuration meets ratio {options.ratio:g} within "
            f"{options.ratio_slack:g} on {family} (nearest: {achieved:.4f})"
            + ("; try another --kron-factor" if acc.kron_factor is not None else hint)
        )


def structure_for(options: CompressOptions, e: MatrixPlan, kappa: float, factor: int | None) -> st.Structure:
    """The structure of ``options.structure`` on ``e``'s ``M [k, d]`` keeping about ``kappa`` of its parameters
    (``kappa >= 1``: dense); ``factor``: the split every matrix of the plan shares (the Kronecker ``q``)."""
    if kappa >= 1.0:
        return st.Dense(e.shape)
    embedding = e.canon in ("embed", "lm_head")
    return options.structure_class.sized(
        e.shape, kappa, factor=factor, blocks=options.gs_blocks, embedding=embedding, name=e.name
    )


def sized(entries, options: CompressOptions, d: int, kappa: float, keep: dict[str, float] | None = None):
    """``(kron_q, matrices)``: the policy's matrices in ``options``' structure keeping ``kappa`` of their
    parameters (``keep``'s fraction where it names one), the others dense."""
    kron_q = options.structure_class.plan_factor(d, kappa, options.kron_factor)

    def structure(e: MatrixPlan) -> st.Structure:
        if not in_policy(e.canon, options):
            return e.structure
        return structure_for(options, e, kappa if keep is None else keep.get(e.name, kappa), kron_q)

    return kron_q, [replace(e, structure=structure(e)) for e in entries]


def params_at(matrices: list[MatrixPlan], width) -> int:
    """Parameters of ``matrices`` where segment ``s`` is ``width(s)`` wide: a structured matrix's own, a dense
    one's rows × the width, and its bias (a reader's whole, a writer's at the width)."""
    total = 0
    for m in matrices:
        k, w = m.shape[0], width(m.segment)
        total += (k * w if isinstance(m.structure, st.Dense) else m.structure.params()) + (
            (k if m.role == "reader" else w) if m.bias else 0
        )
    return total


def matrix_entry(structure: dict, params: int, dense: int) -> dict:
    """One matrix as :attr:`Accounting.per_matrix` lists it: its structure, parameters and dense parameters."""
    return {"structure": structure, "params": params, "dense_params": dense, "ratio": 1 - params / dense}


def sliced_entry(k: int, d: int, w: int) -> dict:
    """A dense matrix of ``k`` rows sliced from width ``d`` to ``w``."""
    return matrix_entry({"type": "dense", "width": w}, k * w, k * d)


def nearest_width(params, target: float, widths) -> int:
    """The width among ``widths`` whose ``params(w)`` is closest to ``target`` (the first on a tie)."""
    return min(widths, key=lambda w: abs(params(w) - target))


def segment_widths(keep: dict[str, float], d: int, n_layers: int) -> list[int]:
    """Per-segment widths from SliceGPT's ``keep`` map (``segment{k}`` → fraction of ``d``)."""
    n_seg = 2 * n_layers + 1
    missing = [k for k in range(n_seg) if f"segment{k}" not in keep]
    if missing:
        raise ValueError(f"per-segment widths lack segments {missing[:4]}")
    widths = [int(round(keep[f"segment{k}"] * d)) for k in range(n_seg)]
    if not all(1 <= w <= d for w in widths):
        raise ValueError(f"segment widths must be in [1, {d}], got {widths}")
    return widths


def plan_compression(
    config: dict,
    keys: list[str],
    dense_total: int,
    final_gamma: torch.Tensor | None,
    options: CompressOptions,
    keep: dict[str, float] | None = None,
) -> Plan:
    """Every structure, before any work (ValueError for what cannot be done). ``keep`` (name → fraction of
    its parameters kept; 1 = dense) replaces the ratio's uniform size; for SliceGPT, ``segment{k}`` → the
    fraction of ``d`` kept in segment ``k`` (one global rotation: no skip matrices)."""
    options.validate()
    adapter = check_family(config, keys)
    d, n_layers, tied = adapter.hidden, adapter.n_layers, adapter.tied_embeddings
    entries = matrix_entries(config, keys, adapter)
    p_compressed, target = budget(entries, dense_total, options, tied)
    segment = options.segment_rotations
    plan = Plan(adapter.family, d, d, n_layers, "none", "separate", entries, carried=carried_params(adapter))
    kappa = kron_q = None
    if options.slicing:
        plan.skip, plan.lm_head = "dense" if segment else "none", "tied_mixed" if tied else "separate"
        if keep is None:  # the ratio's one width (the entries are dense: their count scales with it)
            widths = [nearest_width(lambda w: plan.params(lambda _: w), target, range(1, d + 1))] * plan.n_segments
        elif segment:
            raise ValueError("per-segment SliceGPT widths need one global rotation (--q-mode global)")
        else:
            widths = segment_widths(keep, d, n_layers)
        plan.matrices = [replace(e, structure=st.Dense((e.shape[0], widths[e.segment]))) for e in entries]
        plan.residual, plan.residual_sizes = max(widths), None if len(set(widths)) == 1 else widths
    else:
        gamma_is_one = final_gamma is None or bool(torch.all(final_gamma == 1))
        plan.skip = "orthogonal" if segment else "none"
        if tied:
            plan.lm_head = "tied" if gamma_is_one and not segment else "tied_mixed"
        kappa = options.matrix_keep  # the paper's fixed size per matrix, overheads on top
        if kappa is None:
            overhead = sum(plan.overhead()) + plan.carried
            kappa = ((1 - options.ratio) * p_compressed - overhead) / p_compressed
            if kappa <= 0:
                raise ValueError(
                    f"ratio {options.ratio} cannot be met: the skip/head matrices alone need "
                    f"{overhead:,} parameters of the {(1 - options.ratio) * p_compressed:,.0f} left; "
                    "use a smaller ratio or --q-mode global"
                )
        kron_q, plan.matrices = sized(entries, options, d, kappa, keep)
    allocation = None if keep is None else "sensitivity"
    acc = plan.accounting = accounting(
        plan, dense_total, p_compressed, target, options, uniform_keep=kappa, kron_factor=kron_q, allocation=allocation
    )
    check_ratio(acc, options, adapter.family)
    return plan


def accounting(plan: Plan, dense_total: int, p_compressed: int, target: float, options: CompressOptions, **fields):
    """The :class:`Accounting` of ``plan`` on the budget ``(p_compressed, target)``; ``fields``: the route's."""
    d, (skips, mix), total = plan.hidden, plan.overhead(), plan.params()
    structured = sum(m.structure.params() for m in plan.matrices if in_policy(m.canon, options))
    per_matrix = {
        m.name: matrix_entry(m.module_structure.entry(), m.structure.params(), m.shape[0] * d) for m in plan.matrices
    }
    ratio = options.matrix_keep is None  # else the preset's fixed size: its own total is the target
    return Accounting.of(
        dense_total,
        total,
        p_compressed,
        structured / p_compressed,
        per_matrix,
        skip_params=skips,
        head_mix_params=mix,
        target_ratio=options.ratio if ratio else None,
        target_params=round(target) if ratio else total,
        dense_params_of_compressed_matrices=p_compressed,
        structured_params_of_compressed_matrices=structured,
        residual_sizes=None if plan.residual_sizes is None else list(plan.residual_sizes),
        **fields,
    )


def source_numels(source: TensorSource, tied: bool) -> int:
    """Parameters of the source model (tied weights once)."""
    shapes = source.shapes()
    return sum(math.prod(shape) for k, shape in shapes.items() if not (tied and k == "lm_head.weight"))


def final_gamma(source: TensorSource, adapter: Adapter) -> torch.Tensor:
    name = f"{adapter.prefix}{adapter.spec.final_norm}.weight"
    return source.get([name])[name].to(torch.float64)


def plan_for(
    source: TensorSource, config: dict, options: CompressOptions, keep: dict[str, float] | None = None
) -> tuple[Plan, Adapter]:
    keys = source.keys()
    adapter = check_family(config, keys)
    dense_total = source_numels(source, adapter.tied_embeddings)
    return plan_compression(config, keys, dense_total, final_gamma(source, adapter), options, keep), adapter
