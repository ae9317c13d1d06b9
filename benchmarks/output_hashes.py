"""Byte-identity check of the conversions other than ``compress`` (which ``compress_hashes.py`` covers):
rotate (RMSNorm and LayerNorm decoders, the quantization preset), match, merge (plain and Fisher), to-tpa,
farr and export-gguf, each run through the CLI on tiny random models, with the sha256 of every output
``*.safetensors`` (header keys sorted), ``config.json`` and GGUF file.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/output_hashes.py --out before.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/output_hashes.py --check before.json

To compare two commits, run this script with ``PYTHONPATH`` set to a checkout of the older one (it uses only
``hf_symmetry.cli.main`` and ``hf_symmetry.testing.tiny_model``). The bytes depend on BLAS/LAPACK, so hashes
are compared on one machine, not stored for all.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from compress_hashes import _digest, _folder, _hashes, hash_cli

NV = ["--no-verify", "--quiet"]
# (case name, output is a file, argv with {src-<family>}, {src-llama-b}, {calib}, {out} placeholders)
CASES = [
    ("rotate-llama", False, ["rotate", "{src-llama}", "{out}", "--seed", "3", *NV]),
    ("rotate-qwen2", False, ["rotate", "{src-qwen2}", "{out}", "--seed", "3", *NV]),
    ("rotate-opt", False, ["rotate", "{src-opt}", "{out}", "--seed", "3", *NV]),
    ("rotate-gpt2", False, ["rotate", "{src-gpt2}", "{out}", "--seed", "3", *NV]),
    (
        "rotate-llama-quant",
        False,
        ["rotate", "{src-llama}", "{out}", "--for-quantization", "--residual", "hadamard", "--seed", "3", *NV],
    ),
    ("match-llama", False, ["match", "{src-llama}", "{src-llama-b}", "{out}", "--residual", *NV]),
    (
        "merge-average-matched",
        False,
        ["merge", "{src-llama}", "{src-llama-b}", "{out}", "--method", "average", "--match", *NV],
    ),
    (
        "merge-fisher",
        False,
        [
            "merge",
            "{src-llama}",
            "{src-llama-b}",
            "{out}",
            "--method",
            "fisher",
            "--calib-text",
            "{calib}",
            "--calib-tokens",
            "256",
            *NV,
        ],
    ),
    (
        "to-tpa-llama",
        False,
        [
            "to-tpa",
            "{src-llama}",
            "{out}",
            "--k-rank",
            "2",
            "--v-rank",
            "2",
            "--calib",
            "{calib}",
            "--calib-tokens",
            "256",
            *NV,
        ],
    ),
    ("farr-llama", False, ["farr", "{src-llama}", "{out}", "--tau", "0.9", "--vo", *NV]),
    (
        "farr-llama-calibrated",
        False,
        [
            "farr",
            "{src-llama}",
            "{out}",
            "--params-fraction",
            "0.8",
            "--vo",
            "--calibrate",
            "{calib}",
            "--calib-tokens",
            "256",
            *NV,
        ],
    ),
    ("export-gguf-llama", True, ["export-gguf", "{src-llama}", "{out}", "--type", "q8_0", "--quiet"]),
]


def _b_folder(root: Path) -> Path:
    """A second tiny Llama (another seed), with the first one's tokenizer, for match and merge."""
    from hf_symmetry.testing import tiny_model

    folder = root / "src-llama-b"
    if not folder.exists():
        a = _folder(root, "llama", {})
        tiny_model("llama", dtype=torch.float32, seed=1).save_pretrained(folder)
        for f in a.iterdir():
            if "token" in f.name:
                shutil.copy(f, folder / f.name)
    return folder


def run(workdir: str, only: list[str] | None = None) -> dict:
    from hf_symmetry.cli import main

    torch.set_num_threads(1)
    root = Path(workdir)  # a fixed path: metadata may name the source folder
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    calib = root / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(600)))
    places = {"{calib}": str(calib), "{src-llama-b}": str(_b_folder(root))}
    for family in ("llama", "qwen2", "opt", "gpt2"):
        places["{src-" + family + "}"] = str(_folder(root, family, {}))
    results = {}
    for name, is_file, argv in CASES:
        if only and name not in only:
            continue
        out = root / (name + (".gguf" if is_file else ""))
        args = [str(out) if a == "{out}" else places.get(a, a) for a in argv]
        t0 = time.perf_counter()
        rc = main(args)
        files = {} if rc != 0 else ({out.name: _digest(out)} if is_file else _hashes(out))
        results[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 2), "files": files}
        print(f"{name}: rc {rc}, {results[name]['seconds']} s, {len(files)} files", file=sys.stderr)
    return results


def main(argv=None) -> int:
    return hash_cli(run, __doc__.split("\n\n")[0], "/tmp/hf_symmetry_output_hashes", argv)


if __name__ == "__main__":
    sys.exit(main())
