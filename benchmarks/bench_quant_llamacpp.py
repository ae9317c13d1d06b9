"""Quantization through llama.cpp's own tools, with and without an importance matrix (issue 39).

Every checkpoint is exported with ``hf-symmetry export-gguf --type f32`` (:func:`export_gguf`), then llama.cpp does
the rest, as a GGUF user would:

1. ``llama-imatrix -m F32.gguf -f IMATRIX_TEXT -c 512 --chunks N`` on the checkpoint itself (the importance
   matrix every imatrix row below uses, unless the row says ``own``: the file ``rotate --write-imatrix`` wrote
   for that checkpoint, passed as ``--own-imatrix NAME=FILE``);
2. ``llama-quantize [--imatrix FILE] F32.gguf OUT.gguf TYPE`` for each ``--types`` entry (llama.cpp's default
   mixture for that type);
3. ``llama-perplexity -m FILE -f TEXT -c 512 --chunks N -t THREADS`` on each ``--texts`` entry (held-out texts:
   neither the calibration nor the importance matrix saw them), for the F32 file and every quantized one.

Δ = quantized perplexity − F32 perplexity on the same text; ratio = a checkpoint's Δ over the ``--reference``
checkpoint's Δ (same type, same importance-matrix mode, same text), and the ratio of the Δ summed over the texts.

llama.cpp is built **outside** the project (nothing of llama.cpp is in this repository; the tests never need it)
and passed as ``--llama-bin DIR``. One way, from the llama-cpp-python source package, which vendors llama.cpp
(0.3.36 vendors ``0c1e57098``)::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \\
        -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j 2 --target llama-quantize llama-imatrix llama-perplexity

(``GGML_NATIVE=OFF``: no fused multiply-add in ggml's quantizers, which the emulation in
hf_symmetry/evaluation/ggml_quants.py matches bit for bit.) Pass ``--llama-cpp-commit`` to record the commit
(the source package has no git metadata).

**Weight repacking crashes on some CPUs.** On a CPU with AMX, llama.cpp repacks quantized weights for its AMX
kernels and every quantized file then crashes ``llama-perplexity`` (rc 139 or 132; the package's own Q4_1 asset,
written by llama.cpp's converter, crashes too). A run that dies of a signal is retried with ``-nr`` (no
repacking), and every perplexity records whether it needed it (``no_repack``).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_quant_llamacpp.py --llama-bin /path/to/build/bin \\
        --model smollm2 --variant original=smollm2 --variant preset=/tmp/lq/preset \\
        --variant imatrix-preset=/tmp/lq/imatrix-preset --own-imatrix imatrix-preset=/tmp/lq/imatrix-preset.gguf

It merges into benchmarks/results/quant_llamacpp.json (one entry per ``--model`` group).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quant_llamacpp.json"
TYPES = ("Q4_K_M", "Q3_K_M", "IQ4_NL", "Q4_0")
TOOLS = ("quantize", "imatrix", "perplexity")
CRASH = (139, 132, -11, -4, -7)  # SIGSEGV / SIGILL / SIGBUS, as a shell or as Python reports them


def llama_bin(path: str | None) -> dict[str, Path]:
    """The three executables from ``--llama-bin``, or a one-line SystemExit saying how to get them."""
    if not path:
        raise SystemExit("error: --llama-bin DIR is required (llama.cpp's build/bin, built outside the project)")
    found = {t: Path(path) / f"llama-{t}" for t in TOOLS}
    missing = [str(p) for p in found.values() if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        raise SystemExit(f"error: not executable: {', '.join(missing)} (build those llama.cpp targets)")
    return found


def run(cmd: list, log: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    log.write_text(" ".join(map(str, cmd)) + "\n\n" + done.stdout + done.stderr)
    return done


class Llama:
    """llama.cpp's tools with this run's threads, context and chunk count; ``-nr`` once a run needed it."""

    def __init__(self, bins: dict[str, Path], work: Path, threads: int, ctx: int, chunks: int, imatrix_chunks: int):
        self.bins, self.work, self.threads, self.ctx = bins, work, threads, ctx
        self.chunks, self.imatrix_chunks = chunks, imatrix_chunks
        self.no_repack = False
        self.crashes: list[dict] = []
        self.build = ""

    def _common(self) -> list:
        return ["-t", self.threads, "-c", self.ctx] + (["-nr"] if self.no_repack else [])

    def _with_repack_retry(self, cmd: list, log: Path) -> tuple[subprocess.CompletedProcess, bool]:
        done = run(cmd + self._common(), log)
        if done.returncode in CRASH and not self.no_repack:
            self.crashes.append({"command": Path(str(cmd[0])).name, "rc": done.returncode, "file": str(cmd[2])})
            self.no_repack = True
            done = run(cmd + self._common(), log)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({done.returncode}); log: {log}")
        if not self.build:
            self.build = next((x.strip() for x in (done.stdout + done.stderr).splitlines() if "build:" in x), "")
        return done, self.no_repack

    def perplexity(self, model: Path, text: Path) -> dict:
        """llama-perplexity's estimate over the first ``chunks`` chunks: the running value it prints after chunk
        ``chunks`` (``[N]x``, what ``Final estimate`` says for a run of ``N`` chunks). Its logger is asynchronous and
        never flushed at exit (llama.cpp issue 22142): on a loaded machine a run's last lines are lost, so the run
        goes one pass of 4 chunks further and that value is read while the next pass computes."""
        t = time.perf_counter()
        log = self.work / f"{model.stem}.{text.stem}.ppl.log"
        cmd = [self.bins["perplexity"], "-m", model, "-f", text, "--chunks", self.chunks + 4]
        for attempt in range(3):
            done, nr = self._with_repack_retry(cmd, log)
            last = re.search(rf"\[{self.chunks}\]([0-9.]+),", done.stdout + done.stderr)
            if last:
                break
        else:
            raise RuntimeError(f"no perplexity after chunk {self.chunks} in {log} (3 runs)")
        return {"ppl": float(last.group(1)), "no_repack": nr, "runs": attempt + 1, "s": round(time.perf_counter() - t)}

    def imatrix(self, model: Path, text: Path, out: Path) -> dict:
        t = time.perf_counter()
        cmd = [self.bins["imatrix"], "-m", model, "-f", text, "-o", out, "--chunks", self.imatrix_chunks, "--no-ppl"]
        self._with_repack_retry(cmd, self.work / f"{out.stem}.log")
        return {"file": out.name, "seconds": round(time.perf_counter() - t)}

    def quantize(self, src: Path, dst: Path, qtype: str, imatrix: Path | None) -> dict:
        t = time.perf_counter()
        cmd = [self.bins["quantize"], *(["--imatrix", imatrix] if imatrix else []), src, dst, qtype, self.threads]
        done = run(cmd, self.work / f"{dst.stem}.quantize.log")
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize {qtype} failed ({done.returncode}): {done.stderr[-800:]}")
        version = [x.strip() for x in (done.stdout + done.stderr).splitlines() if x.startswith("version:")]
        self.build = self.build or (version[0] if version else "")
        return {"seconds": round(time.perf_counter() - t), "bytes": dst.stat().st_size}


def measure_variant(
    llama: Llama,
    name: str,
    folder: Path,
    args,
    texts: dict,
    imatrix_text: Path,
    own: Path | None,
    previous=None,
    checkpoint=None,
):
    """One checkpoint: F32 perplexities, its llama-imatrix file, and every type in every ``--modes`` entry (merged
    into ``previous``, the checkpoint's results so far)."""
    from hf_symmetry.conversion.gguf_export import export_gguf

    work = llama.work
    f32 = work / f"{args.model}-{name}-f32.gguf"
    export_gguf(folder, f32, type="f32", overwrite=True, progress=False)
    row = previous or {}
    row["folder"] = folder.name
    if set(texts) - set(row.get("f32", {})):
        row["f32"] = {t: llama.perplexity(f32, p) for t, p in texts.items()}
    print(f"{name}: F32 { ({t: v['ppl'] for t, v in row['f32'].items()}) }", flush=True)
    imat = work / f"{args.model}-{name}.imatrix.gguf"
    modes = {"none": None, "imatrix": imat, **({"own": own} if own else {})}
    modes = {m: f for m, f in modes.items() if m in args.modes}
    if "imatrix" in modes:
        row["imatrix"] = llama.imatrix(f32, imatrix_text, imat)
    row.setdefault("types", {})
    for qtype in args.types:
        for mode, file in modes.items():
            q = work / f"{args.model}-{name}-{qtype}-{mode}.gguf"
            info = llama.quantize(f32, q, qtype, file)
            info["ppl"] = {t: llama.perplexity(q, p) for t, p in texts.items()}
            row["types"].setdefault(qtype, {})[mode] = info
            print(f"  {qtype} {mode}: { ({t: v['ppl'] for t, v in info['ppl'].items()}) }", flush=True)
            q.unlink()
            if checkpoint:
                checkpoint(row)
    f32.unlink()
    return row


def deltas(row: dict, qtype: str, mode: str) -> dict[str, float] | None:
    cell = row.get("types", {}).get(qtype, {}).get(mode)
    if not cell:
        return None
    return {t: cell["ppl"][t]["ppl"] - row["f32"][t]["ppl"] for t in cell["ppl"]}


def tables_for(group: str, entry: dict) -> list[dict]:
    """Per model group: Δ and ratio per type and imatrix mode (rows: checkpoints)."""
    variants, ref = entry["variants"], entry["reference"]
    texts = entry["texts"]
    out = []
    for mode, label in (
        ("none", "without an importance matrix"),
        ("imatrix", "with llama-imatrix's matrix"),
        (
            "own",
            "with the matrix rotate --write-imatrix wrote (the reference row: llama-imatrix's)",
        ),
    ):
        if not any(mode in v.get("types", {}).get(t, {}) for v in variants.values() for t in TYPES):
            continue
        columns = ["checkpoint", "F32 " + " / ".join(texts)]
        rows = []
        types = [t for t in TYPES if any(t in v.get("types", {}) for v in variants.values())]
        for t in types:
            columns += [f"{t} Δ " + " / ".join(texts), f"{t} ratio"]
        for name, row in variants.items():
            cells = [name, " / ".join(f"{row['f32'][x]['ppl']:.3f}" for x in texts)]
            for t in types:
                d = deltas(row, t, mode)
                r = deltas(variants[ref], t, "imatrix" if mode == "own" else mode)
                if d is None or r is None:
                    cells += ["", ""]
                    continue
                ratio = sum(d.values()) / sum(r.values()) if sum(r.values()) else float("nan")
                cells += [" / ".join(f"{d[x]:+.3f}" for x in texts), round(ratio, 3)]
            rows.append(cells)
        out.append(
            {
                "name": f"{group}_{mode}",
                "caption": f"{entry['title']}, {label}: llama-perplexity on {entry['chunks']} chunks of "
                f"{entry['ctx']} tokens of each text; Δ = quantized − F32; ratio = Δ summed over the texts, over "
                f"the {ref} row's.",
                "columns": columns,
                "rows": rows,
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", metavar="DIR", help="folder with llama-quantize, llama-imatrix, llama-perplexity")
    ap.add_argument("--llama-cpp-commit", default="", help="the llama.cpp commit it was built from (recorded)")
    ap.add_argument("--model", default="smollm2", help="name of this model group in the results (default: smollm2)")
    ap.add_argument("--title", default="", help="the group's caption (default: the model name)")
    ap.add_argument("--variant", action="append", metavar="NAME=FOLDER", help="an HF folder; repeatable")
    ap.add_argument("--own-imatrix", action="append", default=[], metavar="NAME=FILE", help="a variant's own imatrix")
    ap.add_argument("--reference", default=None, help="the variant ratios divide by (default: the first)")
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument(
        "--modes", nargs="+", default=["none", "imatrix", "own"], help="none, imatrix, own (default: all three)"
    )
    ap.add_argument("--texts", nargs="+", default=["hamlet", "britannica-eval"], help="held-out texts")
    ap.add_argument("--imatrix-text", default="britannica-calib", help="llama-imatrix's text (default: %(default)s)")
    ap.add_argument("--chunks", type=int, default=16, help="llama-perplexity chunks per text (default: 16)")
    ap.add_argument("--imatrix-chunks", type=int, default=4, help="llama-imatrix chunks (default: 4 = 2048 tokens)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/lq/work")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    bins = llama_bin(args.llama_bin)
    variants = [v.split("=", 1) for v in (args.variant or ["original=smollm2"])]
    own = dict(v.split("=", 1) for v in args.own_imatrix)
    if any(len(v) != 2 or not all(v) for v in variants):
        raise SystemExit("error: --variant takes NAME=FOLDER")

    from hf_symmetry.assets import resolve_model, resolve_text

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    llama = Llama(bins, work, args.threads, args.ctx, args.chunks, args.imatrix_chunks)
    texts = {t: resolve_text(t) for t in args.texts}
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    entry = results.setdefault("models", {}).setdefault(args.model, {"variants": {}})
    entry.update(
        title=args.title or args.model,
        reference=args.reference or entry.get("reference") or variants[0][0],
        texts=list(texts),
        imatrix_text=args.imatrix_text,
        imatrix_tokens=args.imatrix_chunks * args.ctx,
        chunks=args.chunks,
        ctx=args.ctx,
        threads=args.threads,
        date=time.strftime("%Y-%m-%d", time.gmtime()),
    )
    for name, folder in variants:
        own_file = Path(own[name]) if name in own else None
        entry["variants"][name] = measure_variant(
            llama,
            name,
            resolve_model(folder),
            args,
            texts,
            resolve_text(args.imatrix_text),
            own_file,
            entry["variants"].get(name),
            checkpoint=lambda row, name=name: (
                entry["variants"].__setitem__(name, row),
                write(out, results, llama, args),
            ),
        )
        write(out, results, llama, args)
    write(out, results, llama, args)


def write(out: Path, results: dict, llama: Llama, args) -> None:
    cpp = results.setdefault("llama_cpp", {})
    if args.llama_cpp_commit:
        cpp["commit"] = args.llama_cpp_commit
    cpp["build"] = llama.build or cpp.get("build", "")
    cpp["no_repack_needed"] = bool(llama.no_repack or cpp.get("no_repack_needed"))
    cpp["crashes_before_no_repack"] = llama.crashes or cpp.get("crashes_before_no_repack", [])
    results.update(
        title="Quantization through llama.cpp's own llama-quantize, llama-imatrix and llama-perplexity (issue 39)",
        machine=f"{platform.machine()}, 2 shared CPU cores, llama.cpp threads {args.threads}",
        command="OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_quant_llamacpp.py --llama-bin DIR --model NAME "
        "--variant NAME=FOLDER ... [--own-imatrix NAME=FILE]",
    )
    results["tables"] = [t for group, e in results["models"].items() for t in tables_for(group, e)]
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
