"""``hf-symmetry to-tpa [MODEL] OUT``: convert a Llama/Mistral/Qwen2 checkpoint into a Tensor Product
Attention (T6-style, TPA-KV-only, non-contextual A) model. Exact at full rank (the default,
``--k-rank = --v-rank = number of KV heads``); below it the KV-head mode is reduced by a head-mode SVD,
optionally fitted to the attention inputs of a calibration text (``--calib``)."""

from __future__ import annotations

from ..conversion.to_tpa import convert_checkpoint_to_tpa
from .common import add_output_args, add_push_args, add_text_args, emit, fmt, push_if_requested


def register(sub) -> None:
    p = sub.add_parser("to-tpa", help="convert a Llama/Mistral/Qwen2 checkpoint to Tensor Product Attention",
                       description=__doc__)
    p.add_argument("model", nargs="?", default="default",
                   help="HF model folder or embedded alias (default: SmolLM2-135M-Instruct)")
    p.add_argument("out", help="output folder")
    p.add_argument("--k-rank", type=int, default=None, help="R_K (default: number of KV heads = exact)")
    p.add_argument("--v-rank", type=int, default=None, help="R_V (default: number of KV heads = exact)")
    p.add_argument("--calib", default=None, metavar="FILE",
                   help="calibration text (file or embedded name, e.g. britannica-calib) for reduced ranks")
    p.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (default: 2048)")
    p.add_argument("--no-verify", action="store_true", help="skip the logit/perplexity comparison with the source")
    add_text_args(p)
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("k_rank", "v_rank"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.calib_tokens <= 0 or args.tokens <= 1 or getattr(args, "ppl_tokens", 0) < 0:
        raise ValueError("--calib-tokens must be positive, --tokens at least 2 and --ppl-tokens not negative")
    report = convert_checkpoint_to_tpa(
        args.model, args.out, k_rank=args.k_rank, v_rank=args.v_rank, calib=args.calib,
        calib_tokens=args.calib_tokens, verify_text=None if args.no_verify else args.text,
        verify_tokens=args.tokens, ppl_tokens=getattr(args, "ppl_tokens", 2048), overwrite=args.overwrite,
        progress=not args.quiet)
    src_el, tpa_el = report.cache_elements_per_token_source, report.cache_elements_per_token_tpa
    lines = [
        f"converted {report.family} model {report.source} -> {args.out} in {report.seconds:.1f} s",
        f"  heads {report.num_attention_heads}, KV heads {report.num_key_value_heads}, head_dim {report.head_dim}; "
        f"R_K={report.k_rank}, R_V={report.v_rank} ({'exact' if report.exact else 'approximate'}"
        f"{', calibrated on ' + str(report.calib_tokens) + ' tokens' if report.calibrated else ''})",
        f"  KV cache per token (all layers): source {src_el} elements, TPA {tpa_el} "
        f"({tpa_el / src_el:.3f}x)",
    ]
    if not report.exact:
        lines.append("  per-layer relative reconstruction error (weights; activations on the calibration text):")
        for e in report.layers:
            act = (f"; act K {fmt(e.k_activation_rel_err)} V {fmt(e.v_activation_rel_err)}"
                   if e.k_activation_rel_err is not None else "")
            lines.append(f"    layer {e.layer:3d}: K {e.k_weight_rel_err:.3g} V {e.v_weight_rel_err:.3g}{act}")
    v = report.verification
    if v:
        lines.append(f"  max |Δlogit| over {v['tokens']} tokens of {v['text']}: {v['max_abs_dlogit']:.2e}")
        if "perplexity_tpa" in v:
            lines.append(f"  perplexity ({v['ppl_tokens']} tokens): source {v['perplexity_source']:.4f}, "
                         f"TPA {v['perplexity_tpa']:.4f}")
    lines.extend(f"  note: {n}" for n in report.notes)
    summary = report.as_dict()
    summary["push"] = push_if_requested(args, args.out, lines)
    emit(summary, lines, args.json_out)
    return 0
