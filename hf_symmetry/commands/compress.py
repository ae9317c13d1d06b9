"""``hf-symmetry compress [MODEL] OUT``: structured compression with orthogonal transforms (ProcrustesGPT),
or SliceGPT, saved as a Hugging Face model that loads with ``trust_remote_code=True``; SliceGPT with one
global PCA and one width on an untied (or ``--untie``) Llama / Mistral / Qwen2 / Qwen3 / Phi-3 is
written as the source's own stock class instead (no remote code)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ..assets import resolve_model, resolve_text
from ..checkpoint_io import CheckpointReader
from ..conversion.compress import (
    PRESETS,
    CompressOptions,
    CompressRun,
    compress_checkpoint,
    record_verification,
)
from ..conversion.compress.pipeline import route_for
from ..conversion.compress.routes import CALIBRATION, check_calibration
from ..conversion.compress.stock import StockSlice
from ..flags import add_flags, from_args, nested_from_args
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


def register(sub) -> None:
    p = sub.add_parser(
        "compress",
        help="structured compression (Kronecker / GS / low rank) with orthogonal transforms, or SliceGPT",
        description=__doc__,
        epilog="Where it stands (SmolLM2; bytes = weights + a 2048-token KV cache; BENCHMARKS.md, 'The frontier'): "
        "slice at 25 % is 79 % of the bfloat16 source's bytes at Hamlet perplexity 131.5 (83.3 healed), while "
        "bitsandbytes NF4 of the source is 52 % at 39.6 and llama.cpp's Q3_K_M 44 % at 36.4 (source: 31.5). "
        "For a byte budget, quantize the source (docs/compress.md).",
    )
    _add_method_args(p)
    _add_rotation_args(p)
    _add_solver_args(p)
    _add_stock_args(p)
    _add_calibration_size_args(p)
    add_device_args(p)
    add_verify_args(p, "the original (perplexity before and after)")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def _add_method_args(p) -> None:
    """The model, the output folder, the method and its size, and the calibration text."""
    p.add_argument(
        "model",
        nargs="?",
        default="default",
        help="HF folder of a Llama-family model (llama, mistral, qwen2, qwen3, phi3) or a LayerNorm "
        "decoder (opt, gpt2, gpt_neox, gptj: written as the RMS-decoder family), or an embedded alias "
        "(default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("out", help="output folder")
    add_flags(p, CompressOptions, "structure")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        help="procrustesgpt-llama: the reference ProcrustesGPT Llama configuration: embedding and head "
        "dense, q/k/o/gate/up/down each structured at 75%% of its parameters, V dense (--ratio does "
        "not apply; the report gives the parameters removed from the whole model)",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="fraction of the compressed matrices' parameters removed, skip/head matrices paid for "
        "(equal ratios give equal model sizes across methods; default: 0.25)",
    )
    add_flags(p, CompressRun, "calibration.text")


def _add_rotation_args(p) -> None:
    """The stage, the rotations and the structures' shapes."""
    add_flags(p, CompressOptions, "stage", "q_mode", "kron_factor", "gs_blocks", "compress_embeddings", "dense_modules")


def _add_solver_args(p) -> None:
    """How far the stages run, sequential calibration and the allocation of sizes."""
    add_flags(
        p,
        CompressOptions,
        "f_iters",
        "w_iters",
        "sequential",
        "match_original",
        "allocation",
        "stop_tol",
        "extrapolate",
    )


def _add_stock_args(p) -> None:
    """Which family a SliceGPT output is written as."""
    p.add_argument(
        "--untie",
        action="store_true",
        help="slice: untie a tied head so that the output is the source's stock family (its head then "
        "costs vocab x width, counted in the ratio, instead of the compressed family's width² head "
        "mix)",
    )
    p.add_argument(
        "--round-to",
        type=int,
        default=None,
        metavar="N",
        help="slice, stock output: round the residual width to a multiple of N (default: 64, what GPU "
        "kernels want; 1: no rounding); the report gives the width before rounding",
    )
    p.add_argument(
        "--remote-code",
        action="store_true",
        help="slice: write the compressed (remote-code) family even where the source's stock family "
        "could hold the output",
    )


def _add_calibration_size_args(p) -> None:
    """How much calibration text is read, and in what batches."""
    add_flags(p, CompressRun, "calibration.tokens", "calibration.seq_len")


def stock_from_args(args, options) -> StockSlice | None:
    """The stock route of a SliceGPT run (``None``: the compressed family, with ``--remote-code`` and for
    every other structure)."""
    if not options.slicing:
        if args.untie or args.round_to is not None or args.remote_code:
            raise ValueError("--untie, --round-to and --remote-code apply to --structure slice")
        return None
    if args.remote_code and (args.untie or args.round_to is not None):
        raise ValueError("--untie and --round-to shape the stock output; --remote-code writes the compressed family")
    stock = StockSlice(untie=args.untie, round_to=64 if args.round_to is None else args.round_to)
    return None if args.remote_code else stock


def _config(src) -> dict:
    return json.loads((Path(src) / "config.json").read_text())


#: per structure, the matrix size (entries) from which one token's forward measured at least as fast as dense
#: (CPU, float32, 75% of the parameters, SmolLM2's shapes: benchmarks/results/structured_linear.json); gs from
#: its weights read from memory, as decoding reads them (structured_linear_cold.json: 192x576 0.95x)
DECODE_PAYS_FROM = {"kron": 576 * 576, "gs": 576 * 576, "lowrank": 192 * 576}


def decode_speed_warning(structure: str, config: dict) -> str | None:
    """One line where ``structure``'s smallest matrix in this model is below :data:`DECODE_PAYS_FROM` (None
    otherwise, or where the config gives no hidden size)."""
    d = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    if structure not in DECODE_PAYS_FROM or not d:
        return None
    heads = config.get("num_attention_heads") or config.get("n_head") or 1
    kv = (config.get("num_key_value_heads") or heads) * (config.get("head_dim") or d // heads)
    rows, cols = min(kv, d), d
    if rows * cols >= DECODE_PAYS_FROM[structure]:
        return None
    return (
        f"warning: {structure} matrices as small as this model's {rows}x{cols} decode one token slower than dense "
        "on CPU (BENCHMARKS.md, 'structured_linear'); larger matrices, prefill and batches gain"
    )


def run(args) -> int:
    return run_conversion(Compress(args))


class Compress(Conversion):
    """``compress`` on the shared driver (:func:`.runner.run_conversion`): the verification compares the
    original and the compressed model, its perplexities also going into the report and the card."""

    names = ("original", "compressed")

    def check(self) -> None:
        args = self.args
        self.options = from_args(CompressOptions, args)  # the flags declared on CompressOptions
        if args.preset:  # it fixes each matrix's size; the flags given change it
            if args.ratio is not None:
                raise ValueError(f"--ratio does not apply to --preset {args.preset} (it fixes each matrix's size)")
            self.options = CompressOptions.preset(args.preset, **self.options.changes())
        elif args.ratio is not None:
            self.options = self.options.with_(ratio=args.ratio)
        self.options.validate()
        self.calibration = nested_from_args(CompressRun, "calibration", args)  # None: no --calib
        check_calibration(self.calibration)
        self.stock = stock_from_args(args, self.options)
        self.placement = placement_from_args(args)  # an unusable device fails before any work
        check_verify_args(args, args.model)
        self.original = resolve_model(args.model)
        if self.calibration is not None:
            self.calibration = replace(self.calibration, text=resolve_text(self.calibration.text))
            check_text_tokens(
                args.calib, args.model, {"--calib-tokens": (args.calib_tokens, CALIB_TOKENS_DEFAULT["compress"])}
            )

    def convert(self):
        args, options, src = self.args, self.options, self.original
        reader = CheckpointReader(src)  # what the route cannot do (a factor, a width) is refused before the warning
        route_for(reader.config, options, self.stock).check(reader, options)
        warning = decode_speed_warning(options.structure, _config(src))
        if warning:  # after every refusal (the runner's OUT checks included), before any work
            print(f"hf-symmetry compress: {warning}", file=sys.stderr)
        report = compress_checkpoint(
            src,
            args.out,
            options,
            self.calibration,
            stock=self.stock,
            progress=not args.quiet,
            placement=self.placement,
            overwrite=args.overwrite,
        )
        config = _config(src)
        acc = report.accounting
        lines = [
            f"compressed {report.family} model {src} -> {args.out} ({options.label}) "
            f"in {sum(report.seconds.values()):.1f} s",
            f"  parameters: {acc.dense_model_params:,} -> {acc.compressed_model_params:,} "
            f"({acc.ratio_over_model:.1%} removed from the model, {acc.ratio_over_compressed:.1%} of the "
            f"compressed matrices; structures alone {acc.ratio_per_matrix_mean:.1%}; skip matrices "
            f"{acc.skip_params:,}, head mix {acc.head_mix_params:,})",
            *route_for(config, options, self.stock).output_lines(report, config),
            f"  report: {args.out}/compression_report.json",
        ]
        return report, lines

    def record(self, report, verified) -> None:
        """The verification's perplexities also go into the report and the card (:func:`record_verification`);
        its figures into the ``--json`` summary."""
        self.verification = None if verified is None else verified.figures
        if verified is not None:
            record_verification(self.out, report, self.options, self.calibration or CALIBRATION, verified.measured)

    def summary(self, report) -> dict:
        summary = report.as_dict()
        summary["verification"] = self.verification
        return summary
