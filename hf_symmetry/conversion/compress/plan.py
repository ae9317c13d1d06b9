"""Step 1, the plan (no work yet): which matrices are compressed, into which structure and size.

The matrices are q, k, o, gate, up, down, the embedding and an untied head (V stays dense as in the
paper). Sizes meet ``ratio`` — the fraction of those matrices' parameters removed, *after* paying for
skip-connection matrices and the head's change of basis, so that every method compared at one ratio has
the same total parameter count. A :class:`Plan` can also carry non-uniform sizes (``keep``: the fraction
of each matrix's parameters kept, see :mod:`.allocate`) or the paper's fixed per-matrix size (the
``procrustesgpt-llama`` preset)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from safetensors import safe_open

from ...architectures import Adapter, UnsupportedSymmetry
from ...architectures.capabilities import require
from ...solvers import structures as st
from ..stream import DictSource, TensorSource
from .options import LAYER_MODULES, SEGMENT_OFFSET, CompressOptions


@dataclass
class MatrixPlan:
    """One matrix as the solver sees it: ``M [k, d]`` with the residual dimension on its columns
    (readers ``W``, writers ``Wᵀ``, embedding ``E``, head ``W_head``), in its planned structure (before its
    structure is chosen, :func:`matrix_entries`: dense)."""

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
    """A compressed model's parameters against its source's (``compression_report.json``'s ``accounting``).
    The ratio's budget is the dense parameters of the matrices the ratio is measured on; the optional
    fields are those of one route: the structured classes' size (``uniform_keep``, ``kron_factor``), a
    sensitivity allocation, a family other than the compressed one (``output_family``, the stock width's
    rounding and norm constant, an untied head)."""

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

    def to_dict(self) -> dict:
        """The JSON record: the fields of this route; ``None`` ones are left out, except those that say
        "none" where their route has them (:data:`NULL_WHERE`)."""
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
    tied: bool
    skip: str  # none | orthogonal | dense
    lm_head: str  # tied | tied_mixed | separate
    matrices: list[MatrixPlan]
    accounting: Accounting | None = None
    residual_sizes: list[int] | None = None  # per-segment widths (SliceGPT, one global Q), else None
    carried: int = 0  # parameters kept as they are (QK-norm γ), counted in the model's total

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


def check_family(config: dict, keys: list[str]) -> Adapter:
    """The adapter of a checkpoint the compressed family can express, or the structural reason it
    cannot (:func:`hf_symmetry.architectures.capabilities.require`), before any work."""
    adapter = Adapter.from_config(config, keys)
    require(adapter, "compress")
    if adapter.spec.norm_kind == "layer":  # compressed, but through the RMS-decoder family (.layernorm_decoders)
        raise UnsupportedSymmetry(
            f"compress: {adapter.family} uses LayerNorm and the compressed family is "
            "RMSNorm-based (compress_model / compress_checkpoint write it as the RMS-decoder "
            "family)"
        )
    return adapter


# ---------------------------------------------------------------------------------------------
# structure sizes
# ---------------------------------------------------------------------------------------------
def shared_factor(options: CompressOptions, d: int, kappa: float) -> int | None:
    """The split every matrix of a plan shares (the Kronecker ``q``, :meth:`.Structure.plan_factor`;
    ``None`` for the other classes and SliceGPT)."""
    cls = options.structure_class
    return None if cls is None else cls.plan_factor(d, kappa, options.kron_factor)


def structure_for(
    options: CompressOptions, name: str, k: int, d: int, kappa: float, factor: int | None, embedding: bool
) -> st.Structure:
    """The structure of ``options.structure`` on ``M [k, d]`` keeping about ``kappa`` of its parameters
    (``kappa >= 1``: dense); ``factor``: the plan's :func:`shared_factor`."""
    if kappa >= 1.0:
        return st.Dense((k, d))
    return options.structure_class.sized(
        (k, d), kappa, factor=factor, blocks=options.gs_blocks, embedding=embedding, name=name
    )


def _matrix_shapes(adapter: Adapter, config: dict) -> dict[str, tuple[int, int]]:
    """``M [k, d]`` shapes of the canonical layer matrices."""
    L, d = adapter.layout, adapter.hidden
    inter = int(config.get("intermediate_size"))
    q_out, kv_out = L.n_heads * L.head_dim, L.n_kv_heads * L.head_dim
    return {
        "q": (q_out, d),
        "k": (kv_out, d),
        "v": (kv_out, d),
        "o": (q_out, d),
        "gate": (inter, d),
        "up": (inter, d),
        "down": (inter, d),
    }


def matrix_entries(config: dict, keys: list[str], adapter: Adapter) -> list[MatrixPlan]:
    """Every matrix of the checkpoint before its structure is chosen (dense)."""
    keyset = set(keys)
    shapes = _matrix_shapes(adapter, config)
    vocab = int(config["vocab_size"])
    d = adapter.hidden

    def bias(canon):
        return f"{adapter.layer_prefix(0)}{LAYER_MODULES[canon][0]}.bias" in keyset

    entries = [
        MatrixPlan(
            f"layers.{i}.{LAYER_MODULES[c][0].split('.')[1]}",
            c,
            i,
            LAYER_MODULES[c][1],
            2 * i + SEGMENT_OFFSET[c],
            st.Dense(shapes[c]),
            bias(c),
        )
        for i in range(adapter.n_layers)
        for c in LAYER_MODULES
    ]
    entries.append(MatrixPlan("embed", "embed", None, "writer", 0, st.Dense((vocab, d))))
    if not adapter.tied_embeddings:
        entries.append(MatrixPlan("lm_head", "lm_head", None, "reader", 2 * adapter.n_layers, st.Dense((vocab, d))))
    return entries


def in_policy(canon: str, options: CompressOptions) -> bool:
    """Compressed under the ProcrustesGPT policy (also the budget SliceGPT's ratio is measured on)."""
    if canon in ("embed", "lm_head"):
        return options.compress_embeddings
    return canon not in options.dense_modules


def plan_compression(
    config: dict,
    keys: list[str],
    dense_total: int,
    final_gamma: torch.Tensor | None,
    options: CompressOptions,
    keep: dict[str, float] | None = None,
) -> Plan:
    """Decide every structure before any work; raises ValueError for what cannot be done.

    ``keep`` (name → fraction of that matrix's parameters kept; 1 = dense) replaces the uniform size of
    the ratio: non-uniform allocations (:mod:`.allocate`), checked against the ratio like uniform ones.
    For SliceGPT its keys are ``segment{k}`` and its values the fraction of the hidden size kept in
    residual segment ``k`` (one global rotation: per-segment widths need no skip matrices)."""
    options.validate()
    adapter = check_family(config, keys)
    d, n_layers = adapter.hidden, adapter.n_layers
    tied = adapter.tied_embeddings
    entries = matrix_entries(config, keys, adapter)
    segment = options.segment_rotations
    p_compressed = sum(e.shape[0] * e.shape[1] for e in entries if in_policy(e.canon, options))
    target_total = dense_total - options.ratio * p_compressed
    gamma_is_one = final_gamma is None or bool(torch.all(final_gamma == 1))
    carried = 2 * n_layers * adapter.layout.head_dim if adapter.layout.qk_norm else 0  # q_norm, k_norm γ

    widths = kron_q = kappa = None
    if options.slicing:
        residual, widths, structures = _slice_structures(entries, adapter, segment, target_total - carried, keep)
        skip = "dense" if segment else "none"
        lm_head = "tied_mixed" if tied else "separate"
    else:
        residual = d
        skip = "orthogonal" if segment else "none"
        lm_head = ("tied" if gamma_is_one and not segment else "tied_mixed") if tied else "separate"
        overhead = rotation_overhead(d, n_layers, segment, lm_head) + carried
        kappa, kron_q, structures = _class_structures(entries, options, d, p_compressed, overhead, keep)
    matrices = [replace(e, structure=structures[e.name]) for e in entries]
    plan = Plan(
        adapter.family,
        d,
        residual,
        n_layers,
        tied,
        skip,
        lm_head,
        matrices,
        residual_sizes=None if widths is None or len(set(widths)) == 1 else widths,
        carried=carried,
    )
    if widths is not None and plan.residual_sizes is None:
        plan.residual = widths[0]
    acc = plan.accounting = accounting(plan, dense_total, p_compressed, options)
    # the total every allocation at these options must meet: the ratio's, or the preset's uniform size
    acc.target_params = round(target_total) if options.matrix_keep is None else acc.compressed_model_params
    acc.uniform_keep, acc.kron_factor = kappa, kron_q
    if keep is not None:
        acc.allocation = "sensitivity"
    achieved = acc.ratio_over_compressed
    if options.matrix_keep is None and abs(achieved - options.ratio) > options.ratio_slack:
        raise ValueError(
            f"no {options.structure} configuration meets ratio {options.ratio:g} within "
            f"{options.ratio_slack:g} (nearest: {achieved:.4f})"
            + ("; try another --kron-factor" if kron_q is not None else "")
        )
    return plan


def _slice_structures(entries, adapter, segment: bool, budget: float, keep: dict[str, float] | None):
    """SliceGPT's residual width, per-segment widths (``None``: one width, the ratio's) and dense
    structures: the width meeting ``budget`` parameters, or the widths of ``keep`` (one global rotation)."""
    d, n_layers = adapter.hidden, adapter.n_layers
    if keep is None:
        residual, structures = plan_slice(entries, d, n_layers, adapter.tied_embeddings, segment, budget)
        return residual, None, structures
    if segment:
        raise ValueError("per-segment SliceGPT widths need one global rotation (--q-mode global)")
    widths = segment_widths(keep, d, n_layers)
    structures = {e.name: st.Dense((e.shape[0], widths[e.segment])) for e in entries}
    return max(widths), widths, structures


def _class_structures(entries, options: CompressOptions, d: int, p_compressed: int, overhead: int, keep):
    """The structured classes' uniform kept fraction ``κ`` (the ratio's after ``overhead``, or the preset's),
    the shared Kronecker split and each matrix's structure (``keep``'s fraction where it names one)."""
    if options.matrix_keep is not None:  # the paper's fixed size per matrix, overheads on top
        kappa = options.matrix_keep
    else:
        kappa = ((1 - options.ratio) * p_compressed - overhead) / p_compressed
        if kappa <= 0:
            raise ValueError(
                f"ratio {options.ratio} cannot be met: the skip/head matrices alone need "
                f"{overhead:,} parameters of the {(1 - options.ratio) * p_compressed:,.0f} left; "
                "use a smaller ratio or --q-mode global"
            )
    kron_q = shared_factor(options, d, kappa)
    structures = {}
    for e in entries:
        k_e = kappa if keep is None else keep.get(e.name, kappa)
        structures[e.name] = (
            structure_for(options, e.name, *e.shape, k_e, kron_q, e.canon in ("embed", "lm_head"))
            if in_policy(e.canon, options)
            else st.Dense(e.shape)
        )
    return kappa, kron_q, structures


def rotation_overhead(d: int, n_layers: int, segment: bool, lm_head: str) -> int:
    """Parameters of the orthogonal skip matrices (Cayley: d(d+1)/2 each) and the tied head's mix."""
    return (2 * n_layers * d * (d + 1) // 2 if segment else 0) + (d * d if lm_head == "tied_mixed" else 0)


def params_at(matrices: list[MatrixPlan], width) -> int:
    """Parameters of the planned modules ``matrices`` where residual segment ``s`` is ``width(s)`` wide: a
    structured matrix's own, a dense one's rows × the width (the residual dimension is on its columns), and
    its bias (a reader's whole, a writer's at the width). Every count of a model's parameters at a width
    is this one's."""
    total = 0
    for m in matrices:
        k, w = m.shape[0], width(m.segment)
        total += (k * w if isinstance(m.structure, st.Dense) else m.structure.params()) + (
            (k if m.role == "reader" else w) if m.bias else 0
        )
    return total


def sliced_entry(k: int, d: int, w: int) -> dict:
    """A dense matrix of ``k`` rows sliced from width ``d`` to ``w``, as :attr:`Accounting.per_matrix` lists it."""
    return {"structure": {"type": "dense", "width": w}, "params": k * w, "dense_params": k * d, "ratio": 1 - w / d}


def plan_slice(entries, d, n_layers, tied, segment, target_total) -> tuple[int, dict]:
    """SliceGPT: the residual width d' whose total parameter count (the sliced matrices, the skips and the
    head mix) is closest to the target."""

    def total(dp: int) -> int:
        return params_at(entries, lambda _: dp) + (2 * n_layers * dp * dp if segment else 0) + (dp * dp if tied else 0)

    best = nearest_width(total, target_total, range(1, d + 1))
    return best, {e.name: st.Dense((e.shape[0], best)) for e in entries}


def nearest_width(params, target: float, widths) -> int:
    """The width among ``widths`` whose parameter count ``params(w)`` is closest to ``target`` (the first
    one on a tie)."""
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


def accounting(plan: Plan, dense_total: int, p_compressed: int, options: CompressOptions) -> Accounting:
    d, dr = plan.hidden, plan.residual
    skip_each = {"orthogonal": d * (d + 1) // 2, "dense": dr * dr, "none": 0}[plan.skip]
    skips = 2 * plan.n_layers * skip_each
    mix = plan.width(0) * plan.width(2 * plan.n_layers) if plan.lm_head == "tied_mixed" else 0
    compressed_set = [m for m in plan.matrices if in_policy(m.canon, options)]
    structured = sum(m.structure.params() for m in compressed_set)
    total = params_at(plan.matrices, plan.width) + skips + mix + plan.carried
    per_matrix = {
        m.name: {
            "structure": m.module_structure.entry(),
            "dense_params": m.structure.shape[0] * d,
            "params": m.structure.params(),
            "ratio": 1 - m.structure.params() / (m.structure.shape[0] * d),
        }
        for m in plan.matrices
    }
    return Accounting(
        dense_model_params=dense_total,
        compressed_model_params=total,
        ratio_over_compressed=(dense_total - total) / p_compressed,
        ratio_over_model=1 - total / dense_total,
        ratio_per_matrix_mean=1 - structured / p_compressed,
        skip_params=skips,
        head_mix_params=mix,
        per_matrix=per_matrix,
        target_ratio=options.ratio if options.matrix_keep is None else None,
        dense_params_of_compressed_matrices=p_compressed,
        structured_params_of_compressed_matrices=structured,
        residual_sizes=None if plan.residual_sizes is None else list(plan.residual_sizes),
    )


def source_numels(source: TensorSource, keys: list[str], tied: bool) -> int:
    """Parameters of the source model (tied weights once)."""
    keys = [k for k in keys if not (tied and k == "lm_head.weight")]
    if isinstance(source, DictSource):
        return sum(source.state_dict[k].numel() for k in keys)

    total = 0
    by_file: dict[str, list[str]] = {}
    for k in keys:
        by_file.setdefault(source.key_to_file[k], []).append(k)
    for fname, ks in by_file.items():
        with safe_open(source.path / fname, framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in ks)
    return total


def final_gamma(source: TensorSource, adapter: Adapter) -> torch.Tensor:
    name = f"{adapter.prefix}{adapter.spec.final_norm}.weight"
    return source.get([name])[name].to(torch.float64)


def plan_for(
    source: TensorSource, config: dict, options: CompressOptions, keep: dict[str, float] | None = None
) -> tuple[Plan, Adapter]:
    keys = source.keys()
    adapter = check_family(config, keys)
    dense_total = source_numels(source, keys, adapter.tied_embeddings)
    return plan_compression(config, keys, dense_total, final_gamma(source, adapter), options, keep), adapter
