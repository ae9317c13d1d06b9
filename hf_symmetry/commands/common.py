"""Arguments and output shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from huggingface_hub import utils as hub_utils
from transformers.utils import logging as hf_logging

from ..assets import resolve_model
from ..checkpoint_io import TOKENIZER_FILES
from ..devices import CALIB_DTYPES, DEVICE_CHOICES, parse_device, resolve
from ..evaluation.perplexity import LOGIT_TOKENS, PPL
from ..evaluation.verification import Verification, VerificationFailed, Verifier
from ..hub.cards import update_card
from ..hub.entries import verification_card_entries
from ..hub.measure import speed_card_entry, speed_sentence
from ..hub.push import check_online, push_folder, resolve_token, validate_repo_id
from ..hub.values import fmt_number
from .inputs import check_text, check_text_tokens, is_causal_lm_folder


def add_output_args(p) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if hf-symmetry wrote it or it is an HF model folder (never an input)",
    )
    p.add_argument("--json", dest="json_out", metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_device_arg(p, extra: str = "") -> None:
    """The one ``--device`` flag of every command that loads a model (conversions, ``verify``,
    ``eval``, ``heal``), read by :func:`hf_symmetry.devices.parse_device` alone (``auto`` and ``cuda``
    become ``cuda:<current index>``). ``p``: a parser or an argument group; added once per parser."""
    if "--device" in p._option_string_actions:  # (an argument group shares its parser's)
        return
    p.add_argument(
        "--device",
        default="auto",
        help=f"where the model runs: {DEVICE_CHOICES} (default auto: the current CUDA device when "
        "torch sees a GPU, else the CPU; verification with auto lets accelerate's device map "
        f"spread a model too large for one GPU over the GPUs, the CPU and disk){extra}",
    )


def add_device_args(p, calib_dtype: bool = True) -> None:
    """``--device`` (:func:`add_device_arg`) and ``--calib-dtype`` for commands that calibrate,
    checked by :func:`placement_from_args` before any work."""
    add_device_arg(p)
    if calib_dtype and "--calib-dtype" not in p._option_string_actions:
        p.add_argument(
            "--calib-dtype",
            choices=list(CALIB_DTYPES),
            default="float32",
            help="dtype of calibration activations and layer weights on the device (default float32)",
        )


def placement_from_args(args):
    """The :class:`~hf_symmetry.devices.Placement` of a command's ``--device``/``--calib-dtype`` flags
    (:func:`add_device_args`; the device read by :func:`hf_symmetry.devices.parse_device`); an unusable
    device or dtype fails here, before any work."""
    return resolve(getattr(args, "device", "auto"), getattr(args, "calib_dtype", "float32"))


def add_verify_args(
    p, what: str = "the original", default_text: str = "britannica-eval", no_verify: bool = True
) -> None:
    """The one set of verification flags every conversion takes: ``--no-verify``, ``--text``,
    ``--tokens``, ``--ppl-tokens`` (and ``--device``). The perplexity definition is the shared one
    (:data:`hf_symmetry.evaluation.perplexity.PPL`: window 512, stride 256)."""
    g = p.add_argument_group("verification (after the folder is written)")
    if no_verify:
        g.add_argument("--no-verify", action="store_true", help=f"skip comparing OUT with {what}")
    g.add_argument(
        "--text",
        default=default_text,
        help=f"verification text: a UTF-8 file or an embedded name (default: {default_text})",
    )
    g.add_argument(
        "--tokens", type=int, default=LOGIT_TOKENS, help=f"tokens compared for max |Δlogit| (default: {LOGIT_TOKENS})"
    )
    g.add_argument(
        "--ppl-tokens",
        type=int,
        default=PPL.tokens,
        help=f"tokens scored for perplexity, sliding window {PPL.window}, stride {PPL.stride} "
        f"(default: {PPL.tokens}; 0 skips)",
    )
    add_device_arg(g)


def check_verify_args(args, tokenizer_from=None) -> None:
    """Refuse bad verification flags before any work. ``tokenizer_from``: the model folder (or
    alias) whose tokenizer the verification will use; a folder without one is refused here, rather
    than after the conversion has written its output."""
    if getattr(args, "no_verify", False):
        return
    if args.tokens < 2 or args.ppl_tokens < 0 or args.ppl_tokens == 1:
        raise ValueError(
            f"--tokens must be at least 2 and --ppl-tokens 0 or at least 2; got {args.tokens} and {args.ppl_tokens}"
        )
    check_text(args.text, "--text")
    parse_device(getattr(args, "device", "auto"))
    if tokenizer_from is not None:
        folder = resolve_model(tokenizer_from)
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(
                f"{tokenizer_from} has no tokenizer files ({', '.join(TOKENIZER_FILES)}), which "
                "verification needs: add them to the folder or pass --no-verify"
            )
        needs = {"--tokens": (args.tokens, LOGIT_TOKENS)}
        if is_causal_lm_folder(folder):  # (an encoder has no perplexity: --ppl-tokens asks for nothing)
            needs["--ppl-tokens"] = (args.ppl_tokens, PPL.tokens)
        check_text_tokens(args.text, folder, needs)


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
    g.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        action=_PushTarget,
        default=None,
        help="publish OUT to the Hub as REPO_ID in one commit, after checking that it loads "
        "without hf_symmetry (token: HF_TOKEN or `hf auth login`)",
    )
    g.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")


def push_if_requested(args, out_dir, lines: list[str] | None = None) -> dict | None:
    """Push ``out_dir`` (its card already written) when ``--push-to-hub`` was given; appends a
    line to ``lines`` and returns the push summary (for the command's JSON), else None."""
    repo_id = getattr(args, "push_to_hub", None)
    if not repo_id:
        return None

    result = push_folder(
        out_dir, repo_id, private=getattr(args, "private", False), progress=not getattr(args, "quiet", False)
    )
    if lines is not None:
        lines.append(f"  pushed {len(result.files)} files ({result.bytes / 1e6:.1f} MB) to {result.commit_url}")
    return result.as_dict()


@dataclass
class Verified:
    """A conversion's verification (:func:`verify_output`): what was measured and the figures its card and ``--json``
    summary record (the exactness figures, with ``speed``: :func:`~hf_symmetry.hub.measure.speed_card_entry`, speed
    and bytes against the source, where both models fit the device together)."""

    measured: Verification
    exactness: dict  # as_dict() less its seconds (a timing: the card stays reproducible)
    speed: dict | None = None

    @property
    def figures(self) -> dict:
        return self.exactness if self.speed is None else {**self.exactness, "speed": self.speed}


def verify_output(
    args, original, out_dir, lines: list[str], names: tuple[str, str] = ("original", "converted"), against: str = ""
) -> Verified | None:
    """The one verification of every conversion (:meth:`.runner.Conversion.verify`), its first half: compare
    ``out_dir`` with ``original`` on ``--text`` (:class:`hf_symmetry.evaluation.verification.Verifier`, which also
    times the two models it loaded) and append the figures to ``lines``, formatted as the card formats them.
    None with ``--no-verify``. :func:`record_in_card` is the second half."""
    if getattr(args, "no_verify", False):
        return None
    v = Verifier(
        text=args.text,
        tokens=args.tokens,
        ppl_tokens=args.ppl_tokens,
        device=getattr(args, "device", "auto"),
        progress=not getattr(args, "quiet", False),
        speed=True,
    ).run(original, out_dir)
    kind = "logit" if v.output_kind == "logits" else "hidden state"
    lines.append(f"  max |Δ{kind}|{against} over {v.tokens} tokens of {v.text}: {fmt_number(v.max_abs_dlogit)}")
    if v.hidden_cosine is not None:
        lines.append(f"  mean cosine of last hidden states to {names[0]}: {fmt_number(v.hidden_cosine)}")
    if v.perplexity_original is not None:
        lines.append(
            f"  perplexity ({v.describe_perplexity()}): {names[0]} {fmt_number(v.perplexity_original)}, "
            f"{names[1]} {fmt_number(v.perplexity_converted)} (Δ {fmt_number(v.delta_perplexity)})"
        )
    # speed and bytes against the source (timings: recorded only when a verification runs; none when it failed)
    speed = speed_card_entry(v.speed, original, out_dir) if v.speed is not None else None
    if speed is not None:
        lines.append(f"  {speed_sentence(speed)}")
    return Verified(v, {k: x for k, x in v.as_dict().items() if k != "seconds"}, speed)


def record_in_card(out_dir, verified: Verified, lines: list[str]) -> None:
    """The second half of the one verification (:func:`verify_output`): a NaN or infinite figure fails the command
    (OUT stays written, the user may want to look at it; exit status 1), else the figures go into the folder's model
    card and the last line says how long the verification took."""
    v = verified.measured
    failure = v.failure()
    if failure is not None:
        emit({}, lines)
        raise VerificationFailed(f"{out_dir} was written but failed verification: {failure}")
    update_card(out_dir, exactness=verified.exactness, speed=verified.speed, eval_results=verification_card_entries(v))
    lines.append(f"  verified in {v.seconds:.1f} s")


def total_time_line(start: float, verified: bool = True) -> str:
    """The last line of a conversion: wall time of the whole command; ``verified``: whether a verification
    ran in it (only then does the line say it is included)."""
    return f"done in {time.perf_counter() - start:.1f} s (whole command{', verification included' if verified else ''})"


@contextmanager
def progress_bars(enabled: bool):
    """Every command's ``--quiet``, in one place (:func:`hf_symmetry.cli.main` runs each command inside): the
    commands' own bars follow ``progress=not args.quiet``; this turns off, for the command, the bars of the
    libraries it calls (transformers' "Loading weights" and "Writing model shards", huggingface_hub's
    uploads), and restores their previous state afterwards."""
    if enabled:
        yield
        return
    was_on, hub_was_on = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # (and huggingface_hub's)
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_was_on:
            hub_utils.enable_progress_bars()
        else:
            hub_utils.disable_progress_bars()
