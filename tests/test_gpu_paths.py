"""The CUDA path, checked on the CPU wherever a test can be written (issue 28), and on a GPU when
one is at hand (``-m cuda``).

Each CPU-side test stands for a kind of failure seen on the first GPU run: a device without an
index, tensors handed to a model from somewhere other than the one helper
(:func:`hf_symmetry.devices.to_model`), a float32 step inside a float64 path, SVD signs chosen by
the backend, bf16 autocast in a run told to use the CPU, a command without ``--device``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from hf_symmetry import devices
from hf_symmetry.testing import input_ids, tiny_model

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)


# ------------------------------------------------------------------------------------ devices
def _fake_cuda(monkeypatch, current: int = 1, count: int = 2) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_a_resolved_cuda_device_always_carries_its_index(monkeypatch):
    _fake_cuda(monkeypatch, current=1)
    for spec in ("auto", "cuda", "CUDA", " auto ", None, torch.device("cuda")):
        dev = devices.parse_device(spec).device
        assert dev == torch.device("cuda", 1) and dev.index == 1, spec
    assert devices.parse_device("cuda:0").device == torch.device("cuda", 0)
    with pytest.raises(devices.DeviceError, match="only 2 CUDA device"):
        devices.parse_device("cuda:2")
    assert devices.parse_device("auto").device_map == "auto" and devices.parse_device("cuda").device_map == "cuda:1"


def test_heal_hands_torch_cuda_set_device_an_indexed_device(monkeypatch, tmp_path):
    """The first GPU run's heal stopped in ``torch.cuda.set_device(torch.device("cuda"))``."""
    sys.path.insert(0, str(Path(__file__).parent))
    from heal_models import byte_tokenizer, tiny as tiny_heal

    from hf_symmetry.assets import resolve_text
    from hf_symmetry.training.heal import HealJob, HealOptions, heal_checkpoint

    tok = byte_tokenizer()
    for name, seed in (("teacher", 0), ("student", 1)):
        tiny_heal("llama", len(tok), seed=seed, tokenizer=tok).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    (tmp_path / "train.txt").write_text(resolve_text("britannica-calib").read_text(encoding="utf-8")[:8000])
    _fake_cuda(monkeypatch, current=0, count=1)
    seen = []

    class Stop(Exception):
        pass

    def set_device(dev):
        seen.append(dev)
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    options = HealOptions(tokens=8 * 32 * 2, seq_len=32, batch_size=8, lora_rank=2, validation_fraction=0.1)
    with pytest.raises(Stop):
        heal_checkpoint(
            HealJob(
                tmp_path / "student",
                tmp_path / "out",
                tmp_path / "teacher",
                [tmp_path / "train.txt"],
                options,
                progress=False,
                device="auto",
                eval_texts=None,
            )
        )
    assert seen and isinstance(seen[0], torch.device) and seen[0].index == 0


def test_every_command_that_loads_a_model_has_the_one_device_flag():
    from hf_symmetry.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {}
    for name in ("rotate", "verify", "eval", "to-tpa", "match", "merge", "spectra", "farr", "compress", "heal"):
        action = sub.choices[name]._option_string_actions.get("--device")
        assert action is not None and action.default == "auto", name
        helps[name] = action.help.split(";")[0]
    assert len(set(helps.values())) == 1, helps  # one definition, one meaning of auto


def test_eval_takes_device_and_refuses_a_missing_one_before_loading(tiny_dir, tmp_path, capsys):
    import json

    from hf_symmetry.cli import main

    text = tmp_path / "t.txt"
    text.write_text(" ".join(str(i % 97) for i in range(300)))
    outs = {}
    for dev in ("cpu", "auto"):
        assert (
            main(
                [
                    "eval",
                    str(tiny_dir),
                    "--text",
                    str(text),
                    "--max-tokens",
                    "200",
                    "--window",
                    "64",
                    "--stride",
                    "32",
                    "--device",
                    dev,
                    "--quiet",
                    "--json",
                    str(tmp_path / f"{dev}.json"),
                ]
            )
            == 0
        )
        outs[dev] = json.loads((tmp_path / f"{dev}.json").read_text())["perplexity"]
    assert outs["auto"] == pytest.approx(outs["cpu"], rel=1e-5)  # float32 on another device when CUDA is visible
    capsys.readouterr()
    assert main(["eval", str(tiny_dir), "--text", str(text), "--device", "cuda:7", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda:7" in err[0]


def test_rotate_scales_calibrate_on_the_device_flag(tiny_dir, tmp_path, monkeypatch):
    """``rotate --for-quantization``'s calibration forward passes (the heavy step of ``--scales``) ran on
    the CPU whatever ``--device`` said; they run on the resolved device, and a failure leaves no folder."""
    from hf_symmetry.cli import main
    from hf_symmetry.conversion import rotate

    class Stop(Exception):
        pass

    seen = []

    def spy(source, config, ids, progress=False, seq_len=512, placement=None):
        seen.append(placement)
        raise Stop

    monkeypatch.setattr(rotate, "layer_stats", spy)  # where rotate looks it up
    _fake_cuda(monkeypatch, current=1)
    monkeypatch.setattr(devices, "resolve_dtype", lambda dtype, device: torch.float32)  # no CUDA op to try
    out = tmp_path / "q"
    with pytest.raises(Stop):
        main(["rotate", str(tiny_dir), str(out), "--for-quantization", "--device", "cuda", "--no-verify", "--quiet"])
    assert seen[0].device == torch.device("cuda", 1) and seen[0].dtype == torch.float32
    assert not out.exists()  # nothing written half-way
    monkeypatch.undo()


def test_rotate_refuses_a_missing_device_before_any_work(tiny_dir, tmp_path, capsys):
    from hf_symmetry.cli import main

    out = tmp_path / "q"
    assert main(["rotate", str(tiny_dir), str(out), "--for-quantization", "--device", "cuda:7", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda:7" in err[0] and not out.exists()


@CUDA
def test_cuda_rotate_for_quantization_calibrates_on_the_gpu_and_stays_exact(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_symmetry.cli import main

    # widths that Q4_0's blocks of 32 fill (the default preset's scales are searched against Q4_0; the
    # 48-wide tiny_dir is refused, as GGUF would refuse it)
    src = tmp_path / "src"
    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    tiny_model("llama", dtype=torch.float32, **shape).save_pretrained(src)
    for f in tiny_dir.glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    out = tmp_path / "q"
    assert main(["rotate", str(src), str(out), "--for-quantization", "--device", "cuda", "--quiet"]) == 0
    ids = torch.arange(1, 97)[None]
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert (a - b).abs().max().item() < 1e-4


# ------------------------------------------------------------------------ what enters a model
def test_module_device_is_the_input_embedding_s_or_the_offload_hook_s():
    model = tiny_model("llama", dtype=torch.float32)
    assert devices.module_device(model) == torch.device("cpu")
    assert devices.module_device(model.model.layers[0].self_attn.o_proj) == torch.device("cpu")
    assert devices.module_device(torch.nn.ReLU()) == torch.device("cpu")  # nothing to go by

    class Hook:
        execution_device = 0

    emb = model.get_input_embeddings()
    emb.weight = torch.nn.Parameter(torch.empty_like(emb.weight, device="meta"))  # offloaded
    assert devices.module_device(model) == torch.device("cpu")
    emb._hf_hook = Hook()
    assert devices.module_device(model) == torch.device("cuda", 0)
    ids = torch.arange(4)
    assert devices.to_model(ids, torch.nn.Linear(2, 2)) is ids  # already there: no copy
    assert devices.to_model(torch.ones(2), torch.nn.Linear(2, 2).double(), torch.float64).dtype == torch.float64
    assert devices.to_model(ids, torch.nn.Linear(2, 2), torch.float64).dtype == torch.long  # ids keep theirs


class _Placed:
    """Counts, per module, the forwards it ran from outside (not inside another of ``modules``) and the
    times the helper was asked where that module's inputs go: a forward whose inputs did not come
    through :func:`devices.to_model` shows as a forward without its query."""

    def __init__(self, monkeypatch, *modules):
        self.asked: list = []
        self.ran: dict = {id(m): 0 for m in modules}
        self.active = 0
        real = devices.module_device
        monkeypatch.setattr(devices, "module_device", lambda m: (self.asked.append(id(m)), real(m))[1])
        for m in modules:
            m.register_forward_pre_hook(lambda mod, args: self._enter(mod))
            m.register_forward_hook(lambda mod, args, out: self._leave())

    def _enter(self, mod):
        if not self.active:
            self.ran[id(mod)] += 1
        self.active += 1

    def _leave(self):
        self.active -= 1

    def check(self) -> None:
        assert any(self.ran.values())
        for key, n in self.ran.items():
            assert self.asked.count(key) >= n, (n, self.asked.count(key))


def test_fisher_pass_hands_its_token_ids_through_the_helper(monkeypatch):
    """Failure 2 of the first GPU run: ``fisher_diagonal`` gave a dispatched model CPU token ids."""
    from hf_symmetry.conversion.merge.statistics import fisher_diagonal

    model = tiny_model("llama", dtype=torch.float32)
    placed = _Placed(monkeypatch, model)
    fisher_diagonal(model, [input_ids(batch=2, length=12)], progress=False)
    placed.check()


def test_perplexity_verification_and_outputs_hand_their_ids_through_the_helper(monkeypatch):
    from hf_symmetry.evaluation.compare import model_output
    from hf_symmetry.evaluation.perplexity import perplexity
    from hf_symmetry.evaluation.verification import _output

    model = tiny_model("llama", dtype=torch.float32)
    placed = _Placed(monkeypatch, model)
    ids = input_ids(batch=1, length=40).reshape(-1)
    perplexity(model, ids, window=16, stride=8, progress=False)
    _output(model, ids)
    model_output(model, ids)
    placed.check()


def test_distillation_figures_hand_their_ids_through_the_helper(monkeypatch):
    from hf_symmetry.training.distill import mean_kl

    student, teacher = tiny_model("llama", dtype=torch.float32), tiny_model("llama", dtype=torch.float32, seed=3)
    placed = _Placed(monkeypatch, student, teacher)
    assert mean_kl(student, teacher, input_ids(batch=2, length=12), batch_size=1) > 0
    placed.check()


def test_layout_checks_run_the_output_projection_through_the_helper_and_check_on_the_host(monkeypatch):
    """Failure 3: ``_add_layer`` multiplied the device's captures by the host's canonical layer."""
    from hf_symmetry.conversion.farr.fused_check import check_fused_layout

    model = tiny_model("llama", dtype=torch.float32)
    o_projs = [layer.self_attn.o_proj for layer in model.model.layers]
    placed = _Placed(monkeypatch, model, *o_projs)
    report = check_fused_layout(model, input_ids(batch=1, length=16).reshape(-1))
    assert report.passed
    placed.check()


def test_the_engine_embeds_through_the_helper(monkeypatch, tmp_path):
    from hf_symmetry.calibration import CalibrationEngine, StatsRequest, token_batches

    tiny_model("llama").save_pretrained(tmp_path)
    engine = CalibrationEngine(tmp_path, placement=devices.resolve("cpu", torch.float64), progress=False)
    placed = _Placed(monkeypatch, engine.skeleton())
    engine.collect(
        token_batches(input_ids(length=24, batch=2).reshape(-1), 12, batch_size=2), StatsRequest(grams=("attn_in",))
    )
    placed.check()


# ------------------------------------------------------------------------ float64 stays float64
def test_exact_float64_turns_tf32_and_autocast_off_and_restores_them():
    switches = devices._precision_switches()
    before = [o.fp32_precision for o in switches] if switches else None
    legacy = torch.get_float32_matmul_precision()
    try:
        if switches:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        else:
            torch.set_float32_matmul_precision("medium")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with devices.exact_float64("cpu"):
                assert not torch.is_autocast_enabled("cpu")
                if switches:
                    assert {o.fp32_precision for o in devices._precision_switches()} == {"ieee"}
                else:
                    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
                x = torch.ones(4, 4)
                assert (x @ x).dtype == torch.float32
            assert torch.is_autocast_enabled("cpu")
        if switches:
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        if switches:
            for o, v in zip(switches, before):
                o.fp32_precision = v
        else:
            torch.set_float32_matmul_precision(legacy)


def test_float64_calibration_on_a_device_computes_only_the_rotary_tables_in_float32_and_on_the_host(
    monkeypatch, tmp_path, exact_rmsnorm
):
    """Failure 4: float64 statistics on CUDA differed from the CPU's by more than 1e-9. transformers'
    RMSNorm (kept float64 here by ``exact_rmsnorm``) and rotary tables compute in float32, and float32
    cos/sin differ between the CPU and CUDA. With the placement a device, the engine computes the rotary
    tables with host tensors (the same bits on every device): any other float32 step fails this test."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_symmetry.calibration import CalibrationEngine, StatsRequest, token_batches
    from hf_symmetry.calibration.engine import CalibrationEngine as Engine

    tiny_model("qwen2").save_pretrained(tmp_path)
    batches = token_batches(input_ids(length=24, batch=2).reshape(-1), 12, batch_size=2)
    request = StatsRequest(grams=("attn_in", "down_in", "o_in"), sums=("o_in",))
    F64 = devices.resolve("cpu", torch.float64)
    reference = CalibrationEngine(tmp_path, placement=F64, progress=False).collect(batches, request)

    stack: list[str] = []
    float32_ops: list[tuple[str, tuple]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if stack and any(isinstance(o, torch.Tensor) and o.dtype == torch.float32 for o in outs):  # in a forward
                float32_ops.append((str(func), tuple(stack)))
            return out

    pre = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: stack.append(type(m).__name__ + ("@host" if "forward" in m.__dict__ else ""))
    )
    post = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
    monkeypatch.setattr(Engine, "exact", property(lambda self: True))  # as with a CUDA placement
    try:
        with Record():
            got = CalibrationEngine(tmp_path, placement=F64, progress=False).collect(batches, request)
    finally:
        pre.remove()
        post.remove()
    assert float32_ops  # the rotary tables
    for op, where in float32_ops:
        assert where and where[-1].endswith("RotaryEmbedding@host"), (op, where)
    for a, b in zip(reference.layers, got.layers):  # the same bits
        for site in request.grams:
            assert torch.equal(a.grams[site], b.grams[site])


def test_svd_factors_have_one_sign_whatever_the_backend_picks():
    """FaRR's factors on the GPU must be the CPU's tensors, not the same product with flipped pairs."""
    from hf_symmetry.solvers import fused

    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(5, 9, generator=g, dtype=torch.float64)
    svd = fused.fused_svd(fused.FusedPair(A, B, 3))
    assert torch.allclose(svd.U @ torch.diag(svd.S) @ svd.Vh, A @ B, atol=1e-12)
    flips = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    U, Vh = fused.canonical_signs(svd.U * flips, svd.Vh * flips[:, None])  # what another backend may return
    assert torch.equal(U, svd.U) and torch.equal(Vh, svd.Vh)
    assert (svd.U.gather(0, svd.U.abs().argmax(0)[None]) > 0).all()


# ------------------------------------------------------------------------ training precision
def test_a_run_told_to_use_the_cpu_trains_in_float32_even_beside_a_gpu(monkeypatch, tmp_path):
    """Failure 6: with CUDA visible, ``heal --device cpu`` trained under bf16 autocast on the CPU (its
    two-process run then drifted from the one-process run by more than 2e-6)."""
    from hf_symmetry.training import trainer as run_module
    from hf_symmetry.training.trainer import TrainSettings, training_arguments

    monkeypatch.setattr(run_module, "bf16_available", lambda: True)
    args = training_arguments(TrainSettings(output_dir=str(tmp_path), max_steps=1, use_cpu=True), has_eval=False)
    assert args.bf16 is False and args.use_cpu


# ------------------------------------------------------------------------ on a GPU (-m cuda)
@pytest.mark.cuda
@CUDA
def test_cuda_fisher_and_layerwise_layout_check_run_on_the_gpu(tmp_path):
    from hf_symmetry.conversion.merge.statistics import fisher_diagonal
    from hf_symmetry.conversion.farr.fused_check import check_fused_layout_layerwise

    dev = devices.parse_device("auto").device
    assert dev.type == "cuda" and dev.index is not None
    model = tiny_model("llama", dtype=torch.float32)
    batches = [input_ids(batch=2, length=12)]
    cpu = fisher_diagonal(model, batches, progress=False)
    gpu = fisher_diagonal(model.to(dev), batches, progress=False)
    for k in cpu:
        assert gpu[k].device.type == "cpu" and torch.allclose(gpu[k], cpu[k], rtol=1e-3, atol=1e-8), k
    model.cpu().save_pretrained(tmp_path)
    ids = input_ids(batch=1, length=16).reshape(-1)
    on_gpu = check_fused_layout_layerwise(tmp_path, ids, placement=devices.resolve(dev, "float32"))
    assert on_gpu.passed and len(on_gpu.per_layer) == model.config.num_hidden_layers


@pytest.mark.cuda
@CUDA
def test_cuda_eval_and_verification_place_their_inputs_on_the_model(tiny_dir, tmp_path):
    from hf_symmetry.cli import main

    text = tmp_path / "t.txt"
    text.write_text(" ".join(str(i % 97) for i in range(300)))
    for dev in ("auto", "cuda", "cpu"):
        assert (
            main(
                [
                    "eval",
                    str(tiny_dir),
                    "--text",
                    str(text),
                    "--max-tokens",
                    "200",
                    "--window",
                    "64",
                    "--stride",
                    "32",
                    "--device",
                    dev,
                    "--quiet",
                ]
            )
            == 0
        )


# ------------------------------------------------------------------------ the solver's host synchronisations
def _descent_one_sync_per_scalar(value_and_grad, X0, lipschitz, iters, tol):
    """segments._descent as it was before its step scalars were fetched together (the reference)."""
    from hf_symmetry.solvers.segments import _retract

    def riemannian(X, G):
        A = X.T @ G
        return X @ ((A - A.T) / 2)

    X = X0.clone()
    f, G = value_and_grad(X)
    xi = riemannian(X, G)
    tau = 1.0 / max(float(lipschitz), 1e-300)
    g0 = float((xi * xi).sum())
    ref, weight = f, 1.0
    best_f, best_X = f, X
    values = [f]
    for it in range(iters):
        g2 = float((xi * xi).sum())
        if g2 <= tol**2 * max(g0, 1e-300):
            break
        t = tau
        for _ in range(50):
            Xn = _retract(X - t * xi)
            fn, Gn = value_and_grad(Xn)
            if fn <= ref - 1e-4 * t * g2:
                break
            t *= 0.5
        else:
            break
        xin = riemannian(Xn, Gn)
        s, y = Xn - X, xin - xi
        sy = float((s * y).sum())
        tau = (
            (float((s * s).sum()) / sy if it % 2 == 0 else sy / max(float((y * y).sum()), 1e-300)) if sy > 0 else 2 * t
        )
        weight_next = 0.85 * weight + 1.0
        ref = (0.85 * weight * ref + fn) / weight_next
        weight = weight_next
        X, f, xi = Xn, fn, xin
        if f < best_f:
            best_f, best_X = f, X
        values.append(best_f)
    return best_X, values


@pytest.mark.parametrize("n_pairs", [1, 2])
def test_weighted_procrustes_fetching_its_step_scalars_together_gives_the_same_bits(monkeypatch, n_pairs):
    from hf_symmetry.solvers import segments

    g = torch.Generator().manual_seed(n_pairs)
    d = 24
    K = torch.randn(d, d, generator=g, dtype=torch.float64)
    pairs = []
    for _ in range(n_pairs):
        A, B = torch.randn(d, d, generator=g, dtype=torch.float64), torch.randn(d, d, generator=g, dtype=torch.float64)
        pairs.append((A @ A.T / d, B @ B.T / d))
    Q0 = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    new = segments.weighted_procrustes(K, pairs, Q0, iters=60, tol=1e-12)
    monkeypatch.setattr(segments, "_descent", _descent_one_sync_per_scalar)
    old = segments.weighted_procrustes(K, pairs, Q0, iters=60, tol=1e-12)
    assert torch.equal(new[0], old[0]) and new[1] == old[1] and len(new[1]) > 10


@pytest.mark.cuda
@CUDA
def test_cuda_heal_runs_with_the_default_device(tmp_path):
    """Failure 1: ``heal`` with the default ``--device auto`` stopped in ``torch.cuda.set_device``."""
    sys.path.insert(0, str(Path(__file__).parent))
    from heal_models import byte_tokenizer, tiny as tiny_heal

    from hf_symmetry.assets import resolve_text
    from hf_symmetry.cli import main

    tok = byte_tokenizer()
    for name, seed in (("teacher", 0), ("student", 1)):
        tiny_heal("llama", len(tok), seed=seed, tokenizer=tok).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    (tmp_path / "train.txt").write_text(resolve_text("britannica-calib").read_text(encoding="utf-8")[:8000])
    assert (
        main(
            [
                "heal",
                str(tmp_path / "student"),
                str(tmp_path / "out"),
                "--teacher",
                str(tmp_path / "teacher"),
                "--text",
                str(tmp_path / "train.txt"),
                "--tokens",
                str(8 * 32 * 2),
                "--seq-len",
                "32",
                "--batch-size",
                "8",
                "--lora-rank",
                "2",
                "--no-verify",
                "--quiet",
            ]
        )
        == 0
    )
    import json

    report = json.loads((tmp_path / "out" / "heal_report.json").read_text())
    assert report["device"].startswith("cuda:")
