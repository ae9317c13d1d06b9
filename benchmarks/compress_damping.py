"""Damping sweep of stage W (the ridge δ·mean(diag X̂ᵀX̂) of every weighted problem) on SmolLM2-135M at 25 %.

Run from the repository root: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compress_damping.py lowrank 0.001 seq``
(structure, damping, ``seq`` for --sequential or anything else for one pass); prints one JSON line (figures in
``benchmarks/results/compress_damping.jsonl``). GS/Kron start from bench_compress.py's cached stage F rotations.
"""

import json
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
from bench_compress import *  # noqa

structure, damping, seq = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "seq"
src_dir = smollm2_dir()
model = load_model(src_dir)
tok = load_tokenizer(src_dir)
calib_ids = tokenize_text(tok, read_text(text_path("britannica-calib")), max_tokens=16384)
eval_ids = tokenize_text(tok, read_text(text_path("britannica-eval")), max_tokens=4096)
source = C.DictSource({k: v.detach() for k, v in model.state_dict().items()})
config = model.config.to_dict()
adapter = C.check_family(config, source.keys())
stats = cached_stats(model, adapter, calib_ids, 512)
q_mode = "global" if structure == "lowrank" else "segment"
options = C.CompressOptions(structure=structure, stage="w", q_mode=q_mode, f_iters=0, sequential=seq, damping=damping)
plan, _ = C.plan_for(source, config, options)
layers, globals_, gamma = C.read_folded(source, adapter, source.keys(), plan.tied)
rot = None if structure == "lowrank" else load_rotations(f"{structure}_segment_f4_c16384_float32")
run = C.CompressRun(source, config, options, calib_ids, progress=False, plan=plan, stats=stats, rotations=rot)
t = time.perf_counter()
with limit_threads(1):
    res = C.solve.solve(run, layers, globals_)
state = C.Assembler(plan, layers, globals_, gamma, torch.float32).finish(res, progress=False)
m, counted = C.build_model(state, C.compressed_config(config, plan, options, model.config))
p = perplexity(m, eval_ids, window=512, stride=512, progress=False).perplexity
print(
    json.dumps(
        {
            "structure": structure,
            "damping": damping,
            "sequential": seq,
            "ppl": p,
            "params": counted,
            "seconds": time.perf_counter() - t,
        }
    ),
    flush=True,
)
