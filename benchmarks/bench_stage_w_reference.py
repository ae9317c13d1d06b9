"""Stage W (ProcrustesGPT's weighted step) against the authors' reference code, on real SmolLM2 segments.

Both solvers get the same problem: one residual segment of SmolLM2-135M-Instruct (its writer and its
readers, norm-folded), the same calibration covariances (this project's one-pass statistics on
``britannica-calib``, damped as ``compress`` damps them), the same structures (the paper's Llama
configuration: Kronecker rank 3 with a 1x4 / 4x1 factor on the residual side, i.e. 75 % of each
compressed matrix; V dense) and the same starting rotation (this project's stage F from Q = I).

* ours: :func:`hf_symmetry.solvers.segments.solve_segment` (float32 iterations, float64 result), run to
  convergence by its stopping rule (``ours_converged``: relative decrease per alternation below 1e-3,
  over-relaxation on) and, for comparison, the previous fixed single alternation (``ours_one_alternation``);
* the reference: ``procrustes.wopp.weighted_procrustes_als`` of github.com/GrishKate/ProcrustesGPT
  (MIT) with its ``configs/compression_weighted.yaml`` settings (1 ALS iteration, 500 Cayley + CG
  steps, 1 approximation iteration; ``cut_values`` for attention segments, as its pipeline does), in a
  **subprocess** whose ``PYTHONPATH`` is the checkout given by ``--reference`` — this project never
  imports it. The segment is handed over already rotated by the stage F rotation (as the reference
  rotates the network before its weighted stage).

Both results are scored by one function here, on the paper's objective (ProcrustesGPT, eq. 3: squared
weighted errors, readers scaled by ``λ = Σ‖X_out W_out‖² / Σ‖X_in W_in‖²``) and on the loss the
reference's code actually minimises (unsquared norms, its own balancing ``α``). Both run on one CPU
thread; ``cpu_seconds`` (process time) is the figure to compare on a shared machine.

Run: .venv/bin/python benchmarks/bench_stage_w_reference.py [--reference /path/to/ProcrustesGPT]
     [--reference-pythonpath DIR]   (a folder with ``einops``, which the reference imports)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
CACHE = HERE / "_cache" / "stage_w"
RESULTS = HERE / "results" / "stage_w_reference.json"

RANK, FACTOR = 3, 4  # the paper's Llama configuration (configs/k_layers_llama2_7b.yaml): r=3, 4x1 / 1x4


# ----------------------------------------------------------------------------- the problem
def segment_problems(segments: list[tuple[str, int]], calib_tokens: int, damping: float = 0.01) -> dict:
    """Per segment ``(kind, layer)``: matrices ``M [k, d]`` (residual dimension on the columns, original
    basis, norms folded), their roles and the damped covariances. ``attn``: writer down of layer-1,
    readers q, k, v of ``layer``; ``ffn``: writer o of ``layer``, readers gate, up. The second moments are
    those of ``compress``'s one-pass calibration (this project's calibration engine, run only up to the
    last layer needed), damped as ``compress`` damps them; cached under benchmarks/_cache/stage_w/."""
    paths = {(kind, layer): CACHE / f"seg_{kind}{layer}_{calib_tokens}.safetensors" for kind, layer in segments}
    missing = [s for s, path in paths.items() if not path.is_file()]
    if missing:
        from hf_symmetry.assets import smollm2_dir, text_path
        from hf_symmetry.calibration import CalibrationEngine, StatsRequest, token_batches
        from hf_symmetry.checkpoint_io import CheckpointReader
        from hf_symmetry.conversion import compress as C
        from hf_symmetry.evaluation.compare import load_tokenizer
        from hf_symmetry.text import read_text, tokenize_text

        src = smollm2_dir()
        ids = tokenize_text(load_tokenizer(src), read_text(text_path("britannica-calib")), max_tokens=calib_tokens)
        reader = CheckpointReader(src)
        keys = reader.keys()
        adapter = C.check_family(reader.config, keys)
        # the second moments compress's one-pass calibration uses, on the layers these segments touch only
        needed = sorted({i for kind, layer in missing for i in ((layer - 1, layer) if kind == "attn" else (layer,))})
        result = CalibrationEngine(reader, reader.config).collect(
            token_batches(ids, 512),
            StatsRequest(grams=("normed:layer_in", "normed:ffn_norm_in", "o_in", "down_in")),
            layers=needed,
        )
        moment = lambda i, site: result.layers[i].grams[site] / result.tokens  # noqa: E731
        layers, _, _ = C.read_folded(reader, adapter, keys, adapter.tied_embeddings)
        for kind, layer in missing:
            t = {}
            if kind == "attn":
                t["writer.down"] = layers[layer - 1]["down.weight"].T
                t["writer_gram"] = damped(moment(layer - 1, "down_in"), damping)
                for c in ("q", "k", "v"):
                    t[f"reader.{c}"] = layers[layer][f"{c}.weight"]
                cov = moment(layer, "normed:layer_in")
            else:
                t["writer.o"] = layers[layer]["o.weight"].T
                t["writer_gram"] = damped(moment(layer, "o_in"), damping)
                for c in ("gate", "up"):
                    t[f"reader.{c}"] = layers[layer][f"{c}.weight"]
                cov = moment(layer, "normed:ffn_norm_in")
            t["reader_cov"] = damped(cov, damping)
            CACHE.mkdir(parents=True, exist_ok=True)
            save_file({k: v.to(torch.float64).contiguous() for k, v in t.items()}, str(paths[(kind, layer)]))
    return {s: load_file(str(path)) for s, path in paths.items()}


def damped(G: torch.Tensor, damping: float) -> torch.Tensor:
    """``G + δ mean(diag G) I``, the damping ``compress`` applies to every covariance."""
    return G + damping * G.diagonal().mean().clamp_min(1e-12) * torch.eye(G.shape[0], dtype=G.dtype)


def _paper_structure(role: str, name: str, shape: tuple[int, int]):
    """The reference comparison's structures: Kronecker sums, V dense."""
    from hf_symmetry.solvers import structures as S

    return S.Dense(shape) if name == "v" else S.Kron(shape, RANK, (1, FACTOR))


def build_terms(p: dict, stage: str, structure_of=_paper_structure):
    """Our :class:`Term` list (balanced as ``compress`` balances) for stage ``f`` or ``w``;
    ``structure_of(role, name, shape)`` gives each matrix's structure."""
    from hf_symmetry.solvers import structures as S
    from hf_symmetry.solvers.segments import Term, balance

    terms, readers = [], []
    for key, M in p.items():
        role, _, name = key.partition(".")
        if role not in ("writer", "reader"):
            continue
        t = Term(name, M.clone(), structure_of(role, name, tuple(M.shape)))
        if stage == "w":
            if role == "writer":
                t.row_gram = S.Gram(matrix=p["writer_gram"])
            else:
                t.col_gram = p["reader_cov"]
        terms.append(t)
        if role == "reader":
            readers.append(t)
    balance(terms, readers)
    return terms


def sqrtm_psd(C: torch.Tensor) -> torch.Tensor:
    lam, V = torch.linalg.eigh((C + C.T) / 2)
    return (V * lam.clamp_min(0).sqrt()) @ V.T


def score(p: dict, Q: torch.Tensor, approx: dict) -> dict:
    """Both objectives of one solution: ``Q`` (original basis) and the dense approximations ``approx``
    (name -> ``Ŵ [k, d]`` of ``M Q``; dense terms absent: they follow Q exactly)."""
    Q = Q.to(torch.float64)
    Xout = sqrtm_psd(p["writer_gram"])
    Xin = sqrtm_psd(p["reader_cov"])
    w_err, w_energy, r_err, r_energy, r_norms, r_energy_norms = 0.0, 0.0, 0.0, 0.0, 0.0, []
    for key, M in p.items():
        role, _, name = key.partition(".")
        if role == "writer":
            E = Xout @ (M @ Q - approx[name])
            w_err, w_energy = float((E * E).sum()), float(((Xout @ M) ** 2).sum())
            w_norm = float(torch.linalg.matrix_norm(Xout @ M))
            w_err_norm = float(torch.linalg.matrix_norm(E))
        elif role == "reader":
            if name not in approx:  # dense (V): exact at every Q, and left out of the reference's loss
                continue
            r_energy_norms.append(float(torch.linalg.matrix_norm(Xin @ M.T)))
            E = Xin @ (M.T - Q @ approx[name].T)  # ‖X_in (W_in − Q Ŵ_in)‖, W_in = Mᵀ [d, out]
            r_err += float((E * E).sum())
            r_energy += float(((Xin @ M.T) ** 2).sum())
            r_norms += float(torch.linalg.matrix_norm(E))
    lam = w_energy / r_energy
    alpha = sum(r_energy_norms) / len(r_energy_norms) / w_norm  # the reference's balancing (wopp.py)
    return {
        "paper_objective": w_err + lam * r_err,
        "writer_error": w_err,
        "reader_error": r_err,
        "lambda": lam,
        "relative": (w_err + lam * r_err) / (w_energy + lam * r_energy),
        "reference_loss": alpha * w_err_norm + r_norms,
    }


# ----------------------------------------------------------------------------- our side
def stage_f(p: dict, iters: int) -> torch.Tensor:
    from hf_symmetry.solvers.segments import Alternation, solve_segment

    d = p["reader_cov"].shape[0]
    return solve_segment(build_terms(p, "f"), torch.eye(d, dtype=torch.float64), Alternation(iters=iters)).Q


def run_ours(p: dict, Q_F: torch.Tensor, **kwargs) -> dict:
    from hf_symmetry.solvers.segments import Alternation, solve_segment

    terms = build_terms(p, "w")
    t0, c0 = time.perf_counter(), time.process_time()
    res = solve_segment(terms, Q_F, Alternation(**kwargs))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    approx = {t.name: t.structure.dense(t.factors) for t in terms if not t.is_dense}
    out = score(p, res.Q, approx)
    out.update(
        seconds=seconds,
        cpu_seconds=cpu,
        alternations=res.alternations,
        converged=res.converged,
        trace=res.trace,
        trace_first=res.trace[0],
        trace_last=res.trace[-1],
        settings={k: str(v) for k, v in kwargs.items()},
    )
    return out


# ----------------------------------------------------------------------------- the reference's side
DRIVER = r"""
import json, sys, time, types
import torch
from safetensors.torch import load_file, save_file

ref = sys.argv[1]
# import the reference's modules without its package initialisers (they pull in datasets, lm-eval, ...);
# monarch_utils imports torchmin at the top, which the Kronecker path never uses
pkg = types.ModuleType("slicegpt"); pkg.__path__ = [ref + "/slicegpt"]; sys.modules["slicegpt"] = pkg
sys.modules.setdefault("torchmin", types.ModuleType("torchmin"))
from procrustes.wopp import weighted_procrustes_als
from procrustes.kron_utils import kron_merge

torch.set_num_threads(1)
t = load_file(sys.argv[2])
spec = json.loads(sys.argv[4])
cfg = types.SimpleNamespace(als_iters=spec["als_iters"], gd_iters=spec["gd_iters"], use_cg=True,
                            approx_iters=spec["approx_iters"], test=False)
layer_cfg = types.SimpleNamespace(cfg=types.SimpleNamespace(decomposition="kronecker", model_name="llama"))
f = lambda x: x.to(torch.float32)
Wout = [f(t["Wout"])]
Xout, Xout_inv = [f(t["Xout"])], [f(t["Xout_inv"])]
Win = [f(t[f"Win.{i}"]) for i in range(spec["n_in"])]
Xin = [f(t["Xin"]) for _ in range(spec["n_in"])]
t0, c0 = time.perf_counter(), time.process_time()
Qt, Wout_appr, Win_appr, _ = weighted_procrustes_als(Wout, (Xout, Xout_inv), Win, (Xin, [None] * len(Xin)),
                                                     spec["params_out"], spec["params_in"], cfg, layer_cfg,
                                                     "cpu", cut_values=spec["cut_values"])
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
out = {"Q": Qt.T.contiguous(), "Wout": kron_merge(Wout_appr)[0].contiguous()}
out.update({f"Win.{i}": w.contiguous() for i, w in enumerate(kron_merge(Win_appr))})
save_file(out, sys.argv[3])
print("SECONDS", seconds, cpu)
"""


def run_reference(
    p: dict, Q_F: torch.Tensor, reference: Path, extra_path: str | None, gd_iters: int, timeout: float
) -> dict:
    """The reference's ``weighted_procrustes_als`` on the segment rotated by ``Q_F`` (its convention:
    ``Wout [in, d]``, ``Win [d, out]``, ``X`` the covariance square roots), in a subprocess."""
    readers = [(k.partition(".")[2], M) for k, M in p.items() if k.startswith("reader.")]
    ((wname, Wout),) = [(k.partition(".")[2], M) for k, M in p.items() if k.startswith("writer.")]
    Xout = sqrtm_psd(p["writer_gram"])
    Xin_rot = sqrtm_psd(Q_F.T @ p["reader_cov"] @ Q_F)  # the rotated stream's covariance root
    tensors = {"Wout": Wout @ Q_F, "Xout": Xout, "Xout_inv": torch.linalg.inv(p["writer_gram"]), "Xin": Xin_rot}
    params_in = []
    for i, (name, M) in enumerate(readers):
        tensors[f"Win.{i}"] = Q_F.T @ M.T
        params_in.append({"r": 1, "m1": 1, "n1": 1} if name == "v" else {"r": RANK, "m1": FACTOR, "n1": 1})
    # the reference's pipeline drops V (the last reader, kept dense) from the attention segments' rotation
    # loss (compression_pipeline.py passes cut_values=True to the attention blocks, False to the FFN ones)
    spec = {
        "als_iters": 1,
        "gd_iters": gd_iters,
        "approx_iters": 1,
        "n_in": len(readers),
        "cut_values": readers[-1][0] == "v",
        "params_out": [{"r": RANK, "m1": 1, "n1": FACTOR}],
        "params_in": params_in,
    }
    with tempfile.TemporaryDirectory(prefix="stage_w_ref_") as tmp:
        inp, outp, drv = Path(tmp) / "in.safetensors", Path(tmp) / "out.safetensors", Path(tmp) / "driver.py"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(inp))
        drv.write_text(DRIVER)
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(reference)] + ([extra_path] if extra_path else [])),
        )
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(drv), str(reference), str(inp), str(outp), json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp,
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"reference run failed:\n{proc.stderr[-3000:]}")
        res = load_file(str(outp))
    seconds, cpu = map(float, next(ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("SECONDS")))
    errs = [ln for ln in proc.stdout.splitlines() if ln.startswith("weighted procrustes errs")]
    Q = Q_F @ res["Q"].to(torch.float64)
    approx = {wname: res["Wout"].to(torch.float64)}
    for i, (name, _) in enumerate(readers):
        if name != "v":
            approx[name] = res[f"Win.{i}"].to(torch.float64).T
    out = score(p, Q, approx)
    out.update(
        seconds=seconds,
        cpu_seconds=cpu,
        subprocess_wall_seconds=wall,
        gd_iters=gd_iters,
        orthogonality=float(
            (res["Q"].double().T @ res["Q"].double() - torch.eye(Q.shape[0], dtype=torch.float64)).abs().max()
        ),
        own_log=errs[-1] if errs else None,
    )
    return out


def reference_commit(reference: Path) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(reference), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, help="a checkout of github.com/GrishKate/ProcrustesGPT (optional)")
    ap.add_argument("--reference-pythonpath", help="extra PYTHONPATH for the reference (a folder with einops)")
    ap.add_argument("--reference-commit", help="the reference's commit, when --reference is not a git checkout")
    ap.add_argument("--gd-iters", type=int, default=500, help="the reference's Cayley/CG steps (its default: 500)")
    ap.add_argument("--segments", default="ffn5,attn5", help="comma-separated, e.g. ffn5,attn5 (kind + layer)")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--f-iters", type=int, default=10, help="stage F alternations giving the common start")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed to one reference run")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.reference is not None and not (args.reference / "procrustes" / "wopp.py").is_file():
        ap.error(f"--reference {args.reference} has no procrustes/wopp.py (a ProcrustesGPT checkout is expected)")
    torch.set_num_threads(1)
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results["machine"] = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "threads": 1,
        "torch": torch.__version__,
    }
    results["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results["setup"] = {
        "structure": f"Kronecker rank {RANK}, factor {FACTOR} on the residual side, V dense",
        "calib_tokens": args.calib_tokens,
        "stage_f_iters": args.f_iters,
        "damping": 0.01,
    }
    if args.reference is not None:
        results["reference"] = {
            "path_name": args.reference.name,
            "commit": args.reference_commit or reference_commit(args.reference),
            "settings": {
                "als_iters": 1,
                "gd_iters": args.gd_iters,
                "approx_iters": 1,
                "use_cg": True,
                "dtype": "float32",
            },
        }
    rows = results.setdefault("segments", {})
    wanted = []
    for seg in args.segments.split(","):
        match = re.fullmatch(r"(attn|ffn)(\d+)", seg.strip())
        if match is None or (match[1] == "attn" and int(match[2]) == 0):
            ap.error(f"bad segment {seg!r}: expected attn<layer> (layer >= 1) or ffn<layer>")
        wanted.append((match[1], int(match[2])))
    problems = segment_problems(wanted, args.calib_tokens)
    for kind, layer in wanted:
        seg, p = f"{kind}{layer}", problems[(kind, layer)]
        Q_F = stage_f(p, args.f_iters)
        row = rows.setdefault(seg, {})
        row["start"] = run_ours(p, Q_F, iters=0)
        # compress's previous stage W: one alternation (CompressOptions w_iters=1, als_iters=5, wopp_iters=50)
        row["ours_one_alternation"] = run_ours(p, Q_F, iters=1, als_iters=5, wopp_iters=50, dtype=torch.float32)
        # to convergence: stop when an alternation lowers the objective by less than 0.1 %
        row["ours_converged"] = run_ours(
            p, Q_F, iters=50, als_iters=3, wopp_iters=30, dtype=torch.float32, tol=1e-3, extrapolate=True
        )
        if args.reference is not None:
            row[f"reference_{args.gd_iters}"] = run_reference(
                p, Q_F, args.reference, args.reference_pythonpath, args.gd_iters, args.timeout
            )
        print(seg, json.dumps(row, indent=1))
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
