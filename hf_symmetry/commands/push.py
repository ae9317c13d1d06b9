"""``hf-symmetry push OUT REPO_ID``: publish a converted folder (weights, config, remote code,
tokenizer, model card) to the Hugging Face Hub in one commit. The folder is first loaded and run
in a Python where hf_symmetry cannot be imported and compared with hf_symmetry's own load and
the perplexities its card records; a folder that fails is not published. ``--eval-text`` and
``--tasks`` add evaluation results to the card before it is uploaded."""

from __future__ import annotations

from ..hub.push import (
    CardEvaluation,
    HubCommit,
    check_folder,
    check_online,
    push_folder,
    resolve_token,
    validate_repo_id,
)
from .common import emit


def register(sub) -> None:
    p = sub.add_parser(
        "push", help="publish a converted folder to the Hub (one commit, load-checked)", description=__doc__
    )
    p.add_argument("folder", metavar="OUT", help="model folder written by an hf-symmetry conversion (or any HF folder)")
    p.add_argument("repo_id", metavar="REPO_ID", help="user/name or org/name")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument(
        "--eval-text",
        default=None,
        metavar="TEXT",
        help="measure perplexity on this text (file or embedded name) and add it to the card",
    )
    p.add_argument(
        "--tasks",
        default=None,
        metavar="T1,T2",
        help="run these lm-eval tasks (offline, see `hf-symmetry eval`) and add the scores to the card",
    )
    p.add_argument("--task-dir", default=None, metavar="DIR", help="folder of local lm-eval task YAMLs")
    p.add_argument("--limit", type=int, default=None, help="lm-eval: at most N examples per task")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip the load check (not recommended: the folder may not load for others)",
    )
    p.add_argument("--commit-message", default=None)
    p.add_argument("--json", dest="json_out", metavar="FILE")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    # every refusal that needs no work comes first
    validate_repo_id(args.repo_id)
    resolve_token()
    check_online()
    check_folder(args.folder)
    tasks = [t for t in (args.tasks or "").split(",") if t.strip()] or None
    r = push_folder(
        args.folder,
        args.repo_id,
        private=args.private,
        evaluation=CardEvaluation(args.eval_text, tasks, args.task_dir, args.limit),
        check=not args.no_check,
        commit=HubCommit(message=args.commit_message),
        progress=not args.quiet,
    )
    lines = []
    if r.check:
        c = r.check
        lines.append(
            f"load check: {c['model_class'].rsplit('.', 1)[-1]} loads without hf_symmetry"
            f"{' (remote code)' if c['remote_code'] else ''}; max |Δ| vs hf_symmetry's load "
            f"{c['max_abs_diff']:.2e} over {c['tokens']} tokens"
            + "".join(
                f"; perplexity on {p['text']} {p['recomputed']:.4f} (card {p['recorded']:.4f})"
                for p in c["perplexities"]
            )
        )
    for e in r.eval_results:
        lines.append(f"card: {e.get('task_name')} / {e['dataset_name']}: {e['metric_type']} {e['metric_value']:.4f}")
    lines.append(f"pushed {len(r.files)} files ({r.bytes / 1e6:.1f} MB) to {r.repo_id} in one commit: {r.commit_url}")
    emit(r.as_dict(), lines, args.json_out)
    return 0
