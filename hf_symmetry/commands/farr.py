"""``hf-symmetry farr MODEL OUT (--tau T | --params-fraction F) [--vo] [--qk]``: fuse and rank reduce.

Truncates each KV group's fused value map ``W_O W_V`` (and, with ``--qk``, the score map
``W_Qᵀ W_K``, only where it is exact: no RoPE, no QK-norm, e.g. BERT/RoBERTa and the NoPE layers of
SmolLM3) and splits it back
with ``√Σ`` on each side, giving per-layer value (and query/key) head dims. The output is a FaRR
model folder (custom class, loads with ``trust_remote_code=True`` without hf_symmetry)."""

from __future__ import annotations

from ..assets import resolve_model
from ..calibration import CalibrationText
from ..conversion.farr import FarrOptions, farr_checkpoint
from ..flags import add_flags, from_args
from ..hub.values import fmt_number
from ..text import public_text_label
from .common import (
    add_device_args,
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
    placement_from_args,
)
from .inputs import CALIB_TOKENS_DEFAULT, check_text_tokens
from .runner import Conversion, run_conversion

#: a reduction that removes less than this fraction of the model's parameters ...
LITTLE_REMOVED = 0.02
#: ... should not cost more than this perplexity ratio (causal LMs) or lose this much hidden-state cosine (encoders)
MUCH_PPL_RATIO = 1.10
MUCH_COSINE_LOSS = 0.01


def register(sub) -> None:
    p = sub.add_parser(
        "farr",
        help="fuse and rank reduce attention (smaller per-layer V/O, Q/K head dims)",
        description=__doc__,
        epilog="Where it stands (SmolLM2; bytes = weights + a 2048-token KV cache; BENCHMARKS.md, 'The frontier'): "
        "--vo --params-fraction 0.75 is 96 % of the bfloat16 source's bytes at Hamlet perplexity 39.5 (source "
        "31.5); NF4 after it 49 % at 56.0, against 52 % at 39.6 for NF4 of the source and 48 % at 33.3 for "
        "llama.cpp's Q4_K_M of the source. For a byte budget, quantize the source (docs/farr.md).",
    )
    p.add_argument("model", help="HF model folder or embedded alias (default, smollm2, minilm)")
    p.add_argument("out", help="output folder")
    add_flags(p.add_mutually_exclusive_group(required=True), FarrOptions, "tau", "params_fraction")
    add_flags(p, FarrOptions, "vo", "qk")
    p.add_argument(
        "--calibrate",
        metavar="TEXT",
        help="activation-aware truncation (beyond the FaRR paper): measure each map by its output error "
        "on the model's own attention inputs over TEXT (file or embedded name, e.g. britannica-calib) "
        "instead of the data-free Frobenius norm; τ and the budget then count that energy",
    )
    p.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (default: 2048)")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    add_device_args(p)
    add_verify_args(p, "the original")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    return run_conversion(Farr(args))


class Farr(Conversion):
    """``farr``: the reduction chosen, the fused maps truncated, the kept dims described; after the
    verification, a warning when the choice removes little yet costs much."""

    names = ("original", "FaRR")

    def check(self) -> None:
        args = self.args
        self.placement = placement_from_args(args)  # an unusable device fails before any work
        self.options = from_args(FarrOptions, args, vo=args.vo or not args.qk)
        self.options.validate()
        check_verify_args(args, args.model)
        self.original = resolve_model(args.model)
        if args.calibrate is not None:  # a missing or short text fails before any work
            check_text_tokens(
                args.calibrate, args.model, {"--calib-tokens": (args.calib_tokens, CALIB_TOKENS_DEFAULT["farr"])}
            )

    def convert(self):
        args, src = self.args, self.original
        report = farr_checkpoint(
            src,
            args.out,
            self.options,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            progress=not args.quiet,
            calibration=None if args.calibrate is None else CalibrationText(args.calibrate, args.calib_tokens),
            placement=self.placement,
        )
        lines = [
            f"farr {src} -> {args.out} ({report.model_type}; conversion {report.seconds:.1f} s)",
            f"  rewritten projections keep {report.touchable_params_after:,} of {report.touchable_params_before:,} "
            f"parameters ({report.touchable_kept_fraction:.1%}); model {report.params_before:,} -> "
            f"{report.params_after:,}",
        ]
        for path, ranks in report.ranks.items():
            worst = min(min(groups) for groups in report.kept_energy[path] if groups is not None)  # None: kept whole
            lines.append(
                f"  {path} head dims (of {report.head_dim}): {_runs(ranks)}; least energy kept by a group {worst:.4%}"
            )
        if report.calibration:
            lines.append(
                f"  calibrated on {report.calibration['tokens']} tokens of "
                f"{public_text_label(report.calibration['text'])} (energies are output energies on those activations)"
            )
        lines += [f"  note: {n}" for n in report.notes]
        return report, lines

    def verify(self, report, lines: list[str]) -> bool:
        verified = super().verify(report, lines)
        warning = costly_reduction_warning(report, self.options)
        if warning:
            lines.append(f"  warning: {warning}")
        return verified

    def summary(self, report) -> dict:
        return report.as_dict()


def costly_reduction_warning(report, options: FarrOptions) -> str | None:
    """A warning when the reduction removes little of the model (< 2 % of its parameters) yet
    costs much in the verification (perplexity × > 1.10, or hidden-state cosine < 0.99)."""
    v = report.verification or {}
    if not report.params_before:
        return None
    removed = 1 - report.params_after / report.params_before
    if removed >= LITTLE_REMOVED:
        return None
    choice = f"τ = {options.tau:g}" if options.tau is not None else f"--params-fraction {options.params_fraction:g}"
    before, after = v.get("perplexity_original"), v.get("perplexity_converted")
    if before and after and after / before > MUCH_PPL_RATIO:
        cost = f"perplexity {fmt_number(before)} -> {fmt_number(after)} (x{after / before:.2f})"
    elif v.get("hidden_cosine") is not None and v["hidden_cosine"] < 1 - MUCH_COSINE_LOSS:
        cost = f"mean hidden-state cosine {fmt_number(v['hidden_cosine'])}"
    else:
        return None
    return (
        f"{choice} removes only {removed:.1%} of the model's parameters but costs {cost}; "
        "a τ closer to 1 keeps more, or --calibrate measures energy on real activations"
    )


def _runs(ranks: list[int]) -> str:
    """``[64, 64, 63]`` -> ``64 x2, 63``: compact per-layer dims."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[i]:
            j += 1
        out.append(f"{ranks[i]}" + (f" x{j - i + 1}" if j > i else ""))
        i = j + 1
    return ", ".join(out)
