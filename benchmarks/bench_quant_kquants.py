"""GGUF k-quants through llama.cpp's own quantizer (issue 29): perplexity of checkpoints exported with
``export-gguf``, quantized by ``llama-quantize`` (Q4_0, Q4_K_M, Q3_K_M) and read back through
transformers, which dequantizes the file into the HF model.

The ``gguf`` package quantizes only the 32-blocks (Q4_0, Q5_0, Q8_0, ...); the k-quants (Q3_K, Q4_K,
Q6_K, blocks of 256) and llama.cpp's per-tensor mixtures (``Q4_K_M`` keeps ``attn_v`` and ``ffn_down`` of
some layers at Q6_K, ...) exist only in llama.cpp. So ``llama-quantize`` is built **outside** the project
(nothing of llama.cpp is in this repository, and the test suite never needs it) and passed in::

    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build --target llama-quantize -j 2

Per variant (an HF folder, ``--variant NAME=FOLDER``; the first is the reference unless ``--reference``
names another; ``--quantize-args`` passes options to llama-quantize for the variants of that run):

1. ``export_gguf(folder, NAME-f32.gguf, type="f32")`` (hf_symmetry/conversion/gguf_export.py);
2. its float perplexity, from the folder and from the F32 file read back (``load_gguf``): the two must
   agree (the maximum |Δlogit| over 512 tokens is recorded);
3. ``llama-quantize NAME-f32.gguf NAME-TYPE.gguf TYPE 1`` for every ``--types`` entry (llama.cpp's default
   mixture: nothing forced), the file's tensor types counted with ``gguf.GGUFReader``, and its
   perplexity after ``load_gguf`` (transformers dequantizes every tensor, embeddings included).

The increase ratio of a variant is ``(ppl_TYPE - ppl_float)`` of the variant over the same of the
reference. Perplexity: the project's definition (``hf_symmetry.evaluation.perplexity``), 2048 tokens of
``hamlet`` tokenized as benchmarks/bench_quant_rotation.py does, with the first ``--variant`` folder's
tokenizer (a rotated folder carries the original's).

A k-quant needs rows that fill blocks of 256: a tensor whose row length is not a multiple of 256
(SmolLM2's hidden size is 576) falls back in llama.cpp to a 32-block type (Q4_K -> Q5_0, Q3_K -> Q4_0,
Q6_K -> Q8_0, ...), so the tensor-type census of each file is part of the result.

Run::

    .venv/bin/python benchmarks/bench_quant_kquants.py --llama-quantize /path/to/llama-quantize \\
        --variant original=smollm2 --variant scales-Q4_0=/tmp/kq/scales-q40 [--llama-cpp-commit SHA]

It writes benchmarks/results/quant_kquants.json, merging with the variants already there. The variant
folders come from ``hf-symmetry rotate default OUT ...``: the exact commands are in docs/quantization.md
("k-quants through llama.cpp").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quant_kquants.json"
TYPES = ("Q4_0", "Q4_K_M", "Q3_K_M")


def llama_quantize_path(path: str | None) -> Path:
    """The ``llama-quantize`` executable, or a one-line SystemExit saying how to get one."""
    if not path:
        raise SystemExit(
            "error: --llama-quantize PATH is required (llama.cpp's quantizer, built outside the project: "
            "cmake --build build --target llama-quantize)"
        )
    p = Path(path)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise SystemExit(f"error: --llama-quantize {path}: not an executable file (build llama.cpp's llama-quantize)")
    return p


def run_quantize(binary: Path, src: Path, dst: Path, qtype: str, threads: int, extra: list[str] = ()) -> dict:
    """``llama-quantize [extra] src dst qtype threads``; its seconds and the fallback lines it printed."""
    t = time.perf_counter()
    cmd = [str(binary), *extra, str(src), str(dst), qtype, str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed ({done.returncode}): {log[-1500:]}")
    build = next((line.strip() for line in log.splitlines() if line.startswith("version:")), "")
    fallbacks = sum("falling back to" in line for line in log.splitlines())
    return {"quantize_seconds": round(time.perf_counter() - t, 1), "fallbacks": fallbacks, "build": build}


def census(path: Path) -> dict:
    """Tensor types of a GGUF file (count of tensors per type), and the bits per weight of its matrices."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    counts: dict[str, int] = {}
    bits = elements = 0
    for t in reader.tensors:
        name = t.tensor_type.name
        counts[name] = counts.get(name, 0) + 1
        if len(t.shape) > 1 or int(t.n_elements) > 4096:  # matrices (norms stay F32)
            bits += int(t.n_bytes) * 8
            elements += int(t.n_elements)
    return {
        "tensor_types": dict(sorted(counts.items())),
        "matrix_bpw": round(bits / elements, 3),
        "bytes": path.stat().st_size,
    }


def by_role(path: Path) -> dict[str, dict[str, int]]:
    """Tensor types per role (``attn_v``, ``ffn_down``, ``token_embd`` ...: the name less ``blk.{i}.`` and
    ``.weight``), counted over the layers: where llama.cpp's mixture put which type."""
    from gguf import GGUFReader

    roles: dict[str, dict[str, int]] = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        role = ".".join(parts[2:-1] if parts[0] == "blk" else parts[:-1])
        roles.setdefault(role, {})
        roles[role][t.tensor_type.name] = roles[role].get(t.tensor_type.name, 0) + 1
    return dict(sorted(roles.items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-quantize", metavar="PATH", help="llama.cpp's llama-quantize executable")
    ap.add_argument("--llama-cpp-commit", default="", help="the llama.cpp commit it was built from (recorded)")
    ap.add_argument(
        "--variant",
        action="append",
        metavar="NAME=FOLDER",
        help="an HF folder (or alias) to measure; repeatable, the first is the reference (default: original=smollm2)",
    )
    ap.add_argument(
        "--quantize-args",
        default="",
        help="extra llama-quantize options for these variants, e.g. '--token-embedding-type q8_0' (default: none, "
        "llama.cpp's own mixture)",
    )
    ap.add_argument(
        "--reference",
        default=None,
        help="the variant whose increase the ratios divide by (default: the one the results file names, else the "
        "first --variant)",
    )
    ap.add_argument("--types", nargs="+", default=list(TYPES), help="llama-quantize types (default: %(default)s)")
    ap.add_argument("--work", default="/tmp/kq/gguf", help="folder for the GGUF files (default: %(default)s)")
    ap.add_argument("--text", default="hamlet")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="torch and llama-quantize threads (default: 1)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    binary = llama_quantize_path(args.llama_quantize)
    variants = [v.split("=", 1) for v in (args.variant or ["original=smollm2"])]
    if any(len(v) != 2 or not all(v) for v in variants):
        raise SystemExit("error: --variant takes NAME=FOLDER")
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from hf_symmetry.assets import resolve_model, resolve_text
    from hf_symmetry.conversion.gguf_export import export_gguf, load_gguf
    from hf_symmetry.evaluation.perplexity import perplexity
    from hf_symmetry.text import read_text, tokenize_text
    from hf_symmetry.evaluation.compare import load_model, model_output

    extra = shlex.split(args.quantize_args)
    tok = AutoTokenizer.from_pretrained(resolve_model(variants[0][1]))
    ids = tokenize_text(tok, read_text(resolve_text(args.text)), max_tokens=args.tokens)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.update(
        title="GGUF k-quants through llama.cpp's llama-quantize, read back through transformers (issue 29)",
        machine=f"{platform.machine()}, 2 shared CPU cores, torch threads {args.threads}, torch {torch.__version__}",
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        command="OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_quant_kquants.py --llama-quantize PATH "
        "--variant original=smollm2 --variant NAME=FOLDER ...",
        text=args.text,
        tokens=int(ids.numel()),
    )
    reference = results["reference"] = args.reference or results.get("reference") or variants[0][0]
    results.setdefault("llama_cpp", {})["quantize_binary_build"] = ""
    if args.llama_cpp_commit:
        results["llama_cpp"]["commit"] = args.llama_cpp_commit
    entry = results.setdefault("variants", {})
    for name, folder in variants:
        folder = resolve_model(folder)
        row = entry.setdefault(name, {})
        row["folder"] = folder.name
        row["quantize_args"] = " ".join(extra)
        f32 = work / f"{name}-f32.gguf"
        export_gguf(folder, f32, type="f32", overwrite=True, progress=False)
        ref = load_model(folder)
        back, how = load_gguf(f32, folder)
        dlogit = (model_output(ref, ids[:512]) - model_output(back, ids[:512])).abs().max().item()
        row["float"] = perplexity(ref, ids, progress=False).perplexity
        row["float_f32_gguf"] = perplexity(back, ids, progress=False).perplexity
        row["max_abs_dlogit_f32_gguf"] = dlogit
        row["read_by"] = how
        print(f"{name}: float ppl {row['float']:.4f}, F32 GGUF {row['float_f32_gguf']:.4f} (max |Δlogit| {dlogit:.1e})")
        del ref, back
        for qtype in args.types:
            path = work / f"{name}-{qtype}.gguf"
            info = run_quantize(binary, f32, path, qtype, args.threads, extra)
            results["llama_cpp"]["quantize_binary_build"] = info.pop("build")
            info.update(census(path))
            info["by_role"] = by_role(path)
            model, _ = load_gguf(path, folder)
            info["perplexity"] = perplexity(model, ids, progress=False).perplexity
            del model
            row[qtype] = info
            print(f"  {qtype}: ppl {info['perplexity']:.3f}, {info['tensor_types']}, {info['matrix_bpw']} bpw")
            out.write_text(json.dumps(with_tables(results, reference), indent=2) + "\n")
    out.write_text(json.dumps(with_tables(results, reference), indent=2) + "\n")


def with_tables(results: dict, reference: str) -> dict:
    """The results with their ``tables`` (perplexity, increase over float, increase ratio) recomputed."""
    variants = results.get("variants", {})
    types = [t for t in TYPES if any(t in row for row in variants.values())]
    base = variants.get(reference, {})
    rows = []
    for name, row in variants.items():
        cells = [
            name,
            row.get("folder", ""),
            row.get("quantize_args", ""),
            round(row["float"], 3),
            round(row["float_f32_gguf"], 3),
        ]
        for t in types:
            if t not in row:
                cells += ["", "", ""]
                continue
            inc = row[t]["perplexity"] - row["float"]
            ref_inc = base[t]["perplexity"] - base["float"] if t in base else None
            ratio = round(inc / ref_inc, 3) if ref_inc else ""
            row[t]["increase"] = inc
            row[t]["increase_ratio"] = ratio
            cells += [round(row[t]["perplexity"], 3), round(inc, 3), ratio]
        rows.append(cells)
    columns = ["variant", "folder", "llama-quantize options", "float (HF)", "float (F32 GGUF)"]
    for t in types:
        columns += [t, f"{t} Δ", f"{t} ratio"]
    census_rows = [
        [
            name,
            t,
            row[t]["matrix_bpw"],
            ", ".join(f"{k} {v}" for k, v in row[t]["tensor_types"].items()),
            row[t]["fallbacks"],
        ]
        for name, row in variants.items()
        for t in types
        if t in row
    ]
    results["tables"] = [
        {
            "name": "perplexity",
            "caption": f"Perplexity on {results.get('tokens')} tokens of {results.get('text')}; Δ = increase over "
            f"float; ratio = Δ / the {reference} Δ (llama-quantize's default mixtures, read back by transformers).",
            "columns": columns,
            "rows": rows,
        },
        {
            "name": "tensor_types",
            "caption": "Tensor types in each quantized file (llama-quantize's mixture after its fallbacks for rows "
            "that do not fill 256-blocks); bpw over the matrices.",
            "columns": ["variant", "type", "matrix bpw", "tensors by type", "fallbacks"],
            "rows": census_rows,
        },
    ]
    return results


if __name__ == "__main__":
    sys.exit(main())
