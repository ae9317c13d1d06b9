"""Record what llama.cpp's own ``llama-quantize`` writes for one small tensor in every type that
hf_symmetry/evaluation/ggml_quants.py emulates, with and without an importance matrix, into
tests/data/ggml_llamacpp_quants.safetensors (tests/evaluation/test_ggml_quants.py compares the emulation with it
bit for bit).

The tensor (4 rows of 512, columns of very different scales, one all-zero block) and the importance vector are
made here from a fixed numpy seed and stored beside the quantized bytes. They go into a minimal llama-architecture
GGUF (one tensor per type, ``--tensor-type`` forcing each type) and an imatrix file written by
:func:`hf_symmetry.conversion.quantization.imatrix.write_imatrix` (counts 1, so llama-quantize reads the vector
as it is); ``llama-quantize --imatrix`` (and once without it) quantizes them; the file's raw blocks are kept.

    .venv/bin/python benchmarks/record_ggml_quants.py --llama-bin /path/to/build/bin [--llama-cpp-commit SHA]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "data" / "ggml_llamacpp_quants.safetensors"
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def fixture_inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(39)
    scale = np.exp(rng.normal(0, 1.0, 512)).astype(np.float32)
    X = (rng.standard_normal((4, 512)) * scale * 0.02).astype(np.float32)
    X[:, 17] *= 40  # an outlier column
    X[1, 64:96] = 0  # an all-zero block
    X[2, 300] = -X[2, 300:332].__abs__().max() * 1.5  # a negative block maximum
    imat = (rng.gamma(0.5, 1.0, 512) * scale**2).astype(np.float32)
    imat[17] *= 100
    return X, imat


def main() -> None:
    import gguf
    from safetensors.numpy import save_file

    from hf_symmetry.conversion.quantization.imatrix import write_imatrix
    from hf_symmetry.evaluation.ggml_quants import TYPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--llama-cpp-commit", default="0c1e57098")
    args = ap.parse_args()
    X, imat = fixture_inputs()
    slots = [f"blk.{i // len(ROLES)}.{ROLES[i % len(ROLES)]}" for i in range(len(TYPES))]
    tensors = {"x": X, "imatrix": imat}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        w = gguf.GGUFWriter(tmp / "f32.gguf", "llama")
        w.add_block_count(2)
        w.add_context_length(64)
        w.add_embedding_length(512)
        w.add_feed_forward_length(512)
        w.add_head_count(4)
        w.add_head_count_kv(4)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(0)
        for slot in slots:
            w.add_tensor(f"{slot}.weight", X)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
        w.close()
        write_imatrix(tmp / "im.gguf", {f"{s}.weight": (imat, 1) for s in slots}, ["fixture"], 1, 512)
        for mode in ("imatrix", "none"):
            types = list(zip(slots, TYPES))
            cmd = [f"{args.llama_bin}/llama-quantize"]
            cmd += ["--imatrix", str(tmp / "im.gguf")] if mode == "imatrix" else []
            for slot, t in types:
                cmd += ["--tensor-type", f"{slot.replace('.', chr(92) + '.')}={t.lower()}"]
            cmd += [str(tmp / "f32.gguf"), str(tmp / f"{mode}.gguf"), "Q8_0", "1"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
            by_name = {t.name: t for t in gguf.GGUFReader(str(tmp / f"{mode}.gguf")).tensors}
            for slot, t in types:
                tensor = by_name[f"{slot}.weight"]
                if tensor.tensor_type.name != t:
                    raise SystemExit(f"{slot}: llama-quantize wrote {tensor.tensor_type.name}, not {t}")
                tensors[f"{mode}.{t}"] = np.array(tensor.data, dtype=np.uint8).reshape(X.shape[0], -1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"llama_cpp": args.llama_cpp_commit, "tool": "llama-quantize"})
    print(f"wrote {OUT} ({len(tensors) - 2} quantized tensors)")


if __name__ == "__main__":
    main()
