"""``hf-symmetry spectra MODEL OUT_DIR``: singular values and effective ranks of the fused attention
maps (value path ``W_O^h W_V^h``; score path ``W_Q^hᵀ W_K^h`` where it is exact), per layer and head
(per KV group under GQA), as ``report.json`` and PNG plots."""

from __future__ import annotations

from pathlib import Path

import torch

from ..assets import MODEL_ALIASES, resolve_model, resolve_text
from ..calibration import CalibrationText
from ..checkpoint_io import CheckpointReader, atomic_output_dir, check_output_dir
from ..conversion.farr import calibration_tokens, spectra_report
from ..conversion.farr.fused_check import check_fused_layout_layerwise
from ..devices import resolve
from ..evaluation.compare import load_tokenizer, write_json
from ..evaluation.spectra_plots import plot_layer_spectra, plot_rank_heatmaps
from ..solvers.fused import check_tau
from ..text import read_text, tokenize_text
from .common import add_device_args, emit, placement_from_args
from .inputs import CALIB_TOKENS_DEFAULT, check_text_tokens

REPORT = "report.json"
HEATMAP = "effective_rank.png"


def register(sub) -> None:
    p = sub.add_parser(
        "spectra", help="spectra and effective ranks of fused attention maps (report.json + PNGs)", description=__doc__
    )
    p.add_argument("model", help="HF model folder or embedded alias (default, smollm2, minilm)")
    p.add_argument("out", help="output folder")
    p.add_argument(
        "--tau",
        type=float,
        nargs="+",
        default=[0.99, 0.999],
        help="energy thresholds τ in (0, 1]: effective rank = smallest r with Σ_{i≤r} σ_i² ≥ τ Σ σ² "
        "(default: 0.99 0.999)",
    )
    p.add_argument("--text", default="britannica-eval", help="text for the layout check (file or embedded name)")
    p.add_argument(
        "--check-tokens",
        type=int,
        default=64,
        help="tokens the hook-based layout check runs on, one decoder layer in memory at a time (default: 64)",
    )
    p.add_argument(
        "--calibrate",
        metavar="TEXT",
        help="measure the maps in the activation-aware metric (output energy on the model's own attention "
        "inputs over TEXT, as `farr --calibrate` does) instead of the data-free Frobenius norm",
    )
    p.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (default: 2048)")
    p.add_argument(
        "--no-layout-check",
        action="store_true",
        help="skip checking the fused maps against the model's own forward (a second pass over the "
        "checkpoint, one layer at a time)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if hf-symmetry wrote it (never the input)")
    p.add_argument("--json", dest="json_out", metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_device_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    taus = [check_tau(t) for t in args.tau]  # bad input fails before any work
    placement = placement_from_args(args)
    src = resolve_model(args.model)
    check_output_dir(args.out, args.overwrite, [src])  # (the rules of every conversion: commands/runner.py)
    calib_text = resolve_text(args.calibrate) if args.calibrate is not None else None
    if calib_text is not None:
        check_text_tokens(args.calibrate, src, {"--calib-tokens": (args.calib_tokens, CALIB_TOKENS_DEFAULT["spectra"])})
    reader = CheckpointReader(src)
    name = str(args.model) if str(args.model) in MODEL_ALIASES else src.name
    ids = calibration = None
    if calib_text is not None:
        ids, calibration = calibration_tokens(src, CalibrationText(calib_text, args.calib_tokens))
    report = spectra_report(
        reader, reader.config, taus, name=name, progress=not args.quiet, calib_ids=ids, placement=placement
    )
    report["model"], report["calibration"] = str(src), calibration
    if not args.no_layout_check:
        report["layout_check"] = _layout_check(
            reader, args.text, args.check_tokens, progress=not args.quiet, placement=placement
        )
    with atomic_output_dir(args.out, args.overwrite) as tmp:
        write_json(tmp / REPORT, report)
        plot_rank_heatmaps(report, tmp / HEATMAP)
        for path in report["paths"]:
            plot_layer_spectra(report, path, tmp / f"{path}_spectra.png")
    emit(_summary(report), _lines(report, args.out), args.json_out)
    check = report.get("layout_check")
    if check and not check["passed"]:
        print(
            "LAYOUT CHECK FAILED: the fused maps do not reproduce the module's own head outputs "
            f"(see {Path(args.out) / REPORT}); do not trust these spectra"
        )
        return 1
    return 0


def _layout_check(reader: CheckpointReader, text: str, tokens: int, progress: bool = False, placement=None) -> dict:
    """The fused maps against the model's own layers (hooks), one decoder layer in memory at a time."""
    vocab = reader.config["vocab_size"]
    try:
        # a prefix of the text is plenty (and keeps the tokenizer from warning about its length)
        ids = tokenize_text(
            load_tokenizer(reader.path), read_text(resolve_text(text))[: tokens * 16], max_tokens=tokens
        )
    except (OSError, ValueError):
        ids = None
    if ids is None or int(ids.max()) >= vocab:  # no usable tokenizer: any token ids exercise the layout
        ids = torch.arange(tokens) * 7919 % vocab

    # float32 whatever --calib-dtype says: the check's tolerance is for float32 forwards
    placement = None if placement is None else resolve(placement.device, "float32")
    return check_fused_layout_layerwise(reader.path, ids, progress=progress, placement=placement).as_dict()


def _summary(report: dict) -> dict:
    return {
        k: report[k] for k in ("model", "model_type", "layout", "paths", "taus", "qk", "summary") if k in report
    } | {"layout_check": report.get("layout_check")}


def _lines(report: dict, out: str) -> list[str]:
    L = report["layout"]
    lines = [
        f"fused-map spectra of {report['model']} ({report['model_type']}: {len(report['layers'])} layers, "
        f"{L['n_heads']} heads / {L['n_kv_heads']} KV groups, head dim {L['head_dim']}), {report['metric']} metric"
    ]
    if not report["qk"]["available"]:
        lines.append(f"  score path not fused: {report['qk']['reason']}")
    elif len(report["qk"]["layers"]) < len(report["layers"]):
        lines.append(f"  score path fused on the NoPE layers {report['qk']['layers']} only (RoPE rotates the others)")
    for path in report["paths"]:
        for tau, s in report["summary"][path].items():
            kept = s["farr_kept_params_fraction"]
            lines.append(
                f"  {path} τ={tau}: mean per-group rank {s['mean_group_rank']:.1f}, mean layer rank "
                f"{s['mean_layer_rank']:.1f} / {L['head_dim']}"
                + (f"; farr --tau {tau} keeps {kept:.1%} of the {path.upper()} parameters" if kept else "")
            )
    check = report.get("layout_check")
    if check:
        qk = check["qk_max_abs_error"]
        lines.append(
            f"  layout check vs the module's forward ({check['tokens']} tokens): max rel. error per head "
            f"{check['vo_max_rel_error']:.1e}, total {check['total_max_rel_error']:.1e}"
            + (f", attention probs {qk:.1e}" if qk is not None else "")
            + (" — passed" if check["passed"] else " — FAILED")
        )
    lines.append(f"  wrote {Path(out) / REPORT}, {HEATMAP}, " + ", ".join(f"{p}_spectra.png" for p in report["paths"]))
    return lines
