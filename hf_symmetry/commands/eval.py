"""``hf-symmetry eval [MODEL] [--text FILE] [--tasks T1,T2 --task-dir DIR]``: sliding-window
perplexity on a local text and/or lm-eval tasks run offline from local task definitions
(``hf_symmetry_smoke_cloze`` is built in: ARC-Easy's format on local text, a smoke test, not a
benchmark). ``--update-card`` writes the results into MODEL's README model card."""

from __future__ import annotations

from pathlib import Path

from ..devices import parse_device
from ..evaluation.bridge import parse_tasks, require_lm_eval, run_lm_eval, text_perplexity
from ..evaluation.perplexity import PPL
from ..evaluation.verification import non_finite
from ..hub.cards import update_card
from ..hub.entries import lm_eval_card_entries, perplexity_card_entry
from ..hub.values import fmt_number
from .common import add_device_arg, emit
from .inputs import check_text_tokens


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity on a text and/or lm-eval tasks (offline)", description=__doc__)
    p.add_argument("model", nargs="?", default="default", help="model folder or embedded alias (default: SmolLM2)")
    p.add_argument(
        "--text",
        default=None,
        help="UTF-8 file or embedded text name for perplexity (default: britannica-eval, "
        "unless only --tasks are given)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=PPL.tokens,
        help=f"score the first N tokens of the text (default: {PPL.tokens}, the count every conversion "
        "and card uses; 0: the whole text, about 60000 tokens for britannica-eval: many minutes on a CPU)",
    )
    p.add_argument(
        "--window", type=int, default=PPL.window, help=f"sliding window (default: {PPL.window}, the shared definition)"
    )
    p.add_argument(
        "--stride",
        type=int,
        default=PPL.stride,
        help=f"tokens scored per window (default: {PPL.stride}, the shared definition)",
    )
    p.add_argument(
        "--tasks",
        default=None,
        metavar="T1,T2",
        help="lm-eval tasks (pip install 'hf_symmetry[eval]'), e.g. hf_symmetry_smoke_cloze, or "
        "arc_easy with its data available offline",
    )
    p.add_argument("--task-dir", default=None, metavar="DIR", help="folder of local lm-eval task YAMLs")
    p.add_argument("--limit", type=int, default=None, help="lm-eval: at most N examples per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument(
        "--update-card",
        action="store_true",
        help="add the results to MODEL/README.md (model-index metadata and the evaluation table)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    add_device_arg(p)
    p.add_argument("--json", dest="json_out", metavar="FILE")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def _check_args(args):
    """Refuse bad combinations before loading anything. Returns the lm-eval tasks (or None) and
    ``--device`` read once (:func:`~hf_symmetry.devices.parse_device`: an unusable one is refused here)."""
    device = parse_device(args.device)
    tasks = parse_tasks(args.tasks) if args.tasks else None
    if tasks:
        require_lm_eval()
    if args.task_dir and not Path(args.task_dir).is_dir():
        raise FileNotFoundError(f"task folder {args.task_dir} does not exist")
    if args.update_card and not (Path(args.model) / "config.json").is_file():
        raise ValueError("--update-card needs MODEL to be a model folder (its README.md is the card)")
    text = args.text or (None if tasks else "britannica-eval")
    if args.max_tokens < 0 or args.max_tokens == 1:  # (one token has no next token to score)
        raise ValueError(f"--max-tokens must be 0 (the whole text) or at least 2; got {args.max_tokens}")
    if args.stride <= 0 or args.stride > args.window or args.window < 2:  # (before the model loads: one line)
        raise ValueError(f"need 0 < --stride <= --window and --window >= 2; got {args.stride} and {args.window}")
    if text:  # a text too short for --max-tokens (or for perplexity at all) is refused before the model loads
        check_text_tokens(text, args.model, {"--max-tokens": (args.max_tokens or 2, PPL.tokens)})
    return tasks, device


def run(args) -> int:
    tasks, device = _check_args(args)
    text = args.text or (None if tasks else "britannica-eval")
    summary, lines, entries = {"model": str(args.model)}, [], []
    if text:
        r = text_perplexity(
            args.model,
            text,
            max_tokens=args.max_tokens or None,
            window=args.window,
            stride=args.stride,
            trust_remote_code=args.trust_remote_code,
            progress=not args.quiet,
            device=device,
        )
        entry = perplexity_card_entry(r, text, args.max_tokens or None)
        entries.append(entry)
        summary.update(text=str(text), **r.as_dict())
        lines.append(f"perplexity {fmt_number(r.perplexity)} over the {r.describe()} of {text}")
    if tasks:
        results = run_lm_eval(
            args.model,
            tasks,
            task_dir=args.task_dir,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            trust_remote_code=args.trust_remote_code,
            device=str(device.device),
        )
        task_entries = lm_eval_card_entries(results)
        entries += task_entries
        summary["lm_eval"] = {t: {k: v for k, v in m.items() if k != "alias"} for t, m in results["results"].items()}
        for e in task_entries:
            note = f"  [{e['notes']}]" if e.get("notes") else ""
            lines.append(
                f"{e['task_name']}: {e['metric_type']} {e['metric_value']:.4f} "
                f"({e['dataset_args'].get('samples')} examples){note}"
            )
    summary["card_entries"] = entries
    if args.update_card:
        lines.append(f"card updated: {update_card(args.model, eval_results=entries)}")
    emit(summary, lines, args.json_out)
    bad = non_finite({"perplexity": summary.get("perplexity")})
    if bad:  # a NaN or infinite perplexity is a broken model, not a figure: the exit status says so
        print(f"FAILED: the perplexity is {summary['perplexity']}")
        return 1
    return 0
