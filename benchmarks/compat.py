"""Compatibility check across transformers versions (issue 27, Build 4).

Published models carry hf_symmetry's flat remote-code files and run under whatever transformers the
downloader has; the calibration engine builds each family's own transformers decoder layer. This check
runs both under several transformers releases and compares them with the newest:

1. With the current environment it builds one tiny float32 folder of each family into ``--work``/models:
   ``tpa``, ``compressed`` (every structure kind, orthogonal skips), ``farr``, ``rms_decoder`` (a tiny OPT
   after ``rotate --residual hadamard``: remote code) and ``llama_rotated`` (a tiny Llama after the default
   ``rotate``: a stock folder); plus the tiny OPT source, and fixed input ids.
2. For each version it makes a throw-away venv (package registry only): ``python -m venv``, a ``.pth`` file
   that makes this environment's site-packages visible (so torch is not reinstalled; ``.pth`` files there,
   e.g. the editable hf_symmetry, are *not* processed), then ``pip install transformers==X`` (pip adds the
   tokenizers/huggingface-hub it needs to the venv, which shadow this environment's). It checks
   ``transformers.__version__ == X`` and that torch imports, then runs two children with ``python -S`` and a
   ``sys.path`` set by hand:

   * ``load``: hf_symmetry *not* importable (refused otherwise). Each folder is loaded with
     ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=float32)``, then: float32
     logits on the ids (batch 2 × 24), the KV cache a ``use_cache=True`` forward returns, and 6 greedy
     tokens by ``generate`` with the cache and without it (the two must agree: a broken cache generates
     other text, as in issue 27). Deprecation warnings raised are recorded.
   * ``engine``: hf_symmetry importable (this checkout). The calibration engine (float32 placement, the
     default) collects every site's second and first moments per layer, and the final statistics, on
     ``llama_rotated``, ``rms_decoder`` and ``opt`` (the families it supports among the folders).

   Results go to ``--work``/results/X as safetensors and json.
3. Every version is compared with the newest: per family max |Δlogit| and whether the greedy tokens are
   equal; per engine model the max relative difference of any statistic (max |Δ| / max |ref| per tensor).
   A version passes when every family loads, |Δlogit| ≤ 1e-5, tokens are equal, cached and uncached
   generation agree, and the engine's statistics agree to 1e-5 relative.
4. ``--bisect``: if the oldest requested version fails, the released versions between it and the newest
   (``pip index versions transformers``) are bisected for the oldest that passes; what broke in each older
   one tried is recorded (error text).

Prints one table and writes benchmarks/results/compat.json. Exit status 1 if a requested version fails.

    python benchmarks/compat.py                                # oldest supported vs newest on the registry
    python benchmarks/compat.py --versions 5.9.0 5.24.0 --bisect
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compat.json"
#: the oldest transformers this check passed on (the lower bound of the supported range)
OLDEST_SUPPORTED = "5.9.0"
FAMILIES = ("tpa", "compressed", "farr", "rms_decoder", "llama_rotated")
ENGINE_MODELS = ("llama_rotated", "rms_decoder", "opt")
NEW_TOKENS = 6
TOL = 1e-5
VOCAB = 97


# ------------------------------------------------------------------------------------------ versions
def _key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in v.split("."))


def released_versions() -> list[str]:
    """Released (non-yanked, final) transformers versions on the package registry, oldest first."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "transformers", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("Available versions:"))
    vs = [v.strip() for v in line.split(":", 1)[1].split(",")]
    return sorted((v for v in vs if all(p.isdigit() for p in v.split("."))), key=_key)


# ------------------------------------------------------------------------------------------ 1. build
def build(work: Path) -> None:
    """The tiny folders and ids, with the current environment."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from heal_models import tiny

    from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint
    from hf_symmetry.testing import input_ids, tiny_model

    models = work / "models"
    if models.exists():
        shutil.rmtree(models)
    models.mkdir(parents=True)
    for family in ("tpa", "compressed", "farr"):
        tiny(family, vocab=VOCAB, init_std=0.2).save_pretrained(models / family)
    tiny_model("opt", dtype=torch.float32).save_pretrained(models / "opt")
    rotate_checkpoint(
        models / "opt",
        models / "rms_decoder",
        RotateOptions(residual="hadamard", heads="none", ffn=False),
        progress=False,
    )
    tiny_model("llama", dtype=torch.float32).save_pretrained(models / "llama")
    rotate_checkpoint(models / "llama", models / "llama_rotated", RotateOptions(), progress=False)
    ids = {
        "logits": input_ids(VOCAB, batch=2, length=24, seed=0).tolist(),
        "calibration": input_ids(VOCAB, batch=1, length=96, seed=1).reshape(-1).tolist(),
    }
    (work / "ids.json").write_text(json.dumps(ids))


# ------------------------------------------------------------------------------------------ 2. venvs
def _purelib(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def make_venv(work: Path, version: str) -> tuple[Path, str]:
    """A venv with transformers==version over this environment's site-packages; (python, its purelib)."""
    venv = work / f"venv-{version}"
    python = venv / "bin" / "python"
    check = (
        "import sys, torch, transformers; assert transformers.__version__ == sys.argv[1], "
        "transformers.__version__; print(transformers.__version__, torch.__version__)"
    )
    if python.exists() and subprocess.run([str(python), "-c", check, version], capture_output=True).returncode == 0:
        return python, _purelib(python)
    if venv.exists():
        shutil.rmtree(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    site = _purelib(python)
    Path(site, "_hf_symmetry_compat.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # pip never uninstalls what lies outside the venv: this environment's packages are left as they are
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"transformers=={version}"],
        check=True,
    )
    run = subprocess.run([str(python), "-c", check, version], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"venv for {version} is not usable: {run.stderr[-1500:]}")
    return python, site


def _child_env(work: Path, version: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HOME=str(work / "hf_home"),
        HF_MODULES_CACHE=str(work / f"hf_modules-{version}"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONNOUSERSITE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_version(work: Path, version: str, keep_venv: bool = True) -> dict:
    """Install ``version`` in a venv and run both children; returns their summaries (or the error)."""
    out = work / "results" / version
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        python, site = make_venv(work, version)
    except Exception as e:  # noqa: BLE001  (an install that fails is a result too)
        return {"version": version, "install_error": f"{type(e).__name__}: {e}"}
    summary = {"version": version, "install_s": round(time.perf_counter() - t0, 1)}
    main_site = sysconfig.get_paths()["purelib"]
    for child in ("load", "engine"):
        t0 = time.perf_counter()
        run = subprocess.run(
            [
                str(python),
                "-S",
                __file__,
                "--child",
                child,
                "--work",
                str(work),
                "--version",
                version,
                "--sites",
                site,
                main_site,
            ],
            env=_child_env(work, version),
            capture_output=True,
            text=True,
            timeout=900,
            cwd=work,
        )
        summary[f"{child}_s"] = round(time.perf_counter() - t0, 1)
        if run.returncode:
            summary[f"{child}_error"] = run.stderr.strip()[-3000:]
    if not keep_venv:
        shutil.rmtree(work / f"venv-{version}", ignore_errors=True)
    return summary


# ------------------------------------------------------------------------------------------ children
def _child_path(args, with_hf_symmetry: bool) -> None:
    """``python -S``: no site-packages, no .pth processing. Put back exactly the venv's and this
    environment's site-packages (and the checkout, for the engine)."""
    sys.path[:] = [p for p in sys.path[1:] if "site-packages" not in p]
    sys.path += ([str(ROOT)] if with_hf_symmetry else []) + list(args.sites)
    import importlib.util

    spec = importlib.util.find_spec("hf_symmetry")
    if with_hf_symmetry:
        assert spec is not None and Path(spec.origin).resolve().is_relative_to(ROOT), spec
    elif spec is not None:
        sys.exit(f"hf_symmetry is importable ({spec.origin}): the remote-code check would prove nothing")
    import torch
    import transformers

    assert transformers.__version__ == args.version, (transformers.__version__, args.version)
    torch.set_num_threads(1)


def child_load(args) -> None:
    _child_path(args, with_hf_symmetry=False)
    import traceback
    import warnings

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    work = Path(args.work)
    out = work / "results" / args.version
    ids = torch.tensor(json.loads((work / "ids.json").read_text())["logits"])
    mask = torch.ones_like(ids)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "families": {}}
    for family in FAMILIES:
        rec: dict = {"loaded": False}
        meta["families"][family] = rec
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = AutoModelForCausalLM.from_pretrained(
                    work / "models" / family, trust_remote_code=True, dtype=torch.float32
                ).eval()
                rec.update(loaded=True, cls=f"{type(model).__module__}.{type(model).__name__}")
                with torch.no_grad():
                    fwd = model(input_ids=ids, attention_mask=mask, use_cache=True)
                    cache = next(
                        (getattr(fwd, f) for f in ("cache", "past_key_values") if getattr(fwd, f, None) is not None),
                        None,
                    )
                    rec["cache"] = None if cache is None else type(cache).__name__
                    save_file({"logits": fwd.logits.float().contiguous()}, out / f"{family}.safetensors")
                    # exactly NEW_TOKENS tokens: no stop at an end-of-sequence token
                    model.generation_config.eos_token_id = None
                    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                    rec["tokens"] = model.generate(ids, use_cache=True, **kw)[:, ids.shape[1] :].tolist()
                    rec["tokens_no_cache"] = model.generate(ids, use_cache=False, **kw)[:, ids.shape[1] :].tolist()
            rec["deprecations"] = sorted(
                {
                    f"{Path(w.filename).name}:{w.lineno}: {w.category.__name__}: {w.message}"
                    for w in caught
                    if issubclass(w.category, (FutureWarning, DeprecationWarning))
                    and Path(w.filename).name.startswith(("modeling_", "configuration_"))
                }
            )
        except Exception as e:  # noqa: BLE001  (recorded, compared, reported)
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
    (out / "load.json").write_text(json.dumps(meta, indent=1))


def child_engine(args) -> None:
    _child_path(args, with_hf_symmetry=True)
    import traceback

    import torch
    from safetensors.torch import save_file

    work = Path(args.work)
    out = work / "results" / args.version
    meta: dict = {"models": {}}
    try:
        from hf_symmetry.calibration import CalibrationEngine, StatsRequest, token_batches
        from hf_symmetry.devices import resolve
    except Exception as e:  # noqa: BLE001
        meta["import_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        (out / "engine.json").write_text(json.dumps(meta, indent=1))
        return
    ids = torch.tensor(json.loads((work / "ids.json").read_text())["calibration"])
    batches = token_batches(ids, 24, batch_size=2)
    for name in ENGINE_MODELS:
        rec: dict = {"ok": False}
        meta["models"][name] = rec
        try:
            engine = CalibrationEngine(work / "models" / name, placement=resolve("cpu", "float32"), progress=False)
            sites = tuple(engine.adapter.site_modules())
            request = StatsRequest(
                grams=sites + ("layer_in", "layer_out", "normed:layer_in"), sums=sites + ("layer_in",)
            )
            final = StatsRequest(grams=("final_in", "head_in"), sums=("head_in",))
            result = engine.collect(batches, request, final=final)
            tensors = {}
            for i, stats in enumerate(result.layers + [result.final]):
                tag = "final" if i == len(result.layers) else f"layer{i}"
                for kind in ("grams", "sums"):
                    for site, t in getattr(stats, kind).items():
                        tensors[f"{tag}.{kind}.{site}"] = t.double().contiguous()
                rec.setdefault("tokens", []).append(stats.tokens)
            save_file(tensors, out / f"engine-{name}.safetensors")
            rec.update(ok=True, statistics=len(tensors))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
    (out / "engine.json").write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------------------------ 3. compare
def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def compare(work: Path, version: str, ref: str, summary: dict) -> dict:
    """``version``'s results against ``ref``'s: figures per family and engine model, and the failures."""
    from safetensors.torch import load_file

    a_dir, b_dir = work / "results" / version, work / "results" / ref
    load_a, load_b = _read(a_dir / "load.json"), _read(b_dir / "load.json")
    eng_a, eng_b = _read(a_dir / "engine.json"), _read(b_dir / "engine.json")
    row: dict = {"version": version, "families": {}, "engine": {}, "failures": []}
    for k in ("install_error", "load_error", "engine_error"):
        if summary.get(k):
            row["failures"].append(f"{k}: {summary[k].strip().splitlines()[-1]}")
            row[k] = summary[k]
    if load_a:
        row["transformers"], row["torch"] = load_a["transformers"], load_a["torch"]
    for family in FAMILIES:
        ra = (load_a or {}).get("families", {}).get(family, {})
        rb = (load_b or {}).get("families", {}).get(family, {})
        fig: dict = {
            "loads": bool(ra.get("loaded")),
            "class": ra.get("cls"),
            "cache": ra.get("cache"),
            "deprecations": ra.get("deprecations", []),
        }
        row["families"][family] = fig
        if "error" in ra or not ra:
            fig["error"] = ra.get("error", "no result")
            row["failures"].append(f"{family}: {fig['error'].splitlines()[0][:300]}")
            continue
        if "error" in rb or not rb:
            row["failures"].append(f"{family}: no reference result under {ref}")
            continue
        la, lb = (
            load_file(a_dir / f"{family}.safetensors")["logits"],
            load_file(b_dir / f"{family}.safetensors")["logits"],
        )
        fig["max_abs_dlogit"] = (la.double() - lb.double()).abs().max().item() if la.shape == lb.shape else float("inf")
        fig["logit_scale"] = lb.abs().max().item()
        fig["tokens"] = ra["tokens"]
        fig["tokens_equal"] = ra["tokens"] == rb["tokens"]
        fig["cache_equals_no_cache"] = ra["tokens"] == ra["tokens_no_cache"]
        if fig["max_abs_dlogit"] > TOL:
            row["failures"].append(f"{family}: max |Δlogit| {fig['max_abs_dlogit']:.3g} > {TOL:g}")
        if any(len(t) != NEW_TOKENS for t in ra["tokens"]):
            row["failures"].append(f"{family}: generate gave {[len(t) for t in ra['tokens']]} tokens, not {NEW_TOKENS}")
        if not fig["tokens_equal"]:
            row["failures"].append(f"{family}: greedy tokens {ra['tokens']} != {rb['tokens']} under {ref}")
        if not fig["cache_equals_no_cache"]:
            row["failures"].append(
                f"{family}: generation with the cache {ra['tokens']} != without {ra['tokens_no_cache']}"
            )
        if fig["cache"] is None:
            row["failures"].append(f"{family}: forward(use_cache=True) returned no cache")
    if eng_a and eng_a.get("import_error"):
        row["failures"].append(f"engine: {eng_a['import_error'].splitlines()[0][:300]}")
        row["engine_import_error"] = eng_a["import_error"]
    for name in ENGINE_MODELS:
        ra = (eng_a or {}).get("models", {}).get(name, {})
        rb = (eng_b or {}).get("models", {}).get(name, {})
        fig = {"ok": bool(ra.get("ok"))}
        row["engine"][name] = fig
        if not ra.get("ok"):
            fig["error"] = ra.get("error", "no result")
            if not (eng_a and eng_a.get("import_error")):
                row["failures"].append(f"engine/{name}: {fig['error'].splitlines()[0][:300]}")
            continue
        if not rb.get("ok"):
            row["failures"].append(f"engine/{name}: no reference result under {ref}")
            continue
        sa, sb = load_file(a_dir / f"engine-{name}.safetensors"), load_file(b_dir / f"engine-{name}.safetensors")
        if set(sa) != set(sb) or ra.get("tokens") != rb.get("tokens"):
            fig["max_rel_diff"] = float("inf")
        else:
            fig["max_rel_diff"] = max(
                ((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp_min(1e-30)).item() for k in sb
            )
        fig["statistics"] = len(sb)
        if fig["max_rel_diff"] > TOL:
            row["failures"].append(f"engine/{name}: statistics differ, max relative {fig['max_rel_diff']:.3g}")
    row["passes"] = not row["failures"]
    return row


# ------------------------------------------------------------------------------------------ report
def _cell(r: dict, ref: str, family: str | None = None, engine: str | None = None) -> str:
    if family:
        f = r["families"].get(family, {})
        if not f.get("loads"):
            return "load fails"
        if "error" in f:
            return "run fails"
        if "max_abs_dlogit" not in f:
            return "no ref"
        marks = ("" if f["tokens_equal"] else " tokens≠") + ("" if f["cache_equals_no_cache"] else " cache≠")
        return ("ref" if r["version"] == ref else f"{f['max_abs_dlogit']:.0e}") + marks
    e = r["engine"].get(engine, {})
    return "fails" if "max_rel_diff" not in e else "ref" if r["version"] == ref else f"{e['max_rel_diff']:.0e}"


def table(rows: list[dict], ref: str) -> str:
    """One row per version: max |Δlogit| per family (``tokens≠``: greedy tokens differ from the reference's;
    ``cache≠``: generation with the cache differs from without), the engine's max relative difference."""
    head = ["transformers"] + list(FAMILIES) + [f"engine {m}" for m in ENGINE_MODELS] + ["passes"]
    lines = [
        [r["version"]]
        + [_cell(r, ref, family=f) for f in FAMILIES]
        + [_cell(r, ref, engine=m) for m in ENGINE_MODELS]
        + ["yes" if r["passes"] else "NO"]
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in [head] + lines) for i in range(len(head))]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(c) for c in lines])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--versions",
        nargs="+",
        help=f"transformers versions (default: {OLDEST_SUPPORTED} and the newest "
        "on the registry); the last is the reference",
    )
    p.add_argument("--work", default="/tmp/hf_symmetry_compat", help="work dir (folders, venvs, results)")
    p.add_argument(
        "--bisect",
        action="store_true",
        help="if the oldest version fails, bisect the released versions up to the newest for the oldest that passes",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also every minor release between the oldest and the newest version (its newest patch)",
    )
    p.add_argument(
        "--expect-fail",
        nargs="*",
        default=[],
        metavar="VERSION",
        help="older versions run as a negative control: each must fail the check (what broke is recorded)",
    )
    p.add_argument("--keep-venvs", action="store_true", help="keep the venvs (a rerun reuses them)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--child", choices=("load", "engine"), help=argparse.SUPPRESS)
    p.add_argument("--version", help=argparse.SUPPRESS)
    p.add_argument("--sites", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        (child_load if args.child == "load" else child_engine)(args)
        return 0

    import torch
    import transformers

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    released = released_versions() if (not args.versions or args.bisect or args.sweep) else []
    versions = args.versions or [OLDEST_SUPPORTED, released[-1]]
    versions = sorted(dict.fromkeys(versions), key=_key)
    ref = versions[-1]
    if args.sweep:
        minors: dict = {}
        for v in released:
            if _key(versions[0]) < _key(v) < _key(ref):
                minors[_key(v)[:2]] = v  # oldest first: the newest patch wins
        versions = sorted(dict.fromkeys(versions + list(minors.values())), key=_key)
    expect_fail = sorted(dict.fromkeys(args.expect_fail), key=_key)
    start = time.perf_counter()
    print(f"building the tiny folders with transformers {transformers.__version__} in {work}/models", flush=True)
    build(work)
    summaries = {}
    for v in [ref] + versions[:-1] + expect_fail:
        print(f"transformers {v}: venv, load (remote code, no hf_symmetry), engine ...", flush=True)
        summaries[v] = run_version(work, v, args.keep_venvs)
    controls = [compare(work, v, ref, summaries[v]) for v in expect_fail]
    rows = [compare(work, v, ref, summaries[v]) for v in versions]
    if rows[-1]["failures"]:
        print(f"the reference {ref} itself fails: {rows[-1]['failures']}", file=sys.stderr)
    bisect: dict | None = None
    if args.bisect and not rows[0]["passes"] and rows[-1]["passes"]:
        cands = [v for v in released if _key(versions[0]) < _key(v) < _key(ref)]
        lo, hi = -1, len(cands)  # cands[lo] fails (or the oldest), cands[hi] passes (or the reference)
        tried = {}
        while hi - lo > 1:
            mid = (lo + hi) // 2
            v = cands[mid]
            print(f"bisect: transformers {v} ...", flush=True)
            tried[v] = compare(work, v, ref, run_version(work, v, args.keep_venvs))
            print(
                f"  {'passes' if tried[v]['passes'] else 'fails: ' + '; '.join(tried[v]['failures'])[:600]}", flush=True
            )
            lo, hi = (lo, mid) if tried[v]["passes"] else (mid, hi)
        oldest = cands[hi] if hi < len(cands) else ref
        bisect = {
            "candidates": cands,
            "oldest_passing": oldest,
            "newest_failing": cands[lo] if lo >= 0 else versions[0],
            "tried": tried,
        }
        if oldest in tried:
            rows.insert(-1, tried[oldest])
    print(table(controls + rows, ref))
    for r in controls + rows:
        for f in r["failures"]:
            print(f"  {r['version']}: {f}")
    if bisect:
        print(
            f"bisect: the oldest passing version is {bisect['oldest_passing']} "
            f"(newest failing: {bisect['newest_failing']})"
        )
        for v, r in bisect["tried"].items():
            print(f"  {v}: {'passes' if r['passes'] else 'fails: ' + '; '.join(r['failures'])[:800]}")
    report = {
        "versions": versions,
        "reference": ref,
        "tolerance": TOL,
        "new_tokens": NEW_TOKENS,
        "built_with": {"transformers": transformers.__version__, "torch": torch.__version__},
        "machine": f"{platform.machine()} CPU, 1 thread per child, shared 2-core VM,"
        f" Python {platform.python_version()}",
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.perf_counter() - start),
        "results": rows,
        "bisect": bisect,
        "expected_failures": controls,
        "table": table(controls + rows, ref),
        # every requested version passes: from the oldest; else the bisect's answer
        "supported_range": (
            [versions[0], ref]
            if all(r["passes"] for r in rows)
            else [bisect["oldest_passing"], ref]
            if bisect
            else None
        ),
        "passes": (
            all(r["passes"] for r in rows if r["version"] in versions) and not any(r["passes"] for r in controls)
        ),
    }
    for r in controls:
        if r["passes"]:
            print(f"negative control {r['version']} passes the check: expected it to fail", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if report["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
