"""``export-gguf`` files in llama.cpp itself: tokenization by llama.cpp's ``llama-tokenize`` against the
Hugging Face tokenizer, and greedy text by ``llama-completion`` against transformers' ``generate`` on the
HF folder.

llama.cpp picks its pre-tokenizer (the regexes that split text before BPE) by the file's
``tokenizer.ggml.pre``. ``export-gguf`` names it as llama.cpp's converter does (check-text hash ->
name, hf_symmetry/gguf_pretokenizer.py); before, it always wrote ``default``. Both are
measured: per variant, one F32 file as ``export-gguf`` writes it and one with the name forced to
``default`` (the old behaviour, the negative control), everything else identical.

The binaries are llama.cpp's, built **outside** the project (nothing of llama.cpp is in this
repository, and the test suite never needs it) and passed in as a folder::

    cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-tokenize llama-completion -j 2

Per variant (``--variant NAME=FOLDER``, an HF folder or alias; default ``original=default``):

1. ``export_gguf(folder, NAME-f32.gguf, type="f32")`` and ``NAME-f32-default.gguf`` (``default`` forced);
2. tokenization: each ``--texts`` entry (the project's embedded texts) cut into ``--chunks`` consecutive
   pieces of about ``--chunk-chars`` characters (at line ends), plus llama.cpp's check text itself;
   ``llama-tokenize -f PIECE --ids --no-bos --no-escape`` against ``tokenizer(piece,
   add_special_tokens=False)`` of the folder's tokenizer: the count of identical id sequences, and the
   first difference of each file;
3. greedy text (where ``llama-completion`` is in ``--llama-bin``): for each ``--prompt``,
   ``llama-completion -p PROMPT -n N --temp 0 --top-k 1`` (one thread) against
   ``model.generate(max_new_tokens=N, do_sample=False)`` of the folder in float32, and the prompt's ids
   (``llama-tokenize`` with the file's own BOS rule against ``tokenizer(prompt)``).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gguf_llamacpp.py --llama-bin /path/to/llama.cpp/build/bin \\
        --variant original=default --variant rotated=/tmp/rotated [--llama-cpp-commit SHA]

(``/tmp/rotated`` from ``hf-symmetry rotate default /tmp/rotated --seed 0``). It writes
benchmarks/results/gguf_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
RESULTS = HERE / "results" / "gguf_llamacpp.json"
TEXTS = ("hamlet", "britannica", "lear", "tempest")
PROMPTS = (
    "The capital of France is",
    "In 1603, the first quarto of Hamlet was printed; by 1623 the First Folio had 36 plays.",
    "Q: What is 12 + 30?\nA:",
    "Hamlet's father's ghost doesn't rest: he's telling his son that",
    "It's a truth universally acknowledged that a man who's",
)
END = " [end of text]\n"  # what llama-completion prints after an end-of-generation token
EXIT = "\n\n"  # and what it prints when it is done (tools/completion/completion.cpp)


def llama_bin(path: str | None) -> dict[str, Path | None]:
    """``{"tokenize": PATH, "completion": PATH or None}`` from ``--llama-bin``, or a one-line SystemExit."""
    if not path:
        raise SystemExit(
            "error: --llama-bin DIR is required (llama.cpp's build/bin, built outside the project: "
            "cmake --build build --target llama-tokenize llama-completion)"
        )
    found = {}
    for key in ("tokenize", "completion"):
        p = Path(path) / f"llama-{key}"
        found[key] = p if p.is_file() and os.access(p, os.X_OK) else None
    if found["tokenize"] is None:
        raise SystemExit(f"error: --llama-bin {path}: no llama-tokenize executable there (build that target)")
    return found


def chunks(text: str, size: int, count: int) -> list[str]:
    """``count`` consecutive pieces of ``text`` of about ``size`` characters, each ending at a line end."""
    out, start = [], 0
    while len(out) < count and start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        piece = text[start:end]
        if piece.strip():
            out.append(piece)
        start = end
    return out


def llama_ids(binary: Path, gguf: Path, text: str, work: Path, bos: bool = False) -> list[int]:
    """Token ids of ``text`` by ``llama-tokenize`` (read verbatim from a file, no escapes)."""
    src = work / "piece.txt"
    src.write_bytes(text.encode("utf-8"))
    cmd = [str(binary), "-m", str(gguf), "-f", str(src), "--ids", "--no-escape", "--log-disable"]
    done = subprocess.run(cmd + ([] if bos else ["--no-bos"]), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed ({done.returncode}): {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_difference(tok, a: list[int], b: list[int]) -> dict:
    """Where two id sequences part, with the HF tokenizer's pieces around it."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {
        "position": i,
        "hf": tok.convert_ids_to_tokens(a[i : i + 6]),
        "llama_cpp": tok.convert_ids_to_tokens(b[i : i + 6]),
        "text": tok.decode(a[max(0, i - 3) : i + 6]),
    }


def compare_tokenization(binary: Path, gguf: Path, tok, pieces: list[tuple[str, str]], work: Path) -> dict:
    identical, first, hf_tokens, cpp_tokens, per_text = 0, None, 0, 0, {}
    for name, piece in pieces:
        want = tok(piece, add_special_tokens=False).input_ids
        got = llama_ids(binary, gguf, piece, work)
        same = want == got
        identical += same
        hf_tokens += len(want)
        cpp_tokens += len(got)
        row = per_text.setdefault(name, {"sequences": 0, "identical": 0})
        row["sequences"] += 1
        row["identical"] += same
        if not same and first is None:
            first = {"text": name, **first_difference(tok, want, got)}
    return {
        "sequences": len(pieces),
        "identical": identical,
        "tokens_hf": hf_tokens,
        "tokens_llama_cpp": cpp_tokens,
        "per_text": per_text,
        "first_difference": first,
    }


def llama_generate(binary: Path, gguf: Path, prompt: str, new_tokens: int) -> str:
    cmd = [
        str(binary),
        *("-m", str(gguf), "-p", prompt, "-n", str(new_tokens), "--temp", "0", "--top-k", "1"),
        *("-no-cnv", "--no-display-prompt", "--no-escape", "-t", "1", "-tb", "1", "--poll", "0"),
        *("-c", "512", "--no-warmup", "--simple-io", "-s", "0"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"llama-completion failed ({done.returncode}): {done.stderr[-800:]}")
    out = done.stdout.removesuffix(EXIT)
    return out.removesuffix(END)


def export_pair(folder: Path, name: str, work: Path) -> tuple[Path, Path, str]:
    """The F32 file as export-gguf writes it, and the same with ``tokenizer.ggml.pre = default``."""
    from hf_symmetry.conversion.gguf_export import export_gguf
    from hf_symmetry.gguf_pretokenizer import PreTokenizer

    new = work / f"{name}-f32.gguf"
    report = export_gguf(folder, new, type="f32", overwrite=True, progress=False)
    old = work / f"{name}-f32-default.gguf"
    forced = classmethod(lambda cls, folder: cls("default", "", False, "forced by the benchmark (the old behaviour)"))
    with mock.patch.object(PreTokenizer, "of_folder", forced):
        export_gguf(folder, old, type="f32", overwrite=True, progress=False)
    return new, old, report.pre_tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", metavar="DIR", help="llama.cpp's build/bin (llama-tokenize, llama-completion)")
    ap.add_argument("--llama-cpp-commit", default="", help="the llama.cpp commit it was built from (recorded)")
    ap.add_argument(
        "--variant",
        action="append",
        metavar="NAME=FOLDER",
        help="an HF folder (or alias) to export and measure; repeatable (default: original=default)",
    )
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), help="embedded texts (default: %(default)s)")
    ap.add_argument("--chunks", type=int, default=25, help="pieces per text (default: %(default)s)")
    ap.add_argument("--chunk-chars", type=int, default=2000, help="characters per piece (default: %(default)s)")
    ap.add_argument("--prompt", action="append", help="greedy-text prompt, repeatable (default: five built in)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--work", default="/tmp/gguf_llamacpp", help="folder for the GGUF files (default: %(default)s)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    bins = llama_bin(args.llama_bin)
    variants = [v.split("=", 1) for v in (args.variant or ["original=default"])]
    if any(len(v) != 2 or not all(v) for v in variants):
        raise SystemExit("error: --variant takes NAME=FOLDER")
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.assets import resolve_model, resolve_text
    from hf_symmetry.gguf_pretokenizer import CHECK_TEXT
    from hf_symmetry.text import read_text

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pieces = [(t, p) for t in args.texts for p in chunks(read_text(resolve_text(t)), args.chunk_chars, args.chunks)]
    pieces.append(("llama.cpp check text", CHECK_TEXT))
    prompts = args.prompt or list(PROMPTS)
    version = subprocess.run([str(bins["tokenize"]), "--version"], capture_output=True, text=True)
    results = {
        "title": "export-gguf files in llama.cpp: llama-tokenize and llama-completion against transformers",
        "machine": f"{platform.machine()}, 2 shared CPU cores, torch threads 1, llama.cpp threads 1, "
        f"torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gguf_llamacpp.py --llama-bin DIR "
        "--variant original=default --variant rotated=FOLDER",
        "llama_cpp": {
            "commit": args.llama_cpp_commit,
            "build": (version.stdout + version.stderr).strip().splitlines()[0],
            "generation": "llama-completion" if bins["completion"] else "not built (skipped)",
        },
        "texts": args.texts,
        "pieces": {"per_text": args.chunks, "chars": args.chunk_chars, "plus": "llama.cpp's check text"},
        "new_tokens": args.new_tokens,
        "variants": {},
    }
    for name, folder in variants:
        folder = resolve_model(folder)
        start = time.perf_counter()
        new, old, pre = export_pair(folder, name, work)
        tok = AutoTokenizer.from_pretrained(folder)
        row = results["variants"][name] = {"folder": folder.name, "pre_tokenizer": pre, "tokenization": {}}
        for label, gguf in ((pre, new), ("default (old)", old)):
            row["tokenization"][label] = t = compare_tokenization(bins["tokenize"], gguf, tok, pieces, work)
            print(f"{name} [{label}]: {t['identical']}/{t['sequences']} identical token sequences")
        if bins["completion"]:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            row["generation"] = []
            for prompt in prompts:
                enc = tok(prompt, return_tensors="pt")
                with torch.no_grad():
                    ids = model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False)
                hf_text = tok.decode(ids[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
                g = {"prompt": prompt, "transformers": hf_text, "prompt_ids_hf": enc.input_ids[0].tolist()}
                for label, gguf in ((pre, new), ("default (old)", old)):
                    text = llama_generate(bins["completion"], gguf, prompt, args.new_tokens)
                    g[label] = {
                        "text": text,
                        "same_text": text == hf_text,
                        "same_prompt_ids": llama_ids(bins["tokenize"], gguf, prompt, work, bos=True)
                        == g["prompt_ids_hf"],
                    }
                    print(f"  {label}: {'same' if text == hf_text else 'DIFFERENT'} text for {prompt[:40]!r}")
                row["generation"].append(g)
            del model
        row["seconds"] = round(time.perf_counter() - start, 1)
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
