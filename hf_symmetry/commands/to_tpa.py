"""``hf-symmetry to-tpa [MODEL] OUT``: convert a Llama-family checkpoint (Llama, Mistral without sliding
windows, Qwen2, Qwen3, Phi-3/Phi-4; ``hf-symmetry families`` says why any other is refused) into a Tensor Product
Attention (T6-style, TPA-KV-only, non-contextual A) model. Exact at full rank (the default,
``--k-rank = --v-rank = number of KV heads``); below it the KV-head mode is reduced by a head-mode SVD,
optionally fitted to the attention inputs of a calibration text (``--calib``). At the exact ranks the cache is
the source's (no memory saved); below them it shrinks, at a loss of quality until the model is healed
(``hf-symmetry heal``). On a GQA checkpoint, transformers' own quantized KV cache on the source
(``cache_implementation="quantized"``) is the better trade unless you heal on many tokens: SmolLM2 at k/v rank 2,
healed on 32,768 tokens, reads Hamlet at perplexity 48.7 through its 4-bit factor cache against 20.8 for the
source with a 4-bit QuantizedCache (docs/tpa.md)."""

from __future__ import annotations

from ..conversion.to_tpa import ToTPAOptions, convert_checkpoint_to_tpa
from ..flags import add_flags, from_args
from .common import (
    add_device_args,
    add_output_args,
    add_push_args,
    add_verify_args,
    check_verify_args,
    fmt,
    placement_from_args,
)
from .inputs import CALIB_TOKENS_DEFAULT, check_text_tokens
from .runner import Conversion, run_conversion


def register(sub) -> None:
    p = sub.add_parser(
        "to-tpa",
        help="convert a Llama/Mistral/Qwen2/Qwen3/Phi-3 checkpoint to Tensor Product Attention",
        description=__doc__,
        epilog="Where it stands (SmolLM2; bytes = weights + a 2048-token KV cache; BENCHMARKS.md, 'The frontier'): "
        "k/v rank 2 is 94 % of the bfloat16 source's bytes at Hamlet perplexity 234.6 (70.7 healed), rank 1 87 % "
        "at 10313; NF4 of the source is 52 % at 39.6 (source: 31.5). At 2k tokens the cache is 15 % of the "
        "bytes: a reduced rank pays off only at long contexts or large batches, after healing (docs/tpa.md).",
    )
    p.add_argument(
        "model", nargs="?", default="default", help="HF model folder or embedded alias (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("out", help="output folder")
    add_flags(p, ToTPAOptions)
    add_device_args(p)
    add_verify_args(p, "the source")
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    return run_conversion(ToTPA(args))


class ToTPA(Conversion):
    """``to-tpa``: the ranks checked, the attention converted, the cache and per-layer errors described."""

    names = ("source", "TPA")

    def check(self) -> None:
        args = self.args
        self.placement = placement_from_args(args)  # an unusable device fails before any work
        self.options = from_args(ToTPAOptions, args)
        for name in ("k_rank", "v_rank"):
            value = getattr(args, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if args.calib_tokens <= 0:
            raise ValueError(f"--calib-tokens must be positive, got {args.calib_tokens}")
        check_verify_args(args, args.model)
        if args.calib:
            check_text_tokens(
                args.calib, args.model, {"--calib-tokens": (args.calib_tokens, CALIB_TOKENS_DEFAULT["to-tpa"])}
            )

    def convert(self):
        args = self.args
        report = convert_checkpoint_to_tpa(
            args.model,
            args.out,
            self.options,
            overwrite=args.overwrite,
            progress=not args.quiet,
            placement=self.placement,
        )
        self.original = report.source
        src_el, tpa_el = report.cache_elements_per_token_source, report.cache_elements_per_token_tpa
        lines = [
            f"converted {report.family} model {report.source} -> {args.out} (conversion {report.seconds:.1f} s)",
            f"  heads {report.num_attention_heads}, KV heads {report.num_key_value_heads}, head_dim "
            f"{report.head_dim}; R_K={report.k_rank}, R_V={report.v_rank} "
            f"({'exact' if report.exact else 'approximate'}"
            f"{', calibrated on ' + str(report.calib_tokens) + ' tokens' if report.calibrated else ''})",
            f"  KV cache per token (all layers): source {src_el} elements, TPA {tpa_el} ({tpa_el / src_el:.3f}x)",
            *_layer_error_lines(report),
            *(f"  note: {n}" for n in report.notes),
        ]
        return report, lines

    def summary(self, report) -> dict:
        return report.as_dict()


def _layer_error_lines(report) -> list[str]:
    """Below the exact ranks: each layer's relative reconstruction error (weights, and activations when
    calibrated)."""
    if report.exact:
        return []
    lines = ["  per-layer relative reconstruction error (weights; activations on the calibration text):"]
    for e in report.layers:
        act = (
            f"; act K {fmt(e.k_activation_rel_err)} V {fmt(e.v_activation_rel_err)}"
            if e.k_activation_rel_err is not None
            else ""
        )
        lines.append(f"    layer {e.layer:3d}: K {e.k_weight_rel_err:.3g} V {e.v_weight_rel_err:.3g}{act}")
    return lines
