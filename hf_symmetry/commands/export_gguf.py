"""``hf-symmetry export-gguf FOLDER OUT.gguf``: a stock output (rotated, matched, merged, stock-sliced) as
one GGUF file for llama.cpp and its front ends; ``--check`` reads it back through transformers' GGUF
loader and compares greedy text and logits with the folder.

The file names the pre-tokenizer llama.cpp splits text by (``tokenizer.ggml.pre``: smollm, qwen2,
llama-bpe ...), found as llama.cpp's own converter finds it (a hash of the tokenizer's ids for a fixed
check text); a tokenizer llama.cpp does not know gets 'default' and a WARNING, since llama.cpp may then
tokenize differently from transformers."""

from __future__ import annotations

from dataclasses import asdict

from ..assets import resolve_model
from ..conversion.gguf_export import TYPES, export_gguf, round_trip
from .runner import Conversion, run_conversion


def register(sub) -> None:
    p = sub.add_parser("export-gguf", help="write a stock Hugging Face folder as a GGUF file", description=__doc__)
    p.add_argument(
        "model",
        help="HF folder of a stock Llama / Mistral / Qwen2 / Qwen3 model (e.g. the output of "
        "rotate, match, merge or compress --structure slice --untie), or 'default' (the embedded "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument("out", help="the GGUF file to write (ends in .gguf)")
    p.add_argument(
        "--type",
        choices=TYPES,
        default="f16",
        help="tensor type of the matrices (norms stay float32; a matrix whose rows do not fill whole "
        "blocks falls back to f16) (default: f16)",
    )
    p.add_argument(
        "--name",
        help="general.name of the file (default: the folder's name; 'mistral' for a "
        "MistralForCausalLM, which transformers' GGUF loader needs)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="read the file back through transformers (from_pretrained(..., gguf_file=...)) and "
        "compare greedy text and logits with the folder",
    )
    p.add_argument(
        "--prompt",
        default="The capital of France is",
        help="prompt of --check's greedy generation (default: %(default)r)",
    )
    p.add_argument("--new-tokens", type=int, default=32, help="tokens --check generates (default: 32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json-out", metavar="PATH", help="also write the summary as JSON to PATH")
    p.set_defaults(func=run)


def _same(flag) -> str:
    return {True: "alike", False: "DIFFERENTLY", None: "(no tokenizer in the file)"}[flag]


def run(args) -> int:
    return run_conversion(ExportGGUF(args))


class ExportGGUF(Conversion):
    """``export-gguf``: the folder written as one GGUF file; its verification is ``--check``'s read-back through
    transformers (no card, no push)."""

    publishes = False
    writes_file = True

    def check(self) -> None:
        self.original = resolve_model(self.args.model)

    def convert(self):
        args = self.args
        report = export_gguf(
            self.original, args.out, type=args.type, overwrite=args.overwrite, name=args.name, progress=not args.quiet
        )
        types = ", ".join(f"{k} {v}" for k, v in sorted(report.tensor_types.items()))
        lines = [
            f"exported {args.model} -> {args.out} (GGUF {report.architecture}, {args.type}) in {report.seconds:.1f} s",
            f"  {report.tensors} tensors ({types}), {report.bytes / 1e6:.1f} MB; tokenizer: {report.tokenizer}",
            *(f"  WARNING: {w}" for w in report.warnings),
        ]
        return report, lines

    def verify(self, report, lines: list[str]) -> bool:
        args = self.args
        if args.check:
            self.round_trip = check = round_trip(
                self.original, args.out, prompt=args.prompt, new_tokens=args.new_tokens
            )
            lines.append(
                f"  read back through transformers: greedy text {'equal' if check['same_text'] else 'DIFFERENT'} "
                f"({check['new_tokens']} new tokens), max |Δlogit| {check['max_abs_dlogit']:.3g} over "
                f"{check['tokens']} tokens (logit scale {check['max_abs_logit']:.3g}); the file's tokenizer "
                f"tokenizes the prompt {_same(check['same_tokenization'])}; read by {check['read_by']}"
            )
        return args.check

    def summary(self, report) -> dict:
        summary = asdict(report)
        if self.args.check:
            summary["check"] = self.round_trip
        return summary
