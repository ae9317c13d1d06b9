"""``hf-symmetry heal CONVERTED OUT --teacher ORIGINAL --text TEXT``: recovery fine-tuning by distillation.

Trains the converted model to match the original's next-token distribution (KL at a temperature,
optionally mixed with the LM loss) on local text and, by default, as many sequences sampled from the
original itself (--teacher-sample-fraction 0.5; issue 30's recipe: pure KD with half the sequences from
the teacher; the earlier recipe: --lm-weight 0.5 --teacher-sample-fraction 0), with LoRA adapters on
every projection (on the factor matrices of structured layers) merged into the weights at the end, or
with --full fine-tuning.
OUT is the same model family as CONVERTED (custom families load with trust_remote_code=True, without
hf_symmetry) and its card shows perplexity before and after, the teacher, the tokens and the settings.

Runs on one CPU or GPU, or data parallel with several processes, unchanged:
  accelerate launch -m hf_symmetry heal ...      torchrun --nproc_per_node N -m hf_symmetry heal ...
Checkpoints go to OUT.heal-run/ every --save-steps; --resume continues an interrupted run from there."""

from __future__ import annotations

import argparse

from ..evaluation.perplexity import PPL
from ..flags import add_flags, from_args
from ..training import is_main_process
from ..training.heal import HealJob, HealOptions, HealRun
from .common import add_device_arg, add_output_args
from .runner import Conversion, run_conversion


def register(sub) -> None:
    p = sub.add_parser(
        "heal",
        help="recovery fine-tuning of a converted model by distillation (LoRA or full)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(p)
    _add_budget(p)
    _add_loss(p)
    _add_run(p)
    _add_heldout(p)
    add_flags(p, HealOptions, "seed")
    add_output_args(p)
    p.set_defaults(func=run)


def _add_inputs(p) -> None:
    """CONVERTED, OUT, the teacher and the training text."""
    p.add_argument("model", metavar="CONVERTED", help="converted model folder (the student)")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist unless --overwrite)")
    p.add_argument(
        "--teacher",
        required=True,
        metavar="ORIGINAL",
        help="the original model folder or embedded alias (smollm2); must share the student's tokenizer",
    )
    p.add_argument(  # (the training text: everywhere else --text is the verification text)
        "--text",
        dest="train_text",
        action="append",
        required=True,
        metavar="TEXT",
        help='training text: a UTF-8 file, a JSONL file with a "text" field, or an embedded name '
        "(e.g. britannica-calib); repeat for several. Split by document into train/held-out",
    )


def _add_budget(p) -> None:
    """The token budget, the batches, LoRA or full fine-tuning, the learning rate and its warmup."""
    # (--tokens is the training budget here: everywhere else it counts the verification's tokens)
    add_flags(p, HealOptions, "tokens", "seq_len", "batch_size", "grad_accum")
    add_flags(p.add_mutually_exclusive_group(), HealOptions, "lora_rank", "full")
    add_flags(p, HealOptions, "lr", "warmup_steps")


def _add_loss(p) -> None:
    """The distillation loss: temperature, LM weight, the teacher's cache and samples, layer targets, chunks."""
    add_flags(p, HealOptions, "temperature", "lm_weight", "teacher_cache", "cache_k")
    add_flags(p.add_mutually_exclusive_group(), HealOptions, "teacher_sample_fraction", "teacher_samples")
    add_flags(p, HealOptions, "layer_loss_weight", "logit_chunk")


def _add_run(p) -> None:
    """How the run goes: held-out loss and checkpoints, resuming, devices, the adapter alone."""
    add_flags(p, HealOptions, "eval_steps", "save_steps")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run kept in OUT.heal-run/")
    add_device_arg(p, "; under accelerate/torchrun each process uses its own GPU")
    p.add_argument("--teacher-device", default=None, help="run the teacher on another device (default: the student's)")
    p.add_argument("--save-adapter", action="store_true", help="also write the PEFT adapter alone to OUT/adapter/")


def _add_heldout(p) -> None:
    """The held-out perplexity before and after (``--eval-text``, ``--ppl-tokens``, ``--no-verify``)."""
    # --text/--tokens are the training text and budget here, so the held-out text of the shared
    # verification flags (commands/common.add_verify_args) is --eval-text; --ppl-tokens and --no-verify
    # mean what they mean in every other command.
    g = p.add_argument_group("held-out perplexity (teacher, before and after; --text is the training text here)")
    g.add_argument(
        "--eval-text",
        action="append",
        default=None,
        metavar="TEXT",
        help="held-out text for perplexity before/after (default: britannica-eval); repeatable",
    )
    g.add_argument(
        "--ppl-tokens",
        "--eval-tokens",
        dest="eval_tokens",
        type=int,
        default=PPL.tokens,
        metavar="N",
        help=f"tokens of each --eval-text scored, sliding window {PPL.window}, stride {PPL.stride} "
        f"(default: {PPL.tokens}; 0 skips)",
    )
    g.add_argument("--no-verify", action="store_true", help="skip the before/after perplexity")


def run(args) -> int:
    return run_conversion(Heal(args))


class Heal(Conversion):
    """``heal`` on the runner: OUT's checks and lock, ``--json`` and the total-time line come from it. Its own
    refusals (:class:`~hf_symmetry.training.heal.HealRun`) run at the start of the conversion, after OUT's checks;
    its verification is the run's own after-figures (held-out perplexity of the teacher, before and after, and the
    held-out KL), which also write the card. Under accelerate or torchrun every process trains; the first one
    writes OUT, verifies and prints."""

    publishes = False  # (heal takes no --push-to-hub)

    def __init__(self, args) -> None:
        super().__init__(args)
        self.main_process = is_main_process()
        self.run = None

    def inputs(self) -> list:
        return [self.args.model, self.args.teacher]

    def job(self) -> HealJob:
        """What the run is asked to do: the recipe from its flags (declared on :class:`HealOptions`), the rest
        from the command's own flags."""
        args = self.args
        eval_texts = [] if (args.no_verify or args.eval_tokens == 0) else (args.eval_text or ["britannica-eval"])
        return HealJob(
            args.model,
            args.out,
            args.teacher,
            args.train_text,
            from_args(HealOptions, args),
            overwrite=args.overwrite,
            resume=args.resume,
            progress=not args.quiet,
            device=args.device,
            teacher_device=args.teacher_device,
            save_adapter=args.save_adapter,
            eval_texts=eval_texts,
            eval_tokens=args.eval_tokens,
        )

    def convert(self):
        self.run = HealRun(self.job())
        return self.run.train(), []

    def verify(self, report, lines: list[str]) -> bool:
        """The after-figures and the card; then the lines, which state the run with its figures."""
        self.run.verify(report)
        lines.extend(summary_lines(report))
        return bool(self.run.eval_texts)

    def summary(self, report) -> dict:
        return report.as_dict()


def summary_lines(r) -> list[str]:
    """The lines ``heal`` prints of its report ``r``."""
    lines = [
        f"heal {r.source} -> {r.output} ({r.model_type}, {r.mode}) in {r.seconds:.1f} s",
        f"  {r.steps} steps, {r.train_tokens:,} training tokens, {r.tokens_per_second:.0f} tokens/s "
        f"({r.processes} process(es) on {r.device}; training took {r.train_cpu_seconds:.0f} CPU-s on the "
        f"main process); {r.trainable_params:,} trainable parameters",
    ]
    if r.layer_targets != "off":
        lines.append(f"  layer targets: {r.layer_targets}")
    if r.teacher_samples:
        lines.append(
            f"  teacher samples: {r.teacher_samples} sequences"
            + (" (read from the cache)" if r.teacher_samples_reused else " (sampled, now cached)")
        )
    if r.resumed_from:
        lines.append(f"  resumed from {r.resumed_from}")
    if r.heldout_kl_before is not None:
        lines.append(f"  held-out KL to the teacher: {r.heldout_kl_before:.4f} -> {r.heldout_kl_after:.4f}")
    for text, p in r.perplexity.items():
        lines.append(
            f"  perplexity on {text} ({p['tokens']} tokens): teacher {p['teacher']:.3f}, "
            f"before {p['before']:.3f}, after {p['after']:.3f}"
        )
    if r.adapter_dir:
        lines.append(f"  adapter alone: {r.adapter_dir}")
    return lines
