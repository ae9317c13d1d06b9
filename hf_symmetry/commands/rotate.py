"""``hf-symmetry rotate [MODEL] OUT``: write a functionally equivalent, re-parametrised checkpoint."""

from __future__ import annotations

import argparse

from ..assets import resolve_model
from ..conversion.rotate import RotateOptions, rotate_checkpoint
from .common import (
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
    placement_from_args,
)
from .runner import Conversion, run_conversion


def register(sub) -> None:
    p = sub.add_parser(
        "rotate", help="apply random exact symmetries (residual/head rotations, FFN permutation)", description=__doc__
    )
    p.add_argument(
        "model", nargs="?", default="default", help="HF model folder or embedded alias (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("out", help="output folder")
    _add_symmetry_args(p)
    _add_quantization_args(p)
    _add_scale_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    add_verify_args(p, "the original")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def _add_symmetry_args(p) -> None:
    """The random exact symmetries: residual, head rotations, FFN permutation, scalings."""
    p.add_argument(
        "--residual",
        choices=["none", "hadamard", "random"],
        default=None,
        help="residual-stream rotation after norm fusion (pre-norm RMSNorm families stay stock; LayerNorm "
        "decoders are mean-centred into the hf_symmetry_rms_decoder family; default: hadamard, none with "
        "--for-quantization)",
    )
    p.add_argument(
        "--heads",
        choices=["none", "qk", "vo", "random"],
        default="random",
        help="per-KV-group head rotations: QK (inside the RoPE commutant), VO, or both (default)",
    )
    p.add_argument(
        "--ffn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="randomly permute FFN neurons (default: on)",
    )
    p.add_argument("--scaling", action="store_true", help="also apply random per-group QK and VO scalings")


def _add_quantization_args(p) -> None:
    """``--for-quantization`` and its residual rotation (learned, balanced, channels held out)."""
    p.add_argument(
        "--for-quantization",
        action="store_true",
        help="write a stock checkpoint that loses less under low-bit weight quantization, exact in float. "
        "Default preset: AWQ-style exact scales searched against --scales (default Q4_0) on "
        "--calibration-text; no rotation. "
        "QuaRot-style: --residual hadamard --vo-hadamard --scales none (on SmolLM2 that quantizes worse "
        "than the original; docs/quantization.md). --heads/--ffn/--scaling are ignored. Which pipeline it helps: "
        "quantization WITHOUT an importance matrix (SmolLM2 through llama.cpp: Q4_0 0.58x, Q4_K_M 0.67x the "
        "original's loss; --target gguf-imatrix --scales Q4_K_M 0.59x and 0.47x); with llama-quantize --imatrix "
        "the original quantized better (the default preset 1.56x at Q4_K_M, 1.20x at Q3_K_M) and --target "
        "gguf-imatrix only broke even (0.95x, 1.08x): with an imatrix, quantize the original",
    )
    p.add_argument(
        "--learn",
        metavar="QTYPE",
        default=None,
        help="with --for-quantization: learn the residual rotation against this weight quantizer "
        "(Q4_0, Q4_1, Q5_0, Q8_0, MXFP4 through gguf; hqq<bits>g<group>[-rtn] through hqq; "
        "bnb-nf4, bnb-fp4 through bitsandbytes), "
        "from the randomised Hadamard",
    )
    p.add_argument(
        "--learn-iterations",
        type=int,
        default=8,
        help="alternating quantize / Procrustes steps of --learn (default: 8)",
    )
    p.add_argument(
        "--balance-alpha",
        type=float,
        default=1.0,
        help="with --for-quantization: exponent of the column balancing (1 equalises every "
        "column's max-abs, 0 leaves them; default: 1)",
    )
    p.add_argument(
        "--hold-out",
        default="",
        metavar="I,J,...",
        help="with --for-quantization: residual channels the Hadamard leaves alone (e.g. the "
        "massive-activation channels; the remaining width needs a Hadamard construction)",
    )


def _add_scale_args(p) -> None:
    """``--for-quantization``'s exact scales (searched on calibration text), V/O Hadamards and channel order."""
    p.add_argument(
        "--scales",
        metavar="QTYPE",
        default=None,
        help="with --for-quantization: choose the exact norm->readers, V->O and up->down scales from "
        "calibration activations by AWQ's search against this quantizer: Q4_0, Q4_1, Q5_0, Q8_0, MXFP4 "
        "(gguf), bnb-nf4, bnb-fp4 (bitsandbytes), hqq<bits>g<group>[-rtn] (default: Q4_0; 'none': the "
        "data-free max-abs balancing)",
    )
    p.add_argument(
        "--target",
        choices=["weights", "gguf", "gguf-imatrix"],
        default=None,
        help="with --for-quantization: what --scales names and how the search measures the error. 'weights' "
        "(default): a weight quantizer, rounding without activation data. 'gguf': a llama-quantize type "
        "(Q4_K_M by default; Q4_0, Q3_K_M, IQ4_NL, ...) with llama.cpp's per-tensor mixture, its quantizers "
        "emulated bit for bit, no importance matrix. 'gguf-imatrix': the same with llama-quantize --imatrix, "
        "the importance matrix being the scaled model's own (write it with --write-imatrix)",
    )
    p.add_argument(
        "--write-imatrix",
        metavar="PATH",
        default=None,
        help="with --scales: also write the importance matrix of the output model on the calibration tokens "
        "(llama.cpp's GGUF imatrix format, what llama-imatrix would collect on it), for llama-quantize --imatrix PATH",
    )
    p.add_argument(
        "--calibration-text",
        default="britannica-calib",
        help="with --scales: calibration text file or embedded name (default: britannica-calib)",
    )
    p.add_argument("--calibration-tokens", type=int, default=2048, help="with --scales: tokens (default: 2048)")
    p.add_argument(
        "--pow2-scales",
        action="store_true",
        help="with --scales: round every factor to a power of two (only exponents change: the float "
        "logits stay bitwise equal; quantizes somewhat worse)",
    )
    p.add_argument(
        "--vo-hadamard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --for-quantization: per-head V/O Hadamard rotations (default: off; on with a residual rotation)",
    )
    p.add_argument(
        "--sort-channels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --for-quantization --scales and no residual rotation: permute the residual channels into "
        "the order of their calibration activation RMS, so that channels of like scale share a quantization "
        "block (exact; default: off: it helps some quantizers and hurts others, docs/quantization.md)",
    )


def resolve_quantization_preset(args) -> None:
    """Fill the options left unset. ``--for-quantization``'s preset is the one measured best on SmolLM2
    (docs/quantization.md): no rotation, exact scales against Q4_0. A residual rotation
    keeps the QuaRot-style defaults (V/O Hadamards, max-abs balancing unless --scales is given)."""
    quant = args.for_quantization
    if args.residual is None:  # --learn and --hold-out shape a residual rotation: they keep the Hadamard
        args.residual = "none" if quant and not (args.learn or args.hold_out) else "hadamard"
    rotated = args.residual != "none"
    if args.vo_hadamard is None:
        args.vo_hadamard = rotated or not quant
    if args.scales is None and quant and not rotated:
        args.scales = "Q4_K_M" if args.target in ("gguf", "gguf-imatrix") else "Q4_0"
    if args.scales == "none":
        args.scales = None
    if args.sort_channels is None:
        args.sort_channels = False
    if args.sort_channels and (rotated or not args.scales):
        raise SystemExit("--sort-channels needs --scales and --residual none (a rotation mixes every channel)")


def pipeline_notes(args) -> list[str]:
    """What the docs measured about the pipeline this preset is for (docs/quantization.md)."""
    if not args.for_quantization or not args.scales:
        return []
    if args.target == "gguf-imatrix":
        return [IMATRIX_WARNING]
    return [NO_IMATRIX_NOTE]


IMATRIX_WARNING = (
    "  warning: with an importance matrix, no exact scaling measured so far beats the original model quantized with "
    "its own llama-imatrix matrix (SmolLM2 through llama.cpp: 0.95x at Q4_K_M, 1.08x at Q3_K_M; docs/quantization.md): "
    "compare against that before using these files"
)
NO_IMATRIX_NOTE = (
    "  note: these scales are fitted to quantization WITHOUT an importance matrix (SmolLM2 through llama.cpp: Q4_0 "
    "0.58x, Q4_K_M 0.67x the original's loss); with llama-quantize --imatrix the original quantized better "
    "(this preset 1.56x at Q4_K_M): docs/quantization.md"
)


def run(args) -> int:
    return run_conversion(Rotate(args))


class Rotate(Conversion):
    """``rotate``: refuse flag combinations, fill the ``--for-quantization`` preset, rotate, describe."""

    names = ("original", "rotated")

    def check(self) -> None:
        args = self.args
        check_verify_args(args, args.model)
        self.original = resolve_model(args.model)
        if (args.learn or args.scales or args.sort_channels or args.target or args.write_imatrix) and not (
            args.for_quantization
        ):
            raise SystemExit("--learn, --scales, --sort-channels, --target and --write-imatrix need --for-quantization")
        resolve_quantization_preset(args)
        if args.write_imatrix and not args.scales:
            raise SystemExit("--write-imatrix needs the activation-aware --scales (it writes their statistics)")
        self.placement = placement_from_args(args)  # --scales' calibration runs there; an unusable device fails here

    def convert(self):
        args, src = self.args, self.original
        report = rotate_checkpoint(
            src,
            args.out,
            rotate_options(args),
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            progress=not args.quiet,
            placement=self.placement,
            imatrix_out=args.write_imatrix,
        )
        lines = [
            f"rotated {report.family} model {src} -> {args.out} (conversion {report.seconds:.1f} s)",
            f"  applied: {', '.join(report.applied) or 'nothing'} (seed {args.seed})",
        ]
        if args.write_imatrix:
            lines.append(f"  importance matrix of the output model -> {args.write_imatrix} (llama-quantize --imatrix)")
        lines += pipeline_notes(args)
        if report.untied_embeddings:
            lines.append("  embeddings untied (the final norm's γ is folded into lm_head)")
        return report, lines


def rotate_options(args) -> RotateOptions:
    """The flags (their preset filled in) as one :class:`RotateOptions`."""
    return RotateOptions(
        residual=args.residual,
        heads=args.heads,
        ffn=args.ffn,
        scaling=args.scaling,
        seed=args.seed,
        for_quantization=args.for_quantization,
        learn=args.learn,
        learn_iterations=args.learn_iterations,
        balance_alpha=args.balance_alpha,
        hold_out=tuple(int(c) for c in args.hold_out.split(",") if c.strip()),
        scales=args.scales,
        calibration_text=args.calibration_text,
        calibration_tokens=args.calibration_tokens,
        vo_hadamard=args.vo_hadamard,
        scales_pow2=args.pow2_scales,
        sort_channels=args.sort_channels,
        target=args.target,
    )
