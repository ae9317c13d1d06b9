"""Does ``rotate --for-quantization --sort-channels`` lower the calibration criterion it is meant to lower?

For every decoder layer of SmolLM2-135M, the activation-aware scale search of
``hf_symmetry.conversion.quantization.scales`` is run on the residual readers (q, k, v against the attention
norm's output; gate, up against the FFN norm's output) with the channels in their original order and in
``residual_order``'s order, against each quantizer given. The sum over layers of the searched minimum of
``tr(ΔW H ΔWᵀ)`` is reported for both orders (the readers' share of the criterion; V→O and up→down do not
depend on the residual order). Statistics: the calibration engine's second moments on 2048 tokens of
britannica-calib, as ``rotate`` takes them.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_sort_criterion.py [--quantizers Q4_0 hqq4g64-rtn ...]
(writes benchmarks/results/quant_sort_criterion.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "quant_sort_criterion.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantizers", nargs="+", default=["Q4_0", "bnb-nf4", "hqq4g64-rtn", "hqq3g64-rtn"])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from hf_symmetry.assets import resolve_model
    from hf_symmetry.calibration.data import calibration_ids
    from hf_symmetry.conversion.quantization import scales as S
    from hf_symmetry.conversion.stream import DictSource
    from hf_symmetry.evaluation.compare import load_model
    from hf_symmetry.evaluation.weight_quant import quantizer

    src = resolve_model("smollm2")
    model = load_model(src)
    ids = calibration_ids(AutoTokenizer.from_pretrained(src), "britannica-calib", 2048)
    stats = S.layer_stats(DictSource(model.state_dict()), model.config.to_dict(), ids)
    perm = S.residual_order(stats)
    rows = {}
    for name in args.quantizers:
        q = quantizer(name)
        t = time.perf_counter()
        total = {"original order": 0.0, "sorted": 0.0}
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            readers = {
                "attn_in": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                "ffn_in": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            }
            for site, W in readers.items():
                W, H = W.detach().double(), stats[i][site]
                for order, p in (("original order", None), ("sorted", perm)):
                    Wp, Hp = (W, H) if p is None else (W[:, p], H[p][:, p])
                    _, info = S.search_scales(Wp, Hp, lambda A: q.roundtrip(A).to(A.dtype))
                    total[order] += info["error"]
        rows[name] = {**total, "sorted / original": total["sorted"] / total["original order"]}
        print(name, rows[name], f"({time.perf_counter() - t:.0f} s)", flush=True)
    out = {
        "title": "Channel sorting and the calibration criterion of the scale search (issue 29)",
        "machine": f"{platform.machine()}, torch threads {torch.get_num_threads()} (shared VM)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_sort_criterion.py",
        "model": "SmolLM2-135M-Instruct",
        "calibration": "britannica-calib, 2048 tokens",
        "criterion_summed_over_residual_readers": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
