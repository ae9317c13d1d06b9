"""``hf-symmetry farr MODEL OUT (--tau T | --params-fraction F) [--vo] [--qk]``: fuse and rank reduce.

Truncates each KV group's fused value map ``W_O W_V`` (and, with ``--qk``, the score map
``W_Qᵀ W_K``, only where it is exact: no RoPE, no QK-norm, e.g. BERT/RoBERTa and the NoPE layers of
SmolLM3) and splits it back
with ``√Σ`` on each side, giving per-layer value (and query/key) head dims. The output is a FaRR
model folder (custom class, loads with ``trust_remote_code=True`` without hf_symmetry)."""

from __future__ import annotations

import torch

from ..assets import resolve_model, resolve_text
from ..conversion.farr import FarrOptions, farr_checkpoint
from ..evaluation.compare import load_model, load_tokenizer
from ..evaluation.perplexity import read_text, tokenize_text
from .common import add_output_args, add_push_args, add_text_args, emit, push_if_requested, verify_and_record


def register(sub) -> None:
    p = sub.add_parser("farr", help="fuse and rank reduce attention (smaller per-layer V/O, Q/K head dims)",
                       description=__doc__)
    p.add_argument("model", help="HF model folder or embedded alias (default, smollm2, minilm)")
    p.add_argument("out", help="output folder")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tau", type=float,
                     help="energy threshold in (0, 1]: each KV group keeps the fewest singular directions holding "
                          "a fraction τ of its fused map's Σσ²; each layer takes the largest rank of its groups")
    how.add_argument("--params-fraction", type=float,
                     help="fraction in (0, 1] of the parameters of the projections FaRR rewrites (v_proj+o_proj "
                          "for --vo, q_proj+k_proj for --qk, weights and biases, all layers) that the result keeps; "
                          "spent greedily across layers on the most energy per parameter")
    p.add_argument("--vo", action="store_true", help="reduce the value/output path (the default when --qk is absent)")
    p.add_argument("--qk", action="store_true",
                   help="reduce the query/key path; only where W_Q^T W_K is exact (no RoPE, no QK-norm: BERT, RoBERTa, "
                        "and SmolLM3's NoPE layers, while its RoPE layers keep their query/key heads)")
    p.add_argument("--calibrate", metavar="TEXT",
                   help="activation-aware truncation (beyond the FaRR paper): measure each map by its output error "
                        "on the model's own attention inputs over TEXT (file or embedded name, e.g. britannica-calib) "
                        "instead of the data-free Frobenius norm; τ and the budget then count that energy")
    p.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (default: 2048)")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default: 2GB)")
    p.add_argument("--no-verify", action="store_true", help="skip comparing the result with the original")
    add_text_args(p)
    add_output_args(p)
    add_push_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    options = FarrOptions(tau=args.tau, params_fraction=args.params_fraction, vo=args.vo or not args.qk, qk=args.qk)
    options.validate()
    src = resolve_model(args.model)
    if args.calibrate is not None:
        resolve_text(args.calibrate)   # a missing text fails before any work
    report = farr_checkpoint(src, args.out, options, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                             progress=not args.quiet, calib_text=args.calibrate, calib_tokens=args.calib_tokens)
    lines = [f"farr {src} -> {args.out} ({report.model_type}) in {report.seconds:.1f} s",
             f"  rewritten projections keep {report.touchable_params_after:,} of {report.touchable_params_before:,} "
             f"parameters ({report.touchable_kept_fraction:.1%}); model {report.params_before:,} -> "
             f"{report.params_after:,}"]
    for path, ranks in report.ranks.items():
        worst = min(min(groups) for groups in report.kept_energy[path] if groups is not None)   # None: kept whole
        lines.append(f"  {path} head dims (of {report.head_dim}): {_runs(ranks)}; least energy kept by a group "
                     f"{worst:.4%}")
    if report.calibration:
        lines.append(f"  calibrated on {report.calibration['tokens']} tokens of {report.calibration['text']} "
                     "(energies are output energies on those activations)")
    lines += [f"  note: {n}" for n in report.notes]
    if not args.no_verify:
        def cosine(v) -> tuple[dict, list[str]]:
            if v.output_kind != "hidden_states":
                return {}, []
            c = hidden_cosine(src, args.out, args.text, args.tokens)
            return {"hidden_cosine": c}, [f"  mean cosine of last hidden states to the original: {c:.6f}"]

        report.verification = verify_and_record(args, src, args.out, lines, ("original", "FaRR"), extra=cosine)
    summary = report.as_dict()
    summary["push"] = push_if_requested(args, args.out, lines)
    emit(summary, lines, args.json_out)
    return 0


@torch.no_grad()
def hidden_cosine(original, converted, text: str, tokens: int) -> float:
    """Mean over tokens of the cosine between the two models' last hidden states."""
    a, b = load_model(original), load_model(converted)
    limit = getattr(a.config, "max_position_embeddings", None) or tokens
    n = min(tokens, limit)
    ids = tokenize_text(load_tokenizer(original), read_text(resolve_text(text))[:n * 16], max_tokens=n)
    ha, hb = (m(input_ids=ids[None]).last_hidden_state[0] for m in (a, b))
    return torch.nn.functional.cosine_similarity(ha, hb, dim=-1).mean().item()


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
