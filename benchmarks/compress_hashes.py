"""Byte-identity check of every ``compress`` path: runs the CLI on one tiny random model per family for
each structure (slice, kron, gs, lowrank, the dense preset, the stock slice path, the LayerNorm families)
and records the sha256 of every output ``*.safetensors`` (header keys sorted) and ``config.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compress_hashes.py --out before.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compress_hashes.py --check before.json

A refactoring that leaves behaviour unchanged gives the same hashes on the same machine and library
versions (the bytes depend on BLAS/LAPACK, so hashes are compared on one machine, not stored for all).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import shutil
import time
from pathlib import Path

import torch

# (case name, family, folder overrides, compress flags)
CASES = [
    ("llama-slice", "llama", {}, ["--structure", "slice"]),
    ("llama-slice-segment-seq", "llama", {}, ["--structure", "slice", "--q-mode", "segment", "--sequential"]),
    ("llama-slice-sensitivity", "llama", {}, ["--structure", "slice", "--allocation", "sensitivity"]),
    ("llama-slice-untie-stock", "llama", {}, ["--structure", "slice", "--untie", "--round-to", "8"]),
    ("mistral-slice-stock", "mistral", {}, ["--structure", "slice", "--round-to", "8"]),
    ("llama-kron-w", "llama", {}, ["--structure", "kron", "--stage", "w"]),
    ("llama-kron-global", "llama", {}, ["--structure", "kron", "--q-mode", "global", "--ratio", "0.28"]),
    ("llama-kron-seq", "llama", {}, ["--structure", "kron", "--sequential"]),
    ("llama-kron-sensitivity", "llama", {}, ["--structure", "kron", "--allocation", "sensitivity"]),
    ("llama-gs-w", "llama", {}, ["--structure", "gs", "--ratio", "0.29"]),
    ("llama-gs-f", "llama", {}, ["--structure", "gs", "--ratio", "0.29", "--stage", "f", "--compress-v"]),
    ("llama-lowrank-seq", "llama", {}, ["--structure", "lowrank", "--sequential"]),
    ("llama-lowrank-w", "llama", {}, ["--structure", "lowrank", "--no-match-original", "--sequential"]),
    ("llama-lowrank-none", "llama", {}, ["--structure", "lowrank", "--stage", "none"]),
    ("llama-preset-dense", "llama", {}, ["--preset", "procrustesgpt-llama"]),
    ("qwen2-kron-f", "qwen2", {}, ["--structure", "kron", "--stage", "f", "--keep-embeddings", "--ratio", "0.23"]),
    ("opt-slice", "opt", {}, ["--structure", "slice"]),
    ("opt-kron", "opt", {}, ["--structure", "kron", "--ratio", "0.3"]),
    ("opt-gs", "opt", {}, ["--structure", "gs", "--ratio", "0.29"]),
    ("opt-lowrank", "opt", {}, ["--structure", "lowrank"]),
    ("gpt2-kron-global", "gpt2", {}, ["--structure", "kron", "--q-mode", "global"]),
]
COMMON = ["--f-iters", "2", "--w-iters", "2", "--calib-seq-len", "64", "--no-verify", "--quiet"]


def _folder(root: Path, family: str, overrides: dict) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_symmetry.testing import tiny_model

    folder = root / ("src-" + family)
    if folder.exists():
        return folder
    tiny_model(family, dtype=torch.float32, **overrides).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0").save_pretrained(folder)
    return folder


def _digest(path: Path) -> str:
    """sha256 of the file; for a safetensors file, of its header with sorted keys and then its data bytes
    (safetensors writes the ``__metadata__`` entries in hash-map order, which changes between runs)."""
    raw = path.read_bytes()
    if path.suffix != ".safetensors":
        return hashlib.sha256(raw).hexdigest()
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8 : 8 + n]), sort_keys=True).encode()
    return hashlib.sha256(header + raw[8 + n :]).hexdigest()


def _hashes(out: Path) -> dict:
    return {f.name: _digest(f) for f in sorted(out.iterdir()) if f.suffix == ".safetensors" or f.name == "config.json"}


def run(workdir: str, only: list[str] | None = None) -> dict:
    from hf_symmetry.cli import main

    torch.set_num_threads(1)
    results = {}
    root = Path(workdir)  # a fixed path: the layer map's metadata names the source folder
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if True:
        calib = root / "calib.txt"
        calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
        for name, family, overrides, flags in CASES:
            if only and name not in only:
                continue
            src, out = _folder(root, family, overrides), root / name
            t0 = time.perf_counter()
            rc = main(["compress", str(src), str(out), "--calib", str(calib), *COMMON, *flags])
            results[name] = {
                "rc": rc,
                "seconds": round(time.perf_counter() - t0, 2),
                "files": _hashes(out) if rc == 0 else {},
            }
            print(f"{name}: rc {rc}, {results[name]['seconds']} s", file=sys.stderr)
    return results


def hash_cli(run_cases, description: str, default_workdir: str, argv=None) -> int:
    """The command line of a byte-identity check: run the cases, write (``--out``) and compare (``--check``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", help="write the hashes to this JSON file")
    p.add_argument("--check", help="compare with the hashes in this JSON file (exit 1 on any difference)")
    p.add_argument("--only", nargs="*", help="case names to run")
    p.add_argument(
        "--workdir",
        default=default_workdir,
        help="scratch folder (emptied first; keep it fixed between the runs compared)",
    )
    args = p.parse_args(argv)
    results = run_cases(args.workdir, args.only)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.check:
        want = json.loads(Path(args.check).read_text())
        bad = [n for n in results if results[n]["rc"] != want[n]["rc"] or results[n]["files"] != want[n]["files"]]
        for n in results:
            got, was = results[n]["files"], want[n]["files"]
            which = sorted(f for f in got.keys() | was.keys() if got.get(f) != was.get(f))
            said = f"DIFFERENT: {', '.join(which) or 'exit status'}" if n in bad else "same"
            print(f"{n}: {said} ({len(got)} files)")
        return 1 if bad else 0
    return 0


def main(argv=None) -> int:
    return hash_cli(run, __doc__.split("\n\n")[0], "/tmp/hf_symmetry_compress_hashes", argv)


if __name__ == "__main__":
    sys.exit(main())
