"""Decoding with SmolLM2-135M-Instruct converted to Tensor Product Attention, against the source model with its
own cache and with transformers' QuantizedCache.

Models: the source (SDPA), its ``hf-symmetry to-tpa`` conversions at full rank (exact: the cache equals the
source's) and at k/v ranks 2 and 1 (calibrated on britannica-calib), and the rank-2 conversion healed with
``hf-symmetry heal``'s default recipe (pure distillation from the source, half the sequences sampled from it,
LoRA 16) on 32 768 tokens of the embedded Shakespeare plays other than hamlet, 4 x 128 per step (about half
an hour on one CPU thread; made once, reused).
Caches: transformers' dynamic cache (TPA: the factor cache), ``generate(cache_implementation="quantized",
cache_config={"backend": "hqq", "nbits": n, "q_group_size": 64, "residual_length": 128})`` (the
source: transformers' HQQ QuantizedCache; a TPA model turns the same request into its quantized *factor* cache,
same nbits, group and residual window), and a static cache for compiled decoding.

Every measurement runs in a fresh subprocess (one configuration, context length and batch):

* ``eager``: ``generate`` of 32 new tokens (greedy, forced length) after a prompt of L tokens of hamlet, batch B.
  Prefill time and decode ms/token from a stopping-criteria clock; memory: resident set (``/proc/self/statm``,
  sampled every 0.5 ms by a thread) above the level before ``generate`` (weights touched by a warm-up forward),
  peak during prefill and peak during decode (the decode peak includes the cache and whatever the allocator kept
  from prefill: what a user sees); on a GPU ``torch.cuda.max_memory_allocated`` instead. The cache's bytes are
  summed over the tensors it holds after ``generate`` and compared with the formula.
* ``compiled``: a static cache (``StaticCache``; a TPA model fills it with preallocated factors), eager prefill,
  8 eager decode steps, then ``torch.compile(model.forward, fullgraph=True)`` steps: 2 warm-up (compile) steps
  and 32 timed ones.
* ``ppl``: held-out quality on hamlet: the project's perplexity (``hf_symmetry.evaluation.perplexity``: 2048
  tokens, window 512, stride 256; no cache involved: the model) and the perplexity *through the cache*: a prefill
  of 512 tokens, then 256 tokens fed one at a time through the configured cache (quantized caches quantize the
  prompt at once), each scored.

    python benchmarks/bench_tpa_decode.py                      # the default grid (hours on a 2-core CPU)
    python benchmarks/bench_tpa_decode.py --contexts 512 --batches 1 --configs source tpa-exact
    python benchmarks/bench_tpa_decode.py --device cuda        # on a GPU

Results are merged into benchmarks/results/tpa_decode.json (one record per configuration, mode, L and B; a
rerun replaces its own records) with the tables BENCHMARKS.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from child import Clock, Memory, machine, run_child, trim  # benchmarks/ is on the path: this script runs from there

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "tpa_decode.json"
NEW_TOKENS = 32
QCACHE = {"backend": "hqq", "q_group_size": 64, "residual_length": 128}
#: name -> (model, cache): model "source" or a TPA folder name; cache None (dynamic) or quantized nbits
CONFIGS = {
    "source": ("source", None),
    "source-hqq4": ("source", 4),
    "source-hqq2": ("source", 2),
    "tpa-exact": ("exact", None),
    "tpa-r2": ("r2", None),
    "tpa-r1": ("r1", None),
    "tpa-exact-q4": ("exact", 4),
    "tpa-r2-q4": ("r2", 4),
    "tpa-r2-q2": ("r2", 2),
    "tpa-r2-healed": ("r2-healed", None),
    "tpa-r2-healed-q4": ("r2-healed", 4),
}
RANKS = {"exact": None, "r2": 2, "r1": 1}
#: healed folder -> the conversion it heals
HEALED = {"r2-healed": "r2"}
HEAL_TOKENS = 32768


# ----------------------------------------------------------------------------------------------
# Parent: models, the grid, the tables
# ----------------------------------------------------------------------------------------------
def build_models(work: Path, needed: set[str]) -> dict[str, str]:
    """The source folder and the TPA conversions (made once with ``hf-symmetry to-tpa``, reused); a healed
    folder only where a configuration in ``needed`` uses it (healing takes half an hour)."""
    from hf_symmetry.assets import smollm2_dir

    folders = {"source": str(smollm2_dir())}
    for name, rank in RANKS.items():
        out = work / name
        if not (out / "config.json").is_file():
            argv = [sys.executable, "-m", "hf_symmetry.cli", "to-tpa", "smollm2", str(out), "--quiet", "--no-verify"]
            if rank is not None:
                argv += ["--k-rank", str(rank), "--v-rank", str(rank), "--calib", "britannica-calib", "--overwrite"]
            subprocess.run(argv, check=True, cwd=ROOT)
        folders[name] = str(out)
    for name, student in HEALED.items():
        if name not in needed:
            continue
        out = work / name
        if not (out / "config.json").is_file():
            subprocess.run(heal_argv(folders[student], out), check=True, cwd=ROOT)
        folders[name] = str(out)
    return folders


def heal_argv(student: str, out: Path) -> list[str]:
    """``hf-symmetry heal`` with its default recipe on the plays other than hamlet (held out: the texts below
    measure on it), at the CPU settings of the project's heal benchmark (4 x 128 tokens per step)."""
    from hf_symmetry.assets import text_path

    plays = sorted(p for p in text_path("hamlet").parent.glob("*_gut.txt") if not p.name.startswith("hamlet"))
    argv = [sys.executable, "-m", "hf_symmetry.cli", "heal", student, str(out), "--teacher", "smollm2"]
    argv += [a for play in plays for a in ("--text", str(play))]
    return argv + ["--tokens", str(HEAL_TOKENS), "--seq-len", "128", "--batch-size", "4", "--eval-text", "hamlet"]


def command(data: dict, argv) -> str:
    """The invocations that produced the file's records, this one added (``;``-separated)."""
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if os.environ.get("OMP_NUM_THREADS") else ""
    this = f"{threads}python benchmarks/bench_tpa_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    done = [c for c in data.get("command", "").split("; ") if c]
    return "; ".join(done + ([this.strip()] if this.strip() not in done else []))


def key(record: dict) -> tuple:
    return record["config"], record["mode"], record.get("context"), record.get("batch")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument(
        "--modes",
        nargs="+",
        default=["eager", "compiled", "ppl"],
        choices=["eager", "live", "compiled", "ppl", "latency"],
        help="live: as eager, with glibc's mmap threshold at 64 KiB (MALLOC_MMAP_THRESHOLD_), so that freed "
        "tensors leave the resident set at once and its peak is the peak of live memory",
    )
    p.add_argument("--latency-contexts", nargs="+", type=int, default=[2048])
    p.add_argument("--latency-batches", nargs="+", type=int, default=[1])
    p.add_argument("--compiled-contexts", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--compiled-batches", nargs="+", type=int, default=[1])
    p.add_argument("--skip", nargs="*", default=[], help="CONTEXTxBATCH combinations to leave out, e.g. 8192x4")
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "hf_symmetry" / "bench_tpa_decode"))
    p.add_argument("--timeout", type=int, default=3600, help="seconds per subprocess")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folders = build_models(work, {CONFIGS[c][0] for c in args.configs})
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    runs = {key(r): r for r in data.get("runs", [])}
    jobs = []
    for mode in args.modes:  # configurations side by side for each L x B, so that they run under similar load
        if mode == "ppl":
            jobs += [dict(config=config, mode=mode) for config in args.configs]
            continue
        if mode == "latency":
            for L in args.latency_contexts:
                for B in args.latency_batches:
                    specs = {c: {"folder": folders[CONFIGS[c][0]], "nbits": CONFIGS[c][1]} for c in args.configs}
                    jobs.append(dict(config="side by side", mode=mode, context=L, batch=B, configs=specs))
            continue
        contexts = args.compiled_contexts if mode == "compiled" else args.contexts
        batches = args.compiled_batches if mode == "compiled" else args.batches
        for L in contexts:
            for B in batches:
                for config in args.configs:
                    if f"{L}x{B}" in args.skip or (mode == "compiled" and CONFIGS[config][1] is not None):
                        continue  # quantized caches are not compileable
                    jobs.append(dict(config=config, mode=mode, context=L, batch=B))
    for job in jobs:
        model, nbits = CONFIGS.get(job["config"], ("source", None))
        job.update(folder=folders[model], tpa=model != "source", nbits=nbits, device=args.device)
        print(f"{job['config']} {job['mode']} {job.get('context', '')}x{job.get('batch', '')} ...", flush=True)
        live = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)} if job["mode"] == "live" else None
        record = run_child(__file__, job, args.timeout, env=live)
        record.pop("folder")
        if "configs" in record:
            record["configs"] = list(record["configs"])
        record["load_avg"] = round(os.getloadavg()[0], 1)
        runs[key(record)] = record
        print("  ", {k: v for k, v in record.items() if k not in job}, flush=True)
        data.update(
            machine=machine(args.device),
            date=time.strftime("%Y-%m-%d", time.gmtime()),
            command=command(data, argv),
            runs=sorted(runs.values(), key=lambda r: (r["mode"], r.get("context") or 0, r.get("batch") or 0)),
        )
        from tpa_decode_tables import tables

        data["tables"] = tables(data["runs"])
        out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------
# Child: one configuration in a fresh process
# ----------------------------------------------------------------------------------------------
def cache_bytes(cache) -> dict:
    """Bytes the cache holds (per-token tensors; non-contextual A is the model's own parameter) and its tokens."""
    import torch

    held = 0
    for layer in cache.layers:
        if hasattr(layer, "per_token_tensors"):  # TPA factor layers
            held += sum(t.numel() * t.element_size() for t in layer.per_token_tensors())
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            held += t.numel() * t.element_size() if t is not None and t.dim() == 4 else 0
        for name in ("_quantized_keys", "_quantized_values"):  # transformers' QuantizedLayer: (codes, meta)
            q = getattr(layer, name, None)
            if q is not None:
                codes, meta = q
                held += codes.numel() * codes.element_size()
                held += sum(v.numel() * v.element_size() for v in meta.values() if isinstance(v, torch.Tensor))
    return {"bytes": held, "tokens": int(cache.get_seq_length())}


def formula_bytes(model, prompt: int, tokens: int, batch: int, nbits, residual: int) -> int:
    """The cache's bytes by the formula: float32 K/V (source) or factors (TPA), quantized tokens at the
    quantized bytes per token (TPA: the factor rows' codes + float16 scale/low per group of 64; HQQ: the codes +
    a float32 scale and zero per group of 64 elements) and the residual window in float32."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    if getattr(cfg, "k_rank", None) is not None:
        from hf_symmetry.modeling.cache_tpa import TPAQuantizedLayer

        full = 4 * cfg.kv_cache_elements_per_token()
        quant = (
            0
            if nbits is None
            else TPAQuantizedLayer.bytes_per_token(
                cfg.k_rank, cfg.v_rank, cfg.num_attention_heads, cfg.head_dim, cfg.contextual_a, nbits, 64
            )
        )
    else:
        elems = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
        full, quant = 4 * elems, (0 if nbits is None else elems * nbits / 8 + 2 * 4 * elems / 64)
    if nbits is None:
        return int(full * tokens * batch * layers)
    # the prompt is quantized at once; new tokens wait in the residual window until it holds `residual` of them
    q_tokens = prompt + (tokens - prompt) // residual * residual
    return int((quant * q_tokens + full * (tokens - q_tokens)) * batch * layers)


def routes(model) -> tuple[dict, object]:
    """Which attention route each phase takes (layer 0), recorded while the returned ``restore`` is not called."""
    cfg = model.config
    if getattr(cfg, "k_rank", None) is None:
        impl = cfg._attn_implementation
        return {"prefill": {f"{impl} (GQA)"}, "decode": {f"{impl} (GQA)"}}, lambda: None
    from hf_symmetry.modeling import modeling_tpa

    originals = {}

    att = model.model.layers[0].self_attn
    seen = {}
    for name in ("grouped_attention", "materialized_attention", "factor_attention"):
        original = getattr(modeling_tpa.TPAAttention, name)

        def spy(self, *a, _name=name, _original=original, **kw):
            if self is att:
                label = _name.replace("_attention", "")
                if _name == "factor_attention":
                    label = f"factor ({kw.get('route')}/{kw.get('value_route')})"
                elif _name == "materialized_attention":
                    label = f"composed K/V, {self.head_chunk()} heads per call"
                seen.setdefault("prefill" if a[0].get("b_k", a[0].get("q")).shape[2] > 1 else "decode", set()).add(
                    f"{label}, {cfg._attn_implementation}"
                )
            return _original(self, *a, **kw)

        originals[name] = original
        setattr(modeling_tpa.TPAAttention, name, spy)

    def restore():
        for name, original in originals.items():
            setattr(modeling_tpa.TPAAttention, name, original)

    return seen, restore


def hamlet_ids(tokenizer, n: int):
    import torch

    from hf_symmetry.assets import text_path
    from hf_symmetry.text import read_text, tokenize_text

    ids = tokenize_text(tokenizer, read_text(text_path("hamlet")))
    reps = -(-n // ids.numel())
    return torch.cat([ids] * reps)[:n]


def child(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteriaList

    import hf_symmetry  # noqa: F401  (registers the TPA family: the same code a saved folder carries)

    torch.manual_seed(0)
    device = torch.device(job["device"])
    if device.type == "cpu" and os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    def load(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)

    if job["mode"] == "latency":
        from tpa_decode_latency import latency

        return latency(job, load, hamlet_ids, QCACHE)
    model, tok = load(job["folder"])
    out = {}
    if job["mode"] == "ppl":
        return ppl(model, tok, job, device)

    L, B = job["context"], job["batch"]
    ids = hamlet_ids(tok, L * B).view(B, L).to(device)
    with torch.no_grad():
        model(ids[:1, :16])  # touch every weight (memory-mapped safetensors) before the baseline
    trim()
    seen, restore = routes(model)
    mem = Memory(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    if job["mode"] in ("eager", "live"):
        clock = Clock(mem, sync)
        extra = {} if job["nbits"] is None else {"cache_implementation": "quantized"}
        if job["nbits"] is not None:
            extra["cache_config"] = {**QCACHE, "nbits": job["nbits"]}
        base = mem.start()
        clock.start()
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                return_dict_in_generate=True,
                stopping_criteria=StoppingCriteriaList([clock]),
                **extra,
            )
        decode_peak = mem.read()
        cache = gen.past_key_values
        held = cache_bytes(cache)
        out.update(
            prefill_s=round(clock.prefill_s(), 3),
            decode_ms=round(clock.decode_ms(), 2),
            prefill_peak_mb=round(clock.prefill_peak(base) / 1e6, 1),
            decode_peak_mb=round((decode_peak - base) / 1e6, 1),
            cache_mb=round(held["bytes"] / 1e6, 2),
            cache_tokens=held["tokens"],
            formula_mb=round(
                formula_bytes(model, L, held["tokens"], B, job["nbits"], QCACHE["residual_length"]) / 1e6, 2
            ),
            cache_layer=type(cache.layers[0]).__name__,
        )
    else:  # compiled
        from transformers import StaticCache

        steps_eager, warm = 8, 2
        cache = StaticCache(config=model.config, max_cache_len=L + steps_eager + warm + NEW_TOKENS + 1)
        base = mem.start()
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
            sync()
            out["prefill_s"] = round(time.perf_counter() - t0, 3)
            nxt = logits[:, -1:].argmax(-1)
            pos = L

            def run(step, n):
                nonlocal nxt, pos
                sync()
                t = time.perf_counter()
                for _ in range(n):
                    position = torch.full((B, 1), pos, device=device)
                    logits = step(input_ids=nxt, position_ids=position, past_key_values=cache, logits_to_keep=1).logits
                    nxt, pos = logits[:, -1:].argmax(-1), pos + 1
                sync()
                return time.perf_counter() - t

            out["static_eager_ms"] = round(1000 * run(model.forward, steps_eager) / steps_eager, 2)
            restore()  # the route spies are Python side effects: not inside the compiled graph
            compiled = torch.compile(model.forward, fullgraph=True)
            out["compile_s"] = round(run(compiled, warm), 1)
            out["decode_ms"] = round(1000 * run(compiled, NEW_TOKENS) / NEW_TOKENS, 2)
        out["decode_peak_mb"] = round((mem.read() - base) / 1e6, 1)
        held = cache_bytes(cache)
        out.update(cache_mb=round(held["bytes"] / 1e6, 2), cache_layer=type(cache.layers[0]).__name__)
    mem.stop()
    out["route"] = {phase: sorted(labels) for phase, labels in seen.items()}
    return out


def ppl(model, tok, job: dict, device) -> dict:
    """The model's perplexity (the project's definition) and the perplexity through the configured cache."""
    import math

    import torch
    from transformers import DynamicCache, QuantizedCache

    from hf_symmetry.evaluation.perplexity import PPL, perplexity

    ids = hamlet_ids(tok, max(PPL.tokens, 512 + 256 + 1)).to(device)
    out = {"ppl_model": round(perplexity(model, ids[: PPL.tokens], progress=False).perplexity, 3)}
    cfg = model.config
    if job["nbits"] is None:
        cache = DynamicCache(config=cfg)
    else:
        cache = QuantizedCache(config=cfg, nbits=job["nbits"], **QCACHE)
    prefill, steps = 512, 256
    nll = 0.0
    with torch.no_grad():
        logits = model(ids[None, :prefill], past_key_values=cache).logits[:, -1]
        for t in range(prefill, prefill + steps):
            nll += torch.nn.functional.cross_entropy(logits.float(), ids[t : t + 1]).item()
            logits = model(ids[None, t : t + 1], past_key_values=cache).logits[:, -1]
    out.update(ppl_cache=round(math.exp(nll / steps), 3), ppl_cache_tokens=f"{prefill}+{steps}")
    out["cache_layer"] = type(cache.layers[0]).__name__
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
