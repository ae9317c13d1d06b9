"""The layer-wise calibration engine: its statistics equal hooks on the whole HF model (every
family, float64, 1e-10), sequential mode, the migrated collectors, and the same statistics and
conversions as the whole-model collectors they replaced on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from hf_symmetry.calibration import CalibrationEngine, CalibrationText, StatsRequest, token_batches
from hf_symmetry.calibration.statistics import rms_normalised
from hf_symmetry.conversion.stream import DictSource
from hf_symmetry.devices import resolve
from hf_symmetry.testing import TINY_FAMILIES, input_ids, tiny_model

F64 = resolve("cpu", torch.float64)
IN_SITES = ("attn_in", "v_in", "o_in", "ffn_norm_in", "ffn_in", "down_in")
NEW_FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "gpt_neox")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> bool:
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _saved(family: str, folder):
    """A tiny float64 model of ``family`` saved to ``folder``, and that folder loaded whole by transformers."""
    from transformers import AutoModel, AutoModelForCausalLM

    tiny_model(family).save_pretrained(folder)
    cls = AutoModel if family in ("bert", "roberta") else AutoModelForCausalLM
    return cls.from_pretrained(folder, dtype=torch.float64).eval()


def _hooked(model, adapter, batches, sites=IN_SITES):
    """Reference: the same sums by forward hooks on the whole model (the old collectors' way)."""
    ref: dict = {}
    modules = adapter.site_modules()

    def add(key, x):
        x = x.reshape(-1, x.shape[-1]).double()
        ref[key] = ref.get(key, 0) + x.T @ x
        ref[key + ("sum",)] = ref.get(key + ("sum",), 0) + x.sum(0)

    def pre(key):
        return lambda _m, args: add(key, args[0])

    def post(key):
        return lambda _m, _a, out: add(key, out[0] if isinstance(out, tuple) else out)

    handles = []
    for i in range(adapter.n_layers):
        layer = model.get_submodule(adapter.layer_prefix(i).rstrip("."))
        handles.append(layer.register_forward_pre_hook(pre((i, "layer_in"))))
        handles.append(layer.register_forward_hook(post((i, "layer_out"))))
        handles.append(
            layer.register_forward_pre_hook(
                lambda _m, args, i=i: add((i, "normed:layer_in"), rms_normalised(args[0], adapter.eps))
            )
        )
        for site in sites:
            if site in modules:
                path, where = modules[site]
                m = layer.get_submodule(path)
                handles.append(
                    m.register_forward_pre_hook(pre((i, site)))
                    if where == "in"
                    else m.register_forward_hook(post((i, site)))
                )
    try:
        with torch.no_grad():
            for b in batches:
                model(input_ids=b)
    finally:
        for h in handles:
            h.remove()
    return ref


@pytest.mark.parametrize("family", TINY_FAMILIES + NEW_FAMILIES)
def test_engine_statistics_equal_hooks_on_the_whole_model(family, tmp_path):
    model = _saved(family, tmp_path)
    batches = token_batches(input_ids(length=40, batch=2).reshape(-1), 24, batch_size=2)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    sites = tuple(s for s in IN_SITES + ("q_out", "k_out", "v_out") if s in engine.adapter.site_modules())
    request = StatsRequest(grams=sites + ("layer_in", "layer_out", "normed:layer_in"), sums=sites + ("layer_in",))
    result = engine.collect(batches, request)
    ref = _hooked(model, engine.adapter, batches, sites)
    for i, stats in enumerate(result.layers):
        assert stats.tokens == 80
        for site in request.grams:
            assert _close(stats.grams[site], ref[(i, site)]), (family, i, site)
        for site in request.sums:
            assert _close(stats.sums[site], ref[(i, site, "sum")]), (family, i, site)
    # negative control: layer 1's statistics are not layer 0's
    assert not _close(result.layers[1].grams["attn_in"], ref[(0, "attn_in")], 1e-3)


def test_final_statistics_are_what_the_lm_head_reads(tmp_path):
    model = _saved("qwen2", tmp_path)
    batches = token_batches(input_ids(length=40, batch=2).reshape(-1), 20, batch_size=3)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    got = engine.collect(batches, StatsRequest(), final=StatsRequest(grams=("head_in", "final_in"))).final
    ref = {}
    hooks = [
        model.lm_head.register_forward_pre_hook(
            lambda _m, a: ref.__setitem__("head", ref.get("head", 0) + (a[0].reshape(-1, 48).T @ a[0].reshape(-1, 48)))
        ),
        model.model.norm.register_forward_pre_hook(
            lambda _m, a: ref.__setitem__(
                "final", ref.get("final", 0) + (a[0].reshape(-1, 48).T @ a[0].reshape(-1, 48))
            )
        ),
    ]
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in hooks:
        h.remove()
    assert got.tokens == 80
    assert _close(got.grams["head_in"], ref["head"]) and _close(got.grams["final_in"], ref["final"])


def test_sequential_with_nothing_converted_equals_one_pass(tmp_path):
    _saved("llama", tmp_path)
    batches = token_batches(input_ids(length=48, batch=2).reshape(-1), 32)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    request = StatsRequest(grams=("attn_in", "normed:ffn_norm_in"), sums=("down_in",))
    one_pass = engine.collect(batches, request)
    seen = []
    sequential = engine.collect(
        batches,
        request | StatsRequest(cross=(("attn_in", "attn_in"),)),
        on_layer=lambda step: seen.append(step.index) or step.module,
        carry_original=True,
    )
    assert seen == [0, 1]
    for a, b in zip(one_pass.layers, sequential.layers):
        assert a.tokens == b.tokens == 96
        for site in request.grams:
            assert _close(a.grams[site], b.grams[site], 1e-12)
        assert _close(a.sums["down_in"], b.sums["down_in"], 1e-12)
        # nothing converted: the cross moment against the original is the second moment itself
        assert _close(b.cross[("attn_in", "attn_in")], a.grams["attn_in"], 1e-12)


def test_sequential_statistics_come_from_the_converted_model(tmp_path):
    """Layer 1's statistics after replacing layer 0 equal hooks on a whole model whose layer 0 is
    the replacement; the cross moment pairs them with the original stream."""
    import copy

    model = _saved("llama", tmp_path)
    batches = token_batches(input_ids(length=48, batch=2).reshape(-1), 24, batch_size=2)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)

    def convert(step):
        new = copy.deepcopy(step.module)
        with torch.no_grad():
            new.mlp.down_proj.weight.mul_(0.5)
        return new if step.index == 0 else None

    result = engine.collect(
        batches,
        StatsRequest(grams=("attn_in",), cross=(("attn_in", "attn_in"),)),
        on_layer=convert,
        carry_original=True,
    )
    original = _hooked(model, engine.adapter, batches, ("attn_in",))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    converted = _hooked(model, engine.adapter, batches, ("attn_in",))
    assert _close(result.layers[0].grams["attn_in"], original[(0, "attn_in")])  # layer 0 sees the original
    assert _close(result.layers[1].grams["attn_in"], converted[(1, "attn_in")])  # layer 1 the converted
    assert not _close(converted[(1, "attn_in")], original[(1, "attn_in")], 1e-3)  # negative control
    cross = result.layers[1].cross[("attn_in", "attn_in")]
    assert not _close(cross, original[(1, "attn_in")], 1e-3) and not _close(cross, converted[(1, "attn_in")], 1e-3)


def test_step_collect_measures_a_partly_converted_layer(tmp_path):
    model = _saved("llama", tmp_path)
    batches = token_batches(input_ids(length=24, batch=2).reshape(-1), 24)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    run = engine.start(batches)
    step = next(run.layers(StatsRequest(grams=("down_in",))))
    with torch.no_grad():
        step.module.mlp.up_proj.weight.mul_(2.0)  # a partial conversion of this very layer
    again = step.collect(StatsRequest(grams=("down_in",)))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    ref = _hooked(model, engine.adapter, batches, ("down_in",))
    assert _close(again.grams["down_in"], ref[(0, "down_in")])
    assert not _close(step.stats.grams["down_in"], ref[(0, "down_in")], 1e-3)


def test_released_step_collects_cross_statistics_from_the_kept_original_sites(tmp_path):
    """``keep_original``: once the original layer is released, cross statistics against the original
    stream come from the activations kept in the first pass — the same sums as running the original
    layer again (on a stream that has drifted: layer 0 is replaced). Sites not kept, or no sites kept,
    are refused rather than taken from the converted layer."""
    import copy

    _saved("llama", tmp_path)
    batches = token_batches(input_ids(length=48, batch=2).reshape(-1), 24, batch_size=2)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    request = StatsRequest(
        grams=("down_in",),
        cross=(("down_in", "layer_out"), ("o_in", "ffn_norm_in"), ("normed:ffn_norm_in", "normed:ffn_norm_in")),
        joint=(("down_in", "ffn_norm_in"),),
        drift=(("down_in", "layer_out", "ffn_norm_in"),),
    )
    for keep in (("ffn_norm_in",), ()):
        run = engine.start(batches, carry_original=True)
        for step in run.layers(StatsRequest(), keep_original=keep):
            partial = copy.deepcopy(step.module)
            with torch.no_grad():
                partial.mlp.up_proj.weight.mul_(0.5)
            live = step.collect(request, module=partial)
            step.release()
            if not keep:
                with pytest.raises(RuntimeError, match="released"):
                    step.collect(request, module=partial)
                break
            kept = step.collect(request, module=partial)
            for key in request.cross:
                assert torch.equal(kept.cross[key], live.cross[key]), key
            # drift: Σ x̂_aᵀ(x_b − x̂_c) in one sum, the cross moment less the joint one
            drift = kept.drift[("down_in", "layer_out", "ffn_norm_in")]
            assert torch.equal(drift, live.drift[("down_in", "layer_out", "ffn_norm_in")])
            assert _close(drift, kept.cross[("down_in", "layer_out")] - kept.joint[("down_in", "ffn_norm_in")], 1e-12)
            assert not _close(drift, kept.cross[("down_in", "layer_out")], 1e-3)
            with pytest.raises(RuntimeError, match="down_in"):
                step.collect(StatsRequest(cross=(("o_in", "down_in"),)), module=partial)
            # the original stream's input went with the released layer (it was not kept)
            assert run.original.batches == []
            with pytest.raises(RuntimeError, match="layer_in"):
                step.collect(StatsRequest(cross=(("normed:layer_in", "normed:layer_in"),)), module=partial)
            if step.index == 0:
                step.replace(partial)  # layer 1 then runs on a drifted stream


def test_replaced_run_skips_the_original_layer_on_the_converted_stream(tmp_path):
    """``replaced=True``: the caller replaces every layer, so the original layer's outputs on the
    converted stream are not computed — the statistics and the stream handed on are those of the plain
    run — and a layer left unreplaced is an error, not a silent hand-on of nothing."""
    import copy

    _saved("llama", tmp_path)
    batches = token_batches(input_ids(length=48, batch=2).reshape(-1), 24, batch_size=2)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    first = StatsRequest(grams=("normed:layer_in",))
    streams, grams = [], []
    for replaced in (False, True):
        run = engine.start(batches, carry_original=True)
        for step in run.layers(first, only={0}, replaced=replaced):
            if step.index == 0:
                grams.append(step.stats.grams["normed:layer_in"])
            new = copy.deepcopy(step.module)
            with torch.no_grad():
                new.mlp.down_proj.weight.mul_(0.5)
            step.replace(new)
        streams.append(run.stream.batches)
    assert torch.equal(grams[0], grams[1])
    assert all(torch.equal(a, b) for a, b in zip(*streams))
    run = engine.start(batches)
    with pytest.raises(RuntimeError, match="not replaced"):
        for _ in run.layers(StatsRequest(), replaced=True):
            pass


def test_engine_reads_one_layer_at_a_time(tmp_path):
    """The engine never asks its source for more than one layer's tensor (or the input embeddings)
    at once, and reads each layer's tensors exactly once."""
    model = tiny_model("llama")
    sd = model.state_dict()
    asked = []

    class Spy(DictSource):
        def get(self, names):
            asked.append(list(names))
            return super().get(names)

    engine = CalibrationEngine(Spy(sd), model.config.to_dict(), placement=F64, progress=False)
    engine.collect(token_batches(input_ids(length=24).reshape(-1), 24), StatsRequest(grams=("attn_in",)))
    read = []
    for names in asked:
        layers = {n.split(".")[2] for n in names if n.startswith("model.layers.")}
        assert len(layers) <= 1
        if layers:  # one tensor at a time: the stored copy lives only until it is cast
            assert len(names) == 1
            read += names
    assert sorted(read) == sorted(k for k in sd if k.startswith("model.layers."))  # each layer's, once
    assert ["model.embed_tokens.weight"] in asked
    assert not any("lm_head.weight" in names for names in asked)


def test_migrated_collectors_equal_hooks(tmp_path):
    """to-tpa's, FaRR's and RegMean's statistics, now from the engine, equal the whole-model hooks."""
    from hf_symmetry.conversion.merge.statistics import gram_matrices
    from hf_symmetry.conversion.farr import attention_input_moments
    from hf_symmetry.conversion.to_tpa import attention_input_grams

    model = _saved("llama", tmp_path)
    ids = input_ids(length=50, batch=1).reshape(-1)
    engine = CalibrationEngine(tmp_path, placement=F64, progress=False)
    ref = _hooked(model, engine.adapter, token_batches(ids, 20))
    tpa = attention_input_grams(tmp_path, ids, window=20, progress=False, placement=F64)
    moments = attention_input_moments(tmp_path, ids, window=20, placement=F64)
    grams = gram_matrices(tmp_path, None, token_batches(ids, 20), progress=False)
    for i in range(2):
        G, s = ref[(i, "attn_in")], ref[(i, "attn_in", "sum")]
        assert _close(tpa[i][:48, :48], G) and _close(tpa[i][:48, 48], s) and tpa[i][48, 48] == 50
        assert _close(moments[i][0], G / 50) and _close(moments[i][1], s / 50)
        for key in ("attn_in", "o_in", "ffn_in", "down_in"):
            assert _close(grams[f"layers.{i}.{key}"], ref[(i, key)])
    assert grams["head_in"].shape == (48, 48)


@pytest.mark.parametrize("family,qk", [("llama", False), ("smollm3", True)])
def test_farr_streams_its_calibrated_metric_one_layer_at_a_time(tmp_path, family, qk):
    """Calibrated FaRR's first pass runs inside the engine (metric and spectra per layer, the metrics
    kept in files for the second pass): the same tensors and ranks as FaRR on the whole set of
    input moments, and the files are gone afterwards."""
    from hf_symmetry.checkpoint_io import CheckpointReader
    from hf_symmetry.conversion.farr import (
        FarrOptions,
        LayerWeights,
        attention_input_moments,
        calibrated_analysis,
        farr_state_dict,
        run_farr,
    )
    from hf_symmetry.conversion.stream import DictSink

    model = _saved(family, tmp_path / "m")
    ids = input_ids(length=60, batch=1).reshape(-1)
    options = FarrOptions(params_fraction=0.6, qk=qk)
    moments = attention_input_moments(tmp_path / "m", ids, window=20, placement=F64)
    want, _, want_report = farr_state_dict(model.state_dict(), model.config, options, moments=moments)

    store = LayerWeights(tmp_path / "spill")
    analysis = calibrated_analysis(tmp_path / "m", ids, options.paths, F64, store=store, window=20)
    assert len(list((tmp_path / "spill").glob("*.safetensors"))) == model.config.num_hidden_layers == len(store)
    assert (store[0].root_aug is not None) == qk  # the query side's metric only where the score map is cut
    reader = CheckpointReader(tmp_path / "m")
    sink = DictSink()
    _, report, _ = run_farr(reader, reader.config, options, sink, False, weights=store, analysis=analysis)
    store.close()
    assert not (tmp_path / "spill").exists()
    assert report.ranks == want_report.ranks and report.kept_energy == want_report.kept_energy
    assert min(report.ranks["vo"]) < model.config.head_dim  # something was cut
    got = dict(sink)
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    for k in got:
        assert _close(got[k], want[k], 1e-12), k


def test_bfloat16_calibration_is_close_to_float32(tmp_path):
    tiny_model("llama", dtype=torch.float32).save_pretrained(tmp_path)
    batches = token_batches(input_ids(length=48, batch=1).reshape(-1), 48)
    req = StatsRequest(grams=("attn_in",))
    f32 = CalibrationEngine(tmp_path, placement=resolve("cpu", "float32"), progress=False).collect(batches, req)
    bf16 = CalibrationEngine(tmp_path, placement=resolve("cpu", "bfloat16"), progress=False).collect(batches, req)
    a, b = f32.layers[1].grams["attn_in"], bf16.layers[1].grams["attn_in"]
    assert 0 < (a - b).norm() / a.norm() < 0.05


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_statistics_equal_cpu(tmp_path, exact_rmsnorm):
    # float64 on both devices: transformers' RMSNorm computes in float32 (exact_rmsnorm keeps float64),
    # and its float32 rotary tables are computed on the host by the engine (capture.rotary_on_host)
    _saved("qwen2", tmp_path)
    batches = token_batches(input_ids(length=48, batch=2).reshape(-1), 24, batch_size=2)
    req = StatsRequest(grams=("attn_in", "down_in"), sums=("o_in",))
    cpu = CalibrationEngine(tmp_path, placement=F64, progress=False).collect(batches, req)
    gpu = CalibrationEngine(tmp_path, placement=resolve("cuda", torch.float64), progress=False).collect(batches, req)
    for a, b in zip(cpu.layers, gpu.layers):
        assert b.grams["attn_in"].device.type == "cpu"  # statistics come back to the host
        for site in req.grams:
            assert _close(a.grams[site], b.grams[site], 1e-9)
        assert _close(a.sums["o_in"], b.sums["o_in"], 1e-9)


def _farr_and_regmean(folder, placement) -> tuple[dict, dict]:
    """FaRR (calibrated, window 20) of the tiny float64 Llama in ``folder`` and a RegMean merge of two
    tiny Llamas, both calibrated on 60 tokens in windows of 20 on ``placement``: their output tensors."""
    from hf_symmetry.checkpoint_io import CheckpointReader
    from hf_symmetry.conversion.farr import FarrOptions, LayerWeights, calibrated_analysis, run_farr
    from hf_symmetry.conversion.merge import Participants, run_merge
    from hf_symmetry.conversion.merge.recipe import recipe_from_dict
    from hf_symmetry.conversion.stream import DictSink

    ids = input_ids(length=60, batch=1).reshape(-1)
    options = FarrOptions(params_fraction=0.6)
    reader = CheckpointReader(folder)
    store = LayerWeights()
    analysis = calibrated_analysis(folder, ids, options.paths, placement, store=store, window=20)
    sink = DictSink()
    run_farr(reader, reader.config, options, sink, False, weights=store, analysis=analysis, device=placement.device)
    merged = DictSink()
    # the recipe's calibration window, like FaRR's, fits the 60 tokens (its default is 256)
    recipe = recipe_from_dict({"merge_method": "regmean", "models": ["a", "b"], "calibration": {"seq_len": 20}})
    run_merge(
        Participants(
            [DictSource(tiny_model("llama", seed=s).state_dict()) for s in (0, 5)],
            [tiny_model("llama").config.to_dict()] * 2,
            ["a", "b"],
        ),
        recipe,
        merged,
        calibration_ids=ids,
        progress=False,
        placement=placement,
    )
    return dict(sink), dict(merged)


def test_farr_and_regmean_calibrate_on_the_cuda_test_window(tmp_path, exact_rmsnorm):
    """The CUDA comparison's calibration reaches the engine (60 tokens, windows of 20), here on the CPU:
    FaRR cuts something and RegMean merges every tensor."""
    _saved("llama", tmp_path / "m")
    farr, merged = _farr_and_regmean(tmp_path / "m", F64)
    assert farr and merged and all(t.device.type == "cpu" for t in (*farr.values(), *merged.values()))
    assert set(tiny_model("llama").state_dict()) - {"lm_head.weight"} <= set(merged)  # (a tied head is not written)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_farr_and_regmean_equal_cpu(tmp_path, exact_rmsnorm):
    """FaRR's eigendecompositions and SVDs and RegMean's Grams and solves on the GPU (float64) give the
    CPU's tensors, back on the CPU."""
    _saved("llama", tmp_path / "m")
    out = {
        name: _farr_and_regmean(tmp_path / "m", placement)
        for name, placement in (("cpu", F64), ("cuda", resolve("cuda", torch.float64)))
    }
    for cpu, gpu in zip(out["cpu"], out["cuda"]):
        for k in cpu:
            assert gpu[k].device.type == "cpu" and _close(gpu[k], cpu[k], 1e-9), k


def test_unknown_site_is_refused():
    with pytest.raises(ValueError, match="unknown calibration site"):
        StatsRequest(grams=("attn_input",))


# ------------------------------------------------------------------------------- SmolLM2 (real model)
@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.calibration import calibration_ids

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = calibration_ids(AutoTokenizer.from_pretrained(smollm2_dir), "britannica-calib", 320)
    return {"dir": smollm2_dir, "model": model, "ids": ids}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
def test_smollm2_statistics_and_conversions_match_the_whole_model_collectors(smol, tmp_path):
    """On SmolLM2 the engine (one layer at a time from the checkpoint) gives to-tpa, FaRR and RegMean
    the statistics the whole-model hook collectors gave, and the same converted tensors."""
    from hf_symmetry.architectures import Adapter
    from hf_symmetry.conversion.merge.statistics import gram_matrices
    from hf_symmetry.conversion.farr import attention_input_moments
    from hf_symmetry.conversion.to_tpa import (
        ToTPAOptions,
        attention_input_grams,
        convert_checkpoint_to_tpa,
        convert_model_to_tpa,
    )

    model, ids = smol["model"], smol["ids"]
    adapter = Adapter.from_config(model.config.to_dict(), list(model.state_dict()))
    batches = token_batches(ids, 512)  # to-tpa's and FaRR's windows: here one of 320 tokens
    ref = _hooked(model, adapter, batches, ("attn_in", "o_in", "ffn_in", "down_in"))
    tpa = attention_input_grams(smol["dir"], ids, progress=False)
    moments = attention_input_moments(smol["dir"], ids)
    grams = gram_matrices(smol["dir"], None, batches, progress=False)
    n = ids.numel()
    for i in (0, 14, 29):
        G, s = ref[(i, "attn_in")], ref[(i, "attn_in", "sum")]
        assert _rel(tpa[i][:-1, :-1], G) < 1e-5 and _rel(tpa[i][:-1, -1], s) < 1e-5
        assert _rel(moments[i][0], G / n) < 1e-5 and _rel(moments[i][1], s / n) < 1e-5
        for key in ("attn_in", "o_in", "ffn_in", "down_in"):
            assert _rel(grams[f"layers.{i}.{key}"], ref[(i, key)]) < 1e-5
    # the streamed, engine-calibrated to-tpa writes the tensors of the in-memory conversion fitted to
    # the hook statistics (the code path before the engine)
    from safetensors.torch import load_file

    aug = []
    for i in range(30):
        G, s = ref[(i, "attn_in")], ref[(i, "attn_in", "sum")]
        aug.append(torch.cat([torch.cat([G, s[:, None]], 1), torch.cat([s, torch.tensor([float(n)])])[None]], 0))
    before, _ = convert_model_to_tpa(model, k_rank=1, v_rank=2, calib_grams=aug, progress=False)
    report = convert_checkpoint_to_tpa(
        smol["dir"],
        tmp_path / "tpa",
        ToTPAOptions(k_rank=1, v_rank=2, calibration=CalibrationText("britannica-calib", 320)),
        progress=False,
    )
    assert report.calibrated and report.calib_tokens == 320
    after = load_file(tmp_path / "tpa" / "model.safetensors")
    sd = before.state_dict()
    assert set(after) == set(sd) - {"lm_head.weight"}
    worst = max(_rel(after[k].double(), sd[k].double()) for k in after if sd[k].abs().sum() > 0)
    assert worst < 1e-4
