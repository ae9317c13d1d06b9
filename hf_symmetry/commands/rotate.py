"""``hf-symmetry rotate [MODEL] OUT``: write a functionally equivalent, re-parametrised checkpoint."""

from __future__ import annotations

from ..assets import resolve_model
from ..conversion.rotate import RotateOptions, rotate_checkpoint
from ..flags import add_flags, from_args
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
    # RotateOptions' flags in --help's order: the random exact symmetries; --for-quantization and its residual
    # rotation; its exact scales (with --write-imatrix), their calibration, V/O Hadamards, channel order
    add_flags(p, RotateOptions, "residual", "heads", "ffn", "scaling", "for_quantization", "learn", "learn_iterations")
    add_flags(p, RotateOptions, "balance_alpha", "hold_out", "scales", "target")
    p.add_argument(
        "--write-imatrix",
        metavar="PATH",
        default=None,
        help="with --scales: also write the importance matrix of the output model on the calibration tokens "
        "(llama.cpp's GGUF imatrix format, what llama-imatrix would collect on it), for llama-quantize --imatrix PATH",
    )
    add_flags(p, RotateOptions, "calibration_text", "calibration_tokens", "scales_pow2", "vo_hadamard")
    add_flags(p, RotateOptions, "sort_channels", "seed")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    add_verify_args(p, "the original")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


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
    return from_args(RotateOptions, args)
