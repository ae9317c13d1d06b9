"""Rotations for low-bit weight quantization (issue 29): held-out perplexity of SmolLM2-135M,
original vs plain Hadamard ``rotate`` vs ``rotate --for-quantization`` (balanced, and with a learned
residual rotation), every decoder-layer linear quantized weight-only by a real quantizer and
dequantized back into the HF model:

* GGUF Q4_0 / Q4_1 / MXFP4 (blocks of 32) through the ``gguf`` package's quantizers;
* bitsandbytes NF4 (blocks of 64, float32 absmax: what ``load_in_4bit`` stores) through ``bitsandbytes``;
* HQQ 4-bit and 3-bit (``hqq`` package, groups of 64 and 128; ``-rtn``: without HQQ's slow optimiser): ``gguf`` has no
  Python quantizer for
  the k-quants (Q3_K, Q4_K: dequantize only), so HQQ supplies 3 bits.

SmolLM2's weights are themselves dequantized Q4_1 GGUF weights, so the unrotated model sits exactly
on the Q4_1 grid; the other quantizers (other grids, block sizes and bit widths) control for that.
A model trained here in float removes it: benchmarks/train_quant_control.py, then ``--model FOLDER
--label control-llama-d256``. The ``scales`` variants (activation-aware exact scales,
hf_symmetry.conversion.quantization.scales) are built once per quantizer, searched against it on 2048 tokens
of britannica-calib.

Perplexity: the project's definition (hf_symmetry.evaluation.perplexity), 2048 tokens of
``hamlet`` (not used for anything else here; the learned rotation sees only weights).

Run: .venv/bin/python benchmarks/bench_quant_rotation.py [--variants ...] [--quantizers ...]
(writes benchmarks/results/quant_rotation.json, merging with what is there when it starts: a run
alongside another writes its own file, ``--out``). Threads: ``OMP_NUM_THREADS``, else 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quant_rotation.json"

VARIANTS = {
    "original": None,
    "hadamard": dict(residual="hadamard", heads="none", ffn=False),
    "for-quantization": dict(residual="hadamard", for_quantization=True),
    # the massive-activation channels (found on britannica-calib) kept out of the Hadamard
    "for-quantization-hold-out": dict(residual="hadamard", for_quantization=True, hold_out="massive"),
    "for-quantization-alpha0.5": dict(residual="hadamard", for_quantization=True, balance_alpha=0.5),
    "for-quantization-no-residual": dict(residual="none", for_quantization=True),
    "for-quantization-learned-Q4_0": dict(residual="hadamard", for_quantization=True, learn="Q4_0", learn_iterations=6),
    "for-quantization-learned-hqq3g64": dict(
        residual="hadamard", for_quantization=True, learn="hqq3g64", learn_iterations=4
    ),
    # activation-aware exact scales (quantization.scales), searched against the quantizer they are evaluated
    # with ("@"), on 2048 tokens of britannica-calib: no residual rotation (the massive activations
    # stay in their few columns), with or without the per-head V/O Hadamards, and after the Hadamard
    "scales": dict(residual="none", for_quantization=True, vo_hadamard=False, scales="@"),
    # the default `--for-quantization` preset: the same, residual channels sorted by calibration activation RMS
    "scales-sorted": dict(residual="none", for_quantization=True, vo_hadamard=False, scales="@", sort_channels=True),
    "scales-pow2": dict(residual="none", for_quantization=True, vo_hadamard=False, scales="@", scales_pow2=True),
    "scales-vo": dict(residual="none", for_quantization=True, vo_hadamard=True, scales="@"),
    "hadamard-scales": dict(residual="hadamard", for_quantization=True, scales="@"),
}
CALIBRATION = ["britannica-calib", 2048]  # --calibration-tokens changes the count
QUANTIZERS = ("Q4_0", "hqq3g64-rtn", "Q4_1", "hqq4g64-rtn", "hqq3g128-rtn", "MXFP4", "bnb-nf4")


_STATS: dict = {}


def calibration_stats(model, config: dict):
    """The calibration engine's per-layer second moments, once per process."""
    if "stats" not in _STATS:
        from transformers import AutoTokenizer

        from hf_symmetry.calibration.data import calibration_ids
        from hf_symmetry.conversion.quantization.scales import layer_stats
        from hf_symmetry.conversion.stream import DictSource

        tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
        ids = calibration_ids(tok, *CALIBRATION)
        t = time.perf_counter()
        _STATS["stats"] = layer_stats(DictSource(model.state_dict()), config, ids)
        print(f"calibration statistics: {ids.numel()} tokens, {time.perf_counter() - t:.1f} s", flush=True)
    return _STATS["stats"]


def build(variant: str, model, config: dict, quantizer: str | None = None):
    from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
    from hf_symmetry.evaluation.compare import model_from_state_dict

    spec = VARIANTS[variant]
    if spec is None:
        return copy.deepcopy(model), 0.0
    calibration = None
    if spec.get("scales") == "@":
        calibration = calibration_stats(model, config)
        spec = {**spec, "scales": quantizer}
    t = time.perf_counter()
    if spec.get("hold_out") == "massive":
        from transformers import AutoTokenizer

        from hf_symmetry.assets import text_path
        from hf_symmetry.conversion.quantization.rotation import massive_channels
        from hf_symmetry.text import read_text, tokenize_text

        tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
        calib = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=128)
        held = massive_channels(model, calib)
        print(f"held out of the rotation: channels {held}", flush=True)
        spec = {**spec, "hold_out": held}
    sd, cfg = rotate_state_dict(model.state_dict(), config, RotateOptions(seed=0, **spec), calibration=calibration)
    seconds = time.perf_counter() - t
    return model_from_state_dict(cfg, sd), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model folder or alias (default: smollm2)")
    ap.add_argument("--label", default=None, help="results key (default: the model argument)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS))
    ap.add_argument("--text", default="hamlet")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--calibration-tokens",
        type=int,
        default=2048,
        help="calibration tokens of the scales variants (default 2048; other counts are stored as "
        "'<variant> (calibration N)')",
    )
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))  # 2 unless told (the CPU is shared)

    from transformers import AutoTokenizer

    from hf_symmetry.assets import resolve_model, resolve_text
    from hf_symmetry.evaluation.perplexity import perplexity
    from hf_symmetry.text import read_text, tokenize_text
    from hf_symmetry.evaluation.compare import load_model, model_output
    from hf_symmetry.evaluation.weight_quant import bits_per_weight, quantize_model_

    src = resolve_model(args.model)
    model = load_model(src)
    tok = AutoTokenizer.from_pretrained(src)
    ids = tokenize_text(tok, read_text(resolve_text(args.text)), max_tokens=args.tokens)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.update(
        title="Rotations and exact scalings for low-bit weight quantization (issue 29)",
        machine=f"{platform.machine()}, {platform.processor() or 'cpu'}, "
        f"torch threads {torch.get_num_threads()} (shared VM)",
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        command="OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_quant_rotation.py "
        "[--model DIR --label L] --variants ... --quantizers ...",
    )
    label = args.label or args.model
    entry = results.setdefault(label, {"text": args.text, "tokens": int(ids.numel()), "variants": {}})
    entry["machine"] = f"{platform.machine()}, {torch.get_num_threads()} threads"
    ref_logits = model_output(model, ids[:512])
    CALIBRATION[1] = args.calibration_tokens
    for variant in args.variants:
        key = variant if args.calibration_tokens == 2048 else f"{variant} (calibration {args.calibration_tokens})"
        per_quantizer = VARIANTS[variant] is not None and VARIANTS[variant].get("scales") == "@"
        row = entry["variants"].setdefault(key, {})
        m = None
        for q in args.quantizers:
            if m is None or per_quantizer:
                m, seconds = build(variant, model, model.config.to_dict(), q)
                dlogit = (model_output(m, ids[:512]) - ref_logits).abs().max().item()
                if "float" not in row or not per_quantizer:
                    row["float"] = perplexity(m, ids, progress=False).perplexity
                    row["convert_seconds"] = round(seconds, 1)
                    row["max_abs_dlogit_float32"] = dlogit
                print(
                    f"{variant} ({q if per_quantizer else 'any quantizer'}): float ppl {row['float']:.3f}, "
                    f"max |Δlogit| {dlogit:.2e}, conversion {seconds:.1f} s",
                    flush=True,
                )
            mq = copy.deepcopy(m)
            stats = quantize_model_(mq, q)
            ppl = perplexity(mq, ids, progress=False).perplexity
            row[q] = {
                "perplexity": ppl,
                "relative_weight_error": stats["relative_error"],
                "bits_per_weight": bits_per_weight(q),
            }
            if per_quantizer:
                row[q].update(
                    scales_searched_against=q, convert_seconds=round(seconds, 1), max_abs_dlogit_float32=dlogit
                )
            print(f"  {q}: ppl {ppl:.3f} (relative weight error {stats['relative_error']:.4f})", flush=True)
            del mq
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2) + "\n")
        out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
