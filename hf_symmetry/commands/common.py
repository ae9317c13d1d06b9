"""Arguments and output shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys


def add_output_args(p) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    p.add_argument("--json", dest="json_out", metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_text_args(p, default: str = "britannica-eval") -> None:
    p.add_argument("--text", default=default,
                   help=f"evaluation text: a UTF-8 file or an embedded name (default: {default})")
    p.add_argument("--tokens", type=int, default=512, help="tokens compared for max |Δlogit| (default: 512)")
    p.add_argument("--ppl-tokens", type=int, default=2048,
                   help="tokens of the text scored for perplexity by both models (default: 2048; 0 skips)")


def emit(summary: dict, lines: list[str], json_path: str | None = None) -> None:
    for line in lines:
        print(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2, default=str)
            f.write("\n")
    sys.stdout.flush()


def fmt(x, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


class _PushTarget(argparse.Action):
    """``--push-to-hub REPO``: checked while parsing (repo id, token, offline mode), so a push
    that cannot happen fails before the conversion does any work."""

    def __call__(self, parser, namespace, value, option_string=None):
        from ..hub.push import check_online, resolve_token, validate_repo_id

        try:
            validate_repo_id(value)
            resolve_token()
            check_online()
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, value)


def add_push_args(p) -> None:
    """``--push-to-hub REPO [--private]`` for a conversion command; pair with ``push_if_requested``."""
    g = p.add_argument_group("publishing")
    g.add_argument("--push-to-hub", metavar="REPO_ID", action=_PushTarget, default=None,
                   help="publish OUT to the Hub as REPO_ID in one commit, after checking that it loads "
                        "without hf_symmetry (token: HF_TOKEN or `hf auth login`)")
    g.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")


def push_if_requested(args, out_dir, lines: list[str] | None = None) -> dict | None:
    """Push ``out_dir`` (its card already written) when ``--push-to-hub`` was given; appends a
    line to ``lines`` and returns the push summary (for the command's JSON), else None."""
    repo_id = getattr(args, "push_to_hub", None)
    if not repo_id:
        return None
    from ..hub.push import push_folder

    result = push_folder(out_dir, repo_id, private=getattr(args, "private", False),
                         progress=not getattr(args, "quiet", False))
    if lines is not None:
        lines.append(f"  pushed {len(result.files)} files ({result.bytes / 1e6:.1f} MB) to {result.commit_url}")
    return result.as_dict()


def verify_and_record(args, original, out_dir, lines: list[str], names: tuple[str, str] = ("original", "converted"),
                      against: str = "", extra=None) -> dict:
    """Compare ``out_dir`` with ``original`` on ``--text`` (max |Δ| and perplexities), append the
    figures to ``lines`` and to the folder's model card. ``extra(verification)`` may return more
    ``(figures, lines)`` for both. Returns the exactness figures (``Verification.as_dict()`` + extra)."""
    from ..evaluation.bridge import verification_card_entries
    from ..evaluation.compare import verify
    from ..hub.cards import update_card

    v = verify(original, out_dir, text=args.text, tokens=args.tokens, ppl_tokens=args.ppl_tokens)
    exactness = v.as_dict()
    lines.append(f"  max |Δ{'logit' if v.output_kind == 'logits' else 'hidden'}|{against} over {v.tokens} tokens: "
                 f"{v.max_abs_dlogit:.2e}")
    if v.perplexity_original is not None:
        lines.append(f"  perplexity: {names[0]} {v.perplexity_original:.4f}, {names[1]} {v.perplexity_converted:.4f} "
                     f"(Δ {fmt(v.delta_perplexity, '.2e')})")
    if extra is not None:
        figures, more = extra(v)
        exactness.update(figures)
        lines.extend(more)
    update_card(out_dir, exactness=exactness, eval_results=verification_card_entries(v))
    return exactness
