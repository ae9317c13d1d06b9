"""``compress --structure slice``: SliceGPT's defaults and card, and sequential SliceGPT (each
segment's PCA on the stream of the model whose earlier segments are already sliced, as the reference
SliceGPT code calibrates)."""

from __future__ import annotations

import pytest
import torch

import hf_symmetry  # noqa: F401  (registers the family)
from hf_symmetry.calibration import token_batches
from hf_symmetry.conversion import compress as C
from hf_symmetry.testing import SEQ40, full_width, input_ids, outputs, tiny_model


def _source(model):
    return C.DictSource({k: v.detach() for k, v in model.state_dict().items()})


def _rel(a, b):
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def _float64():
    from hf_symmetry.devices import resolve

    return resolve("cpu", "float64")


def test_slice_defaults_to_one_global_pca_and_its_card_lists_only_its_settings():
    options = C.CompressOptions(structure="slice")
    assert options.q_mode == "global" and options.label == "SliceGPT (global PCA)"
    assert C.CompressOptions(structure="kron").q_mode == "segment"
    settings = options.applicable(C.CALIBRATION)
    for absent in (
        "stage",
        "f_iters",
        "w_iters",
        "als_iters",
        "wopp_iters",
        "kron_factor",
        "gs_blocks",
        "match_original",
    ):
        assert absent not in settings, absent
    assert {"structure", "ratio", "q_mode", "calib_tokens"} <= set(settings)
    # SliceGPT is a method, not a structure: no structure class, named "slice" where users read it
    assert options == C.CompressOptions(method="slicegpt") and options.method == "slicegpt" and options.slicing
    assert options.structure is None and options.structure_class is None and options.structure_name == "slice"
    assert settings["structure"] == "slice" == options.as_dict(C.CALIBRATION)["structure"]
    assert "method" not in options.as_dict(C.CALIBRATION)  # the reports' options keep their keys
    kron = C.CompressOptions(structure="kron")  # negative control
    assert kron.method == "procrustesgpt" and not kron.slicing and kron.structure_name == kron.structure == "kron"
    gs = C.CompressOptions(structure="gs", stage="w").applicable(C.CALIBRATION)
    assert {"stage", "f_iters", "w_iters", "gs_blocks"} <= set(gs) and "kron_factor" not in gs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sequential_slicing_with_nothing_sliced_measures_the_one_pass_statistics(family):
    """At full width the sliced layers project onto everything: the engine's sequential walk (the
    family's own decoder layers, RoPE, GQA, biases, ragged batches 40+40+30) measures one pass."""
    model = tiny_model(family)
    config, src = model.config.to_dict(), _source(model)
    calib = input_ids(batch=1, length=110, seed=3)[0]
    ref = C.collect_statistics(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), calibration=SEQ40, progress=False),
        want_normed=False,
        want_stream=True,
    )
    Qs, seq = C.sequential_stream_pca(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), progress=False, calibration=SEQ40),
        config["hidden_size"],
    )
    assert len(Qs) == len(seq.stream) == 2 * config["num_hidden_layers"] + 1 and seq.tokens == ref.tokens
    for a, b in zip(seq.stream, ref.stream):
        assert _rel(a, b) < 1e-10


def test_sequential_slicing_measures_the_sliced_model_and_differs_from_one_pass(exact_rmsnorm):
    """Each segment's statistics are those of the assembled sliced model's own stream (hooked), and
    after the first segment no longer those of the original model."""
    model = tiny_model("llama")
    config, src = model.config.to_dict(), _source(model)
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", q_mode="segment", sequential=True, ratio=0.25, ratio_slack=1.0)
    state, cfg, report = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            calib_ids=calib,
            hf_config=model.config,
            dtype=torch.float64,
            progress=False,
            placement=_float64(),
            calibration=SEQ40,
        )
    )
    sliced = C.build_model(state, cfg, torch.float64)[0]
    dr = cfg["residual_size"]
    Qs, seq = C.sequential_stream_pca(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), progress=False, calibration=SEQ40), dr
    )
    acc = {}

    def hook(k):
        def fn(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            acc[k] = acc.get(k, 0) + x.T @ x

        return fn

    handles = []
    for i, layer in enumerate(sliced.model.layers):
        handles.append(layer.input_layernorm.register_forward_pre_hook(hook(2 * i)))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(hook(2 * i + 1)))
    handles.append(sliced.model.norm.register_forward_pre_hook(hook(2 * len(sliced.model.layers))))
    with torch.no_grad():
        for batch in token_batches(calib, 40):
            sliced(input_ids=batch)
    for h in handles:
        h.remove()
    one_pass = C.collect_statistics(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), calibration=SEQ40),
        want_normed=False,
        want_stream=True,
    )
    for k in range(len(Qs)):
        Qk = Qs[k][:, :dr]
        measured = acc[k] / calib.numel()
        # the compressed model's stream (basis Q_k, sliced) is the projection of what the PCA was taken of
        assert _rel(Qk.T @ seq.stream[k] @ Qk, measured) < 1e-9, k
        if k > 0:
            assert _rel(seq.stream[k], one_pass.stream[k]) > 1e-3, k  # not the original's


def test_full_width_sequential_slicegpt_is_exact(exact_rmsnorm):
    model = tiny_model("llama")
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", q_mode="segment", sequential=True, ratio_slack=1.0)
    src = _source(model)
    plan = C.plan_for(src, config, options)[0]
    full_width(plan)
    state, cfg, report = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            calib_ids=calib,
            hf_config=model.config,
            plan=plan,
            dtype=torch.float64,
            progress=False,
            placement=_float64(),
            calibration=SEQ40,
        )
    )
    assert report.method == "SliceGPT (PCA per segment, sequential)"
    compressed = C.build_model(state, cfg, torch.float64)[0]
    ids = input_ids()
    assert (outputs(compressed, ids) - outputs(model, ids)).abs().max().item() <= 1e-9


def test_sequential_slicing_needs_one_pca_per_segment():
    with pytest.raises(ValueError, match="sequential calibration applies"):
        C.CompressOptions(structure="slice", q_mode="global", sequential=True).validate()
    C.CompressOptions(structure="slice", q_mode="segment", sequential=True).validate()


def test_cli_sequential_slicegpt_card_and_device_refusal(tiny_dir, tmp_path, capsys):
    import json

    from huggingface_hub import ModelCard

    from hf_symmetry.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    out = tmp_path / "slice"
    args = [
        "compress",
        str(tiny_dir),
        str(out),
        "--structure",
        "slice",
        "--q-mode",
        "segment",
        "--sequential",
        "--calib",
        str(calib),
        "--calib-seq-len",
        "64",
        "--quiet",
    ]
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CUDA" in err[0] and not out.exists()
    assert main([*args, "--device", "cpu"]) == 0
    assert "SliceGPT (PCA per segment, sequential)" in capsys.readouterr().out
    report = json.loads((out / "compression_report.json").read_text())
    assert report["method"] == "SliceGPT (PCA per segment, sequential)" and report["options"]["sequential"]
    params = ModelCard.load(out / "README.md").data.hf_symmetry["parameters"]
    assert params["sequential"] is True and not {"stage", "f_iters", "kron_factor", "w_iters"} & set(params)
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == "0o644"


# ----------------------------------------------------------------------------- per-segment widths
def _widths_model(model, widths, placement=None):
    """SliceGPT (one global PCA) with the given per-segment widths, float64."""
    config, src = model.config.to_dict(), _source(model)
    d = config["hidden_size"]
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", ratio_slack=1.0)
    plan = C.plan_for(src, config, options, keep={f"segment{k}": w / d for k, w in enumerate(widths)})[0]
    state, cfg, report = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            calib_ids=calib,
            hf_config=model.config,
            plan=plan,
            dtype=torch.float64,
            progress=False,
            placement=_float64(),
            calibration=SEQ40,
        )
    )
    compressed, counted = C.build_model(state, cfg, torch.float64)
    stats = C.collect_statistics(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), calibration=SEQ40, progress=False),
        want_normed=False,
        want_stream=True,
    )
    from hf_symmetry.conversion.compress.pca import pca_rotations

    Q = pca_rotations(stats, len(widths), "global")[0]
    return compressed, cfg, report, counted, Q


def _projected_original(model, Q, widths):
    """The original model with the residual stream of segment k projected onto the first ``widths[k]``
    principal directions (original basis), and the tied head's embedding matrix onto those of segment 0:
    what SliceGPT with per-segment widths must compute."""
    P = [Q[:, :w] @ Q[:, :w].T for w in widths]
    saved, handles = {}, []
    for i, layer in enumerate(model.model.layers):

        def pre(_m, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            x = x @ P[2 * i]
            saved["x"] = x
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        def attn(_m, _args, out, i=i):
            a, *rest = out
            x = saved["x"]
            return ((x + a) @ P[2 * i + 1] - x, *rest)

        def mid(_m, args):
            saved["h"] = args[0]

        def mlp(_m, _args, m, i=i):
            h = saved["h"]
            return (h + m) @ P[2 * i + 2] - h

        handles += [
            layer.register_forward_pre_hook(pre, with_kwargs=True),
            layer.self_attn.register_forward_hook(attn),
            layer.post_attention_layernorm.register_forward_pre_hook(mid),
            layer.mlp.register_forward_hook(mlp),
        ]
    # the tied head reads the embedding matrix as sliced to the first segment's width
    handles.append(model.lm_head.register_forward_pre_hook(lambda _m, args: (args[0] @ P[0],)))
    return handles


def test_per_segment_widths_at_full_width_are_exact(exact_rmsnorm):
    """The per-segment-widths path (config ``residual_sizes``) with every width the hidden size."""
    model = tiny_model("llama")
    d, L = model.config.hidden_size, model.config.num_hidden_layers
    config, src = model.config.to_dict(), _source(model)
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", ratio_slack=1.0)
    plan = C.plan_for(src, config, options, keep={f"segment{k}": 1.0 for k in range(2 * L + 1)})[0]
    plan.residual_sizes = [d] * (2 * L + 1)  # force the per-segment path
    state, cfg, _ = C.compress_tensors(
        C.CompressRun(
            src,
            config,
            options,
            calib_ids=calib,
            hf_config=model.config,
            plan=plan,
            dtype=torch.float64,
            progress=False,
            placement=_float64(),
            calibration=SEQ40,
        )
    )
    assert cfg["residual_sizes"] == [d] * (2 * L + 1)
    compressed = C.build_model(state, cfg, torch.float64)[0]
    ids = input_ids()
    assert (outputs(compressed, ids) - outputs(model, ids)).abs().max().item() <= 1e-9


def test_per_segment_widths_slice_and_pad_the_stream_as_one_basis_demands(exact_rmsnorm):
    """Widths that shrink and grow again ([40, 30, 44, 20, 36] on a 48-wide, 2-layer model): the
    compressed model equals the original with each segment's stream projected onto its first w_k
    principal directions (1e-9, float64); negative control: the same projections with one width
    changed differ. Parameters are those the plan counted."""
    model = tiny_model("llama")
    d, L = model.config.hidden_size, model.config.num_hidden_layers
    widths = [40, 30, 44, 20, 36][: 2 * L + 1]
    assert len(widths) == 2 * L + 1 and d == 48
    compressed, cfg, report, counted, Q = _widths_model(model, widths)
    assert cfg["residual_sizes"] == widths and cfg["residual_size"] == max(widths)
    assert counted == report.accounting.compressed_model_params
    assert report.accounting.residual_sizes == widths
    ids = input_ids()
    got = outputs(compressed, ids)
    handles = _projected_original(model, Q, widths)
    try:
        ref = outputs(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert (got - ref).abs().max().item() <= 1e-9
    wrong = list(widths)
    wrong[2] = widths[2] - 4  # one segment narrower: no longer the model
    handles = _projected_original(model, Q, wrong)
    try:
        other = outputs(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert (got - other).abs().max().item() > 1e-3
    assert (got - outputs(model, ids)).abs().max().item() > 1e-3  # and slicing did something


def test_uniform_configs_keep_loading_and_bad_widths_are_refused():
    from hf_symmetry.modeling.configuration_compressed_llama import CompressedLlamaConfig

    base = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    uniform = CompressedLlamaConfig(**base, residual_size=12)
    assert uniform.residual_sizes is None and [uniform.segment_width(k) for k in range(5)] == [12] * 5
    assert "residual_sizes" not in uniform.to_diff_dict() or uniform.to_diff_dict()["residual_sizes"] is None
    varied = CompressedLlamaConfig(**base, residual_sizes=[8, 12, 16, 4, 8], lm_head="tied_mixed")
    assert varied.residual_size == 16 and varied.segment_width(3) == 4
    for bad, match in (
        ({"residual_sizes": [8, 12, 16, 4]}, "must be 5 widths"),
        ({"residual_sizes": [8, 12, 17, 4, 8]}, "hidden_size=16"),
        ({"residual_sizes": [8, 12, 16, 4, 8], "residual_size": 12}, "largest"),
        ({"residual_sizes": [8, 12, 16, 4, 8], "skip_connections": "dense"}, "skip_connections"),
        ({"residual_sizes": [8, 12, 16, 4, 12], "lm_head": "tied"}, "tied head"),
    ):
        with pytest.raises(ValueError, match=match):
            CompressedLlamaConfig(**base, **{"lm_head": "tied_mixed", **bad})


def test_one_global_pca_keeps_one_running_sum_of_the_segment_moments():
    """One global PCA needs only Σ_k C_k / tr C_k over the residual segments: the one-pass statistics keep
    that running sum (one ``d × d`` matrix whatever the depth) instead of every segment's moment. It is
    the same sum, added in the same order, so the rotation is bit for bit the one of the per-segment
    moments. Negative control: the unnormalised sum gives another basis."""
    from hf_symmetry.conversion.compress.pca import pca, pca_rotations

    assert C.CompressOptions(structure="slice").stream_sum
    assert not C.CompressOptions(structure="slice", allocation="sensitivity").stream_sum  # needs segments 0, 2L
    assert not C.CompressOptions(structure="slice", q_mode="segment").stream_sum
    model = tiny_model("llama")
    config, src = model.config.to_dict(), _source(model)
    calib = input_ids(batch=1, length=120, seed=3)[0]
    each = C.collect_statistics(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), calibration=SEQ40, progress=False),
        want_normed=False,
        want_stream=True,
    )
    summed = C.collect_statistics(
        C.CompressRun(src, config, calib_ids=calib, placement=_float64(), calibration=SEQ40, progress=False),
        want_normed=False,
        want_stream=True,
        stream_sum=True,
    )
    n_seg = 2 * config["num_hidden_layers"] + 1
    assert summed.stream is None and len(each.stream) == n_seg and summed.tokens == each.tokens
    assert torch.equal(summed.stream_sum, sum(C_ / C_.trace().clamp_min(1e-300) for C_ in each.stream))
    Q = pca_rotations(summed, n_seg, "global")[0]
    assert torch.equal(Q, pca_rotations(each, n_seg, "global")[0])
    w = config["hidden_size"] * 3 // 4
    kept = lambda B: B[:, :w] @ B[:, :w].T  # noqa: E731  (the kept subspace: signs of eigenvectors do not matter)
    assert _rel(kept(pca(sum(each.stream))), kept(Q)) > 1e-3
