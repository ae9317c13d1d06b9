"""What the user asked for, and everything that follows from it, decided in one place: :class:`CompressOptions`
holds the flags and its properties answer every question a later step asks of their combination (does the method
rotate, which statistics does calibration need, which solver path runs, how is it named)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

from ...calibration import CalibrationText
from ...flags import flag
from ...modeling.structured_linear import STRUCTURE_TYPES
from ...solvers import structures as st
from ...solvers.segments import Alternation

#: the structures of ProcrustesGPT: every structured module type (:data:`...modeling.structured_linear.STRUCTURE_TYPES`,
#: in its order) with a solver class (:data:`...solvers.structures.CLASSES`), dense aside
STRUCTURES = tuple(k for k in STRUCTURE_TYPES if k in st.CLASSES and k != st.Dense.kind)
#: the methods: ProcrustesGPT (a structure class after orthogonal transforms) and SliceGPT (PCA rotations, then
#: the residual stream sliced: its matrices stay dense and narrower, no structure class)
METHODS = ("procrustesgpt", "slicegpt")
#: how ``--structure``, reports, cards and ``config.json`` name SliceGPT
SLICE = "slice"
#: ``--structure``'s choices: the structures, then SliceGPT
STRUCTURE_CHOICES = (*STRUCTURES, SLICE)
#: the option that sets each sizing argument of a structure class (:attr:`...structures.Structure.sizing`)
_SIZING_OPTIONS = {arg: option for cls in st.CLASSES.values() for arg, option in cls.sizing.items()}
STAGES = ("none", "f", "w")
Q_MODES = ("segment", "global")
PRESETS = ("procrustesgpt-llama",)
ALLOCATIONS = ("uniform", "sensitivity")
_CHOICES = {"method": METHODS, "stage": STAGES, "q_mode": Q_MODES, "allocation": ALLOCATIONS}

#: canonical name -> (module path inside a decoder layer, role)
LAYER_MODULES = {
    "q": ("self_attn.q_proj", "reader"),
    "k": ("self_attn.k_proj", "reader"),
    "v": ("self_attn.v_proj", "reader"),
    "o": ("self_attn.o_proj", "writer"),
    "gate": ("mlp.gate_proj", "reader"),
    "up": ("mlp.up_proj", "reader"),
    "down": ("mlp.down_proj", "writer"),
}
#: residual segment of a layer's matrix, relative to ``2 * layer`` (readers read it, writers write the next)
SEGMENT_OFFSET = {"q": 0, "k": 0, "v": 0, "o": 1, "gate": 1, "up": 1, "down": 2}

#: the names reports and cards give three options (the ``--tol`` flag's, and the ones they have always had)
REPORTED_AS = {"stop_tol": "tol", "wopp_stop_tol": "wopp_tol", "ratio_slack": "tolerance"}
_ITER_NAMES = ("f_iters", "w_iters", "als_iters", "wopp_iters")
#: the matrices the paper leaves dense (``--compress-v`` compresses them too)
PAPER_DENSE = ("v",)


def _calibration_sizes(calibration: CalibrationText) -> dict:
    """How reports and cards name the calibration's sizes."""
    return {"calib_tokens": calibration.tokens, "calib_seq_len": calibration.seq_len}


def parse_gs_blocks(text: str | None) -> tuple[int, int] | None:
    """``--gs-blocks KL,KR`` as ``(kl, kr)``."""
    if text is None:
        return None
    try:
        kl, kr = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--gs-blocks takes two integers KL,KR (e.g. 4,4), got {text!r}") from None
    return kl, kr


@dataclass(frozen=True)
class CompressOptions:
    """``ratio``: fraction of the compressed matrices' parameters removed, overheads (skip matrices, the tied
    head's change of basis) included: equal ratios mean equal total parameter counts. ``method``:
    :data:`METHODS`; ``structure``: ProcrustesGPT's structure class (``None`` for SliceGPT;
    ``structure="slice"``, the command line's spelling, means ``method="slicegpt"``). ``q_mode`` ``None``: one
    global rotation for SliceGPT (its per-segment variant pays for dense skip matrices and measured worse),
    one per residual segment for the structure classes (the paper). A field with :func:`...flags.flag` is
    ``compress``'s flag of that name."""

    structure: str | None = flag(
        "kron",
        "kron: sums of Kronecker products; gs: block-diagonal·shuffle·block-diagonal; lowrank; "
        "slice: SliceGPT (PCA rotation + slicing) baseline (default: kron). CPU speed (1 thread, 75%% of the "
        "parameters): faster than dense from 8-token batches on 576x576 matrices and up; decoding one token, "
        "lowrank from 192x576, kron and gs from 576x576 about as fast or faster",
        choices=STRUCTURE_CHOICES,
    )
    method: str = "procrustesgpt"
    ratio: float = 0.25  # (--ratio: hand-written, since a preset refuses it)
    stage: str = flag(
        "w",
        "none: project without rotation; f: Frobenius-optimal rotations (Procrustes); "
        "w: then calibration-weighted projections and rotations (default: w)",
        choices=STAGES,
    )
    q_mode: str | None = flag(
        None,
        "one rotation per residual segment (skip connections carry Q_prevᵀQ_next) or one "
        "global rotation (no skip matrices) (default: segment; global for slice, whose per-segment "
        "variant pays for dense skip matrices and measured worse)",
        choices=Q_MODES,
    )
    kron_factor: int | None = flag(  # q: A_s is 1 x q (readers) / q x 1 (writers); must divide d
        None,
        "Kronecker split of the hidden dimension: A_s is 1xQ / Qx1 (default: chosen from the ratio)",
        type=int,
        metavar="Q",
    )
    gs_blocks: tuple[int, int] | None = flag(  # (kl, kr) tiles of layer matrices; embeddings use (1, kr)
        None, "GS tile grid of layer matrices (default: 4,4)", metavar="KL,KR", parse=parse_gs_blocks
    )
    compress_embeddings: bool = flag(
        True,
        "leave the embedding (and head) dense",
        name="--keep-embeddings",
        action="store_true",
        unset=False,
        parse=lambda keep: not keep,
    )
    dense_modules: tuple[str, ...] = flag(
        PAPER_DENSE,
        "also compress v_proj (the paper keeps it dense)",
        name="--compress-v",
        action="store_true",
        unset=False,
        parse=lambda compress_v: () if compress_v else PAPER_DENSE,
    )
    f_iters: int = flag(20, "stage F alternations at most (default: 20; --tol stops earlier)", type=int)
    w_iters: int = flag(
        50,
        "stage W alternations at most (default: 50, a cap: --tol stops it, usually after 10-25; "
        "--w-iters 1 --tol 0 --no-extrapolate is the paper's single alternation)",
        type=int,
    )
    als_iters: int = 5
    wopp_iters: int = 50
    stop_tol: float = flag(  # relative decrease per alternation (0: fixed count)
        1e-3,
        "stage f/w stopping rule: stop alternating once one alternation lowers the objective by less "
        "than this fraction (default: 1e-3; 0: exactly --f-iters / --w-iters alternations)",
        name="--tol",
        type=float,
    )
    extrapolate: bool = flag(
        True,
        "stage w: no over-relaxation of the rotation between alternations (by default each "
        "alternation also tries a longer step along the last rotation change and keeps it only if "
        "the objective is lower; it reaches a lower objective in fewer alternations)",
        name="--no-extrapolate",
        action="store_false",
    )
    wopp_stop_tol: float = 1e-9  # weighted Procrustes stop: gradient norm relative to its first
    solver_dtype: str = "float32"  # iterations in float32 (fast), final projections in float64
    damping: float = 0.01  # covariance damping, relative to the mean eigenvalue
    ratio_slack: float = 0.02  # largest |achieved ratio − ratio| accepted
    sequential: bool = flag(
        False,
        "stage w (and slice): take each residual segment's statistics from the model whose "
        "earlier segments are already compressed (as SliceGPT/GPTQ calibrate) instead of one pass "
        "of the original model; needs --q-mode segment (except low rank)",
        action="store_true",
    )
    match_original: bool = flag(
        True,
        "with --sequential: fit each matrix's own outputs on the compressed model's inputs instead "
        "of the original model's outputs and residual stream (GPTQ-style, the default)",
        name="--no-match-original",
        action="store_false",
    )
    matrix_keep: float | None = None  # fixed fraction kept per compressed matrix (presets), not ratio
    allocation: str = flag(
        "uniform",
        "uniform: every compressed matrix of a kind at the same size; sensitivity: per-layer sizes "
        "at the same total, from each layer's measured output error at several sizes on the "
        "calibration text (a knapsack over layers; a layer may stay dense); for slice with one "
        "global PCA, per-segment residual widths (default: uniform)",
        choices=ALLOCATIONS,
    )

    def __post_init__(self):
        if self.structure == SLICE:
            object.__setattr__(self, "method", "slicegpt")
        if self.method == "slicegpt":
            object.__setattr__(self, "structure", None)
        if self.q_mode is None:
            object.__setattr__(self, "q_mode", "global" if self.slicing else "segment")
        if isinstance(self.dense_modules, list):
            object.__setattr__(self, "dense_modules", tuple(self.dense_modules))

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                what = name.replace("_", " ")
                raise ValueError(f"unknown {what} {getattr(self, name)!r}; choose one of {', '.join(choices)}")
        if not self.slicing and self.structure not in STRUCTURES:
            raise ValueError(f"unknown structure {self.structure!r}; choose one of {', '.join(STRUCTURE_CHOICES)}")
        if not 0.0 < float(self.ratio) < 1.0:
            raise ValueError(f"ratio must be in (0, 1) (the fraction of parameters removed), got {self.ratio}")
        if self.kron_factor is not None and (not isinstance(self.kron_factor, int) or self.kron_factor < 2):
            raise ValueError(f"kron factor must be an integer >= 2, got {self.kron_factor!r}")
        if self.gs_blocks is not None and (len(self.gs_blocks) != 2 or min(self.gs_blocks) < 1):
            raise ValueError(f"gs blocks must be two positive integers (kl, kr), got {self.gs_blocks!r}")
        unknown = set(self.dense_modules) - set(LAYER_MODULES)
        if unknown:
            raise ValueError(f"unknown dense modules {sorted(unknown)}; choose from {sorted(LAYER_MODULES)}")
        if self.solver_dtype not in ("float32", "float64"):
            raise ValueError(f"solver dtype must be float32 or float64, got {self.solver_dtype!r}")
        if self.sequential and not self.sequential_applies:
            raise ValueError(
                "sequential calibration applies to SliceGPT with one rotation per segment and to stage "
                "w with one rotation per segment (--q-mode segment; low rank has no rotation), not to "
                f"{self.structure} stage {self.stage} with q mode {self.q_mode}"
            )
        if self.matrix_keep is not None and not 0.0 < float(self.matrix_keep) < 1.0:
            raise ValueError(f"matrix keep fraction must be in (0, 1), got {self.matrix_keep}")
        if self.matrix_keep is not None and self.slicing:
            raise ValueError("a fixed size per matrix applies to the structured classes, not to SliceGPT")
        if self.stop_tol < 0 or self.wopp_stop_tol < 0:
            raise ValueError(f"tolerances must be >= 0, got tol={self.stop_tol}, wopp_tol={self.wopp_stop_tol}")
        if self.allocation != "uniform" and self.slicing and self.q_mode != "global":
            raise ValueError(
                "per-segment SliceGPT widths (--allocation sensitivity) need one global PCA "
                "(--q-mode global): with one basis per segment the skip matrices would change shape"
            )
        if self.allocation != "uniform" and not self.needs_calibration:
            raise ValueError("non-uniform allocation measures sensitivity on calibration text: use stage f or w")
        for name in _ITER_NAMES:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")

    @property
    def sequential_applies(self) -> bool:
        if self.slicing:
            return self.q_mode == "segment"
        return self.stage == "w" and (self.q_mode == "segment" or not self.structure_class.rotation_helps)

    @classmethod
    def preset(cls, name: str, **overrides) -> "CompressOptions":
        """A named configuration that ``overrides`` change. ``procrustesgpt-llama``: the reference code's Llama
        configuration (embedding, head and V dense, the other matrices each at 75 % of its parameters, skip
        matrices on top)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        base = dict(compress_embeddings=False, dense_modules=PAPER_DENSE, matrix_keep=0.75, stage="w")
        return cls(**{**base, **overrides})

    # ------------------------------------------------------------------ what the flags mean
    @property
    def structure_class(self) -> type[st.Structure] | None:
        """The structure class of the compressed matrices (``None`` for SliceGPT: dense and narrower)."""
        if self.slicing:
            return None
        if self.structure not in st.CLASSES:
            raise ValueError(f"unknown structure {self.structure!r}; choose one of {', '.join(STRUCTURE_CHOICES)}")
        return st.CLASSES[self.structure]

    @property
    def slicing(self) -> bool:
        """SliceGPT: PCA rotations, then the residual stream sliced."""
        return self.method == "slicegpt"

    @property
    def structure_name(self) -> str:
        """How ``--structure``, reports, cards and ``config.json`` name the structure (SliceGPT's: :data:`SLICE`)."""
        return SLICE if self.slicing else self.structure

    @property
    def rotates(self) -> bool:
        """Whether a rotation is sought: always for SliceGPT (its PCA); never at stage ``none`` or for low rank
        (the rank of M Q is that of M, also in the weighted norms)."""
        return self.slicing or (self.structure_class.rotation_helps and self.stage != "none")

    @property
    def segment_rotations(self) -> bool:
        """One rotation per residual segment (skip connections carry ``Q_prevᵀ Q_next``)."""
        return self.q_mode == "segment" and self.rotates

    @property
    def weighted(self) -> bool:
        """Calibration-weighted ProcrustesGPT (stage W)."""
        return not self.slicing and self.stage == "w"

    @property
    def needs_calibration(self) -> bool:
        return self.slicing or self.stage in ("f", "w")

    @property
    def want_normed(self) -> bool:
        """One-pass statistics of the normalised stream and the writers' inputs (stage W, not sequential)."""
        return self.weighted and not self.sequential

    @property
    def statistics_on_demand(self) -> bool:
        """One-pass statistics measured as the per-segment solve reaches each segment (about one layer's
        moments held): stage W, one rotation per segment, not sequential, uniform sizes (an allocation and
        one global rotation read every segment's moments)."""
        return self.want_normed and not self.want_stream and self.q_mode == "segment" and self.allocation == "uniform"

    @property
    def want_stream(self) -> bool:
        """One-pass statistics of the residual stream itself (SliceGPT's PCA, not sequential)."""
        return self.slicing and not self.sequential

    @property
    def stream_sum(self) -> bool:
        """One-pass stream statistics as one running sum of the trace-normalised segment moments: all
        SliceGPT's global PCA at one width needs (per-segment widths also read single segments')."""
        return self.want_stream and self.q_mode == "global" and self.allocation == "uniform"

    @property
    def solver(self) -> str:
        """The solve path: ``pca``, ``pca-sequential`` (SliceGPT), ``projection`` (no rotation search),
        ``sequential`` (stage W on the partly compressed model) or ``stages`` (F, then W on one pass)."""
        if self.slicing:
            return "pca-sequential" if self.sequential else "pca"
        if self.sequential:
            return "sequential"
        if not self.rotates:
            return "projection"
        return "stages"

    @property
    def label(self) -> str:
        """How the method is named in output, reports and cards."""
        if self.slicing:
            basis = "global PCA" if self.q_mode == "global" else "PCA per segment"
            return f"SliceGPT ({basis}{', sequential' if self.sequential else ''})"
        extra = ", sequential" if self.sequential else ""
        if not self.structure_class.rotation_helps:  # (low rank: no rotation, so no q mode)
            return f"ProcrustesGPT (lowrank, stage {self.stage}{extra})"
        return f"ProcrustesGPT ({self.structure}, stage {self.stage}, {self.q_mode} Q{extra})"

    def applicable(self, calibration: CalibrationText) -> dict:
        """The settings that apply to this method (what a card lists), and ``calibration``'s sizes where it
        calibrates."""
        keys = [
            "structure",
            "ratio" if self.matrix_keep is None else "matrix_keep",
            "q_mode",
            "compress_embeddings",
            "calib_tokens",
            "calib_seq_len",
        ]
        if self.slicing:
            keys += ["sequential"]
        else:
            keys += ["stage", "dense_modules"]
            keys += [_SIZING_OPTIONS[s] for s in self.structure_class.sizing]
            if self.rotates and self.stage in ("f", "w"):
                keys += ["f_iters", "stop_tol"]
            if self.weighted:
                keys += ["w_iters", "als_iters", "damping", "sequential"]
                if self.rotates:
                    keys += ["wopp_iters", "wopp_stop_tol", "extrapolate"]
                if self.sequential:
                    keys.append("match_original")
        if not self.slicing or self.q_mode == "global":
            keys.append("allocation")
        if not self.needs_calibration:
            keys = [k for k in keys if not k.startswith("calib")]
        out = {}
        given = {**asdict(self), "structure": self.structure_name, **_calibration_sizes(calibration)}
        for k in keys:
            v = given[k]
            out[REPORTED_AS.get(k, k)] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
        return out

    def schedule(self, stage: str) -> Alternation:
        """Stage ``stage``'s solver schedule in the solver's dtype: at most ``f_iters`` / ``w_iters`` alternations
        (none where no rotation lowers the error), stopped by ``stop_tol``; stage W also over-relaxes Q between
        alternations (``extrapolate``)."""
        return Alternation(
            iters={"f": self.f_iters, "w": self.w_iters}.get(stage, 0) if self.rotates else 0,
            als_iters=self.als_iters,
            wopp_iters=self.wopp_iters,
            dtype=getattr(torch, self.solver_dtype),
            keep_weights=False,
            tol=self.stop_tol,
            wopp_tol=self.wopp_stop_tol,
            extrapolate=self.extrapolate and stage == "w",
        )

    def as_dict(self, calibration: CalibrationText) -> dict:
        """Every option under the names reports use (:data:`REPORTED_AS`; the method as its structure's name),
        and ``calibration``'s sizes."""
        options = {**asdict(self), "structure": self.structure_name}
        del options["method"]
        return {**{REPORTED_AS.get(k, k): v for k, v in options.items()}, **_calibration_sizes(calibration)}

    def with_(self, **changes) -> "CompressOptions":
        return replace(self, **changes)

    def changes(self) -> dict:
        """The fields whose value is not the default (what a preset is given on top of its own)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
