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
    p.add_argument("--seed", type=int, default=0, help="seed of data order and adapter initialisation (default: 0)")
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
    p.add_argument(  # (the training budget: everywhere else --tokens counts the verification's tokens)
        "--tokens",
        dest="train_tokens",
        metavar="TOKENS",
        type=int,
        default=262_144,
        help="training tokens the optimizer sees, over all epochs (default: 262144)",
    )
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default: 512)")
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences per optimizer step, over all processes (default: 8)"
    )
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default: 16)")
    how.add_argument("--full", action="store_true", help="fine-tune every weight instead of LoRA adapters")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 1e-3 LoRA, 2e-5 --full)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: 5%% of the steps)")


def _add_loss(p) -> None:
    """The distillation loss: temperature, LM weight, the teacher's cache and samples, layer targets, chunks."""
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default: 1)")
    p.add_argument(
        "--lm-weight",
        type=float,
        default=0.0,
        help="weight λ of the plain LM loss: loss = (1-λ) KD + λ LM (default: 0, pure distillation)",
    )
    p.add_argument(
        "--teacher-cache",
        action="store_true",
        help="run the teacher once and keep its top-k logits on disk (safetensors), reused every epoch "
        "and on --resume, instead of running it alongside the student",
    )
    p.add_argument("--cache-k", type=int, default=64, help="logits kept per position by --teacher-cache (default: 64)")
    samples = p.add_mutually_exclusive_group()
    samples.add_argument(
        "--teacher-sample-fraction",
        type=float,
        default=None,
        metavar="F",
        help="share of the tokens/seq-len training sequences sampled from the teacher itself instead of read "
        "from --text (data-free distillation; stated on the card), generated in batches on the teacher's "
        "device, deterministic for --seed, cached under the hf_symmetry cache and reused while the teacher "
        "is unchanged (default: 0.5, HealOptions' default; 0: --text only)",
    )
    samples.add_argument(
        "--teacher-samples",
        type=int,
        default=None,
        metavar="N",
        help="exactly N sequences sampled from the teacher instead of the fraction (0: none)",
    )
    p.add_argument(
        "--layer-loss-weight",
        type=float,
        default=0.0,
        metavar="W",
        help="also distil every decoder layer's output state through the conversion's layer map "
        "(layer_map.safetensors: identity for TPA/FaRR, the residual rotation cut to the kept width for "
        "compress), relative squared error per position, weighted by W (default: 0, logits only); "
        "a student without a map is distilled on the logits only",
    )
    p.add_argument(
        "--logit-chunk",
        type=int,
        default=2048,
        metavar="N",
        help="form the student's and teacher's logits, the KL and the LM loss N positions at a time "
        "(no [batch, seq, vocab] logits; same loss and gradients); 0: all at once (default: 2048)",
    )


def _add_run(p) -> None:
    """How the run goes: held-out loss and checkpoints, resuming, devices, the adapter alone."""
    p.add_argument("--eval-steps", type=int, default=None, help="held-out KD loss every N steps (default: at the end)")
    p.add_argument(
        "--save-steps",
        type=int,
        default=None,
        help="checkpoint every N steps (default: every 10%% of the steps, at most every 25)",
    )
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

    def convert(self):
        self.run = HealRun(job_from_args(self.args))
        return self.run.train(), []

    def verify(self, report, lines: list[str]) -> bool:
        """The after-figures and the card; then the lines, which state the run with its figures."""
        self.run.verify(report)
        lines.extend(summary_lines(report))
        return bool(self.run.eval_texts)

    def summary(self, report) -> dict:
        return report.as_dict()


def job_from_args(args) -> HealJob:
    """The :class:`~hf_symmetry.training.heal.HealJob` of ``heal``'s parsed arguments."""
    options = HealOptions(
        tokens=args.train_tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lora_rank=args.lora_rank,
        full=args.full,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        temperature=args.temperature,
        lm_weight=args.lm_weight,
        teacher_cache=args.teacher_cache,
        cache_k=args.cache_k,
        teacher_samples=args.teacher_samples,
        **({} if args.teacher_sample_fraction is None else {"teacher_sample_fraction": args.teacher_sample_fraction}),
        layer_loss_weight=args.layer_loss_weight,
        logit_chunk=args.logit_chunk,
        eval_steps=args.eval_steps,
        save_steps=args.save_steps,
        seed=args.seed,
    )
    eval_texts = [] if (args.no_verify or args.eval_tokens == 0) else (args.eval_text or ["britannica-eval"])
    return HealJob(
        args.model,
        args.out,
        args.teacher,
        args.train_text,
        options,
        overwrite=args.overwrite,
        resume=args.resume,
        progress=not args.quiet,
        device=args.device,
        teacher_device=args.teacher_device,
        save_adapter=args.save_adapter,
        eval_texts=eval_texts,
        eval_tokens=args.eval_tokens,
    )


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
