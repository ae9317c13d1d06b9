"""``compress``: non-uniform allocation from measured sensitivity, and the ``procrustesgpt-llama`` preset.

The allocator is checked on SmolLM2's shapes (budget met to 0.1 % of the model, uniform for equally
sensitive layers, parameters moved to a layer made sensitive); the measured sensitivity on a tiny
model; every allocation and the preset load as remote code without hf_symmetry."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import hf_symmetry  # noqa: F401  (registers the family)
from hf_symmetry.cli import main
from hf_symmetry.conversion import compress as C
from hf_symmetry.conversion.compress import allocate as A
from hf_symmetry.conversion.compress.plan import check_family, matrix_entries
from hf_symmetry.testing import SEQ40, input_ids, run_without_hf_symmetry, tiny_model


def _source(model):
    return C.DictSource({k: v.detach() for k, v in model.state_dict().items()})


@pytest.fixture(scope="module")
def smollm2_shapes():
    """SmolLM2-135M's config and tensor names (a meta-device model: no weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    config = cfg.to_dict()
    keys = list(model.state_dict())
    dense_total = sum(p.numel() for p in model.parameters())
    return config, keys, dense_total


def _uniform(smollm2_shapes, structure, ratio=0.25, embeddings=True):
    config, keys, dense_total = smollm2_shapes
    options = C.CompressOptions(
        structure=structure, ratio=ratio, stage="w", allocation="sensitivity", compress_embeddings=embeddings
    )
    plan = C.plan_compression(config, keys, dense_total, None, options)
    entries = matrix_entries(config, keys, check_family(config, keys))
    return options, plan, entries


def _curves(entries, options, scale=None):
    """The same convex error curve for every group (optionally scaled per group)."""
    curves = {}
    for name in A.group_entries(entries, options):
        s = (scale or {}).get(name, 1.0)
        curves[name] = [(x, s * (1 - x) ** 2) for x in (0.1, 0.3, 0.5, 0.7, 0.9)]
    return curves


def _allocated(options, plan, entries, curves):
    """Each group's choices ``(keep, params, error)`` and the index of the one chosen."""
    groups = A.build_groups(A.group_entries(entries, options), options, plan.accounting.kron_factor, curves)
    return groups, A.allocate(groups, A.budget_of(plan))


def _params(groups, chosen):
    return {name: groups[name][i][1] for name, i in chosen.items()}


@pytest.mark.parametrize(
    "structure, embeddings", [("lowrank", False), ("gs", False), ("kron", False), ("lowrank", True)]
)
def test_allocation_meets_the_budget_and_is_uniform_for_equal_sensitivity(smollm2_shapes, structure, embeddings):
    """Equal curves for all groups: the decoder layers get equal sizes (to one step of the grid); with
    the embedding compressed too, the budget is still met to 0.1 % of the model."""
    options, plan, entries = _uniform(smollm2_shapes, structure, embeddings=embeddings)
    groups, chosen = _allocated(options, plan, entries, _curves(entries, options))
    keep = {e.name: groups[g][chosen[g]][0] for g, es in A.group_entries(entries, options).items() for e in es}
    config, keys, dense_total = smollm2_shapes
    allocated = C.plan_compression(config, keys, dense_total, None, options, keep=keep)
    target = plan.accounting.target_params
    assert abs(allocated.accounting.compressed_model_params - target) <= 1e-3 * target
    layer_params = [_params(groups, chosen)[f"layers.{i}"] for i in range(30)]
    choices, i = groups["layers.0"], chosen["layers.0"]
    step = max(b[1] - a[1] for a, b in zip(choices[max(i - 2, 0) : i + 3], choices[max(i - 1, 1) : i + 3]))
    assert max(layer_params) - min(layer_params) <= step, (layer_params, step)


@pytest.mark.parametrize("structure", ["lowrank", "gs"])
def test_allocation_moves_parameters_to_a_sensitive_layer(smollm2_shapes, structure):
    options, plan, entries = _uniform(smollm2_shapes, structure)
    even = _params(*_allocated(options, plan, entries, _curves(entries, options)))
    skewed = _params(*_allocated(options, plan, entries, _curves(entries, options, {"layers.7": 50.0})))
    others = [skewed[f"layers.{i}"] for i in range(30) if i != 7]
    assert skewed["layers.7"] > even["layers.7"]
    assert skewed["layers.7"] > max(others)
    assert sum(skewed.values()) <= A.budget_of(plan)


def test_allocator_may_keep_a_layer_dense_and_refuses_an_impossible_budget():
    groups = {  # (keep, params, error)
        "cheap": [(0.1, 10, 1.0), (0.5, 50, 0.6), (1.0, 100, 0.0)],
        "flat": [(0.1, 10, 0.2), (0.5, 50, 0.19), (1.0, 100, 0.0)],
    }
    chosen = A.allocate(groups, 110)
    keep = {name: groups[name][i][0] for name, i in chosen.items()}
    assert keep == {"cheap": 1.0, "flat": 0.1}  # dense where it pays, by the same rule
    with pytest.raises(ValueError, match="below the smallest allocation"):
        A.allocate(groups, 15)


def test_measured_sensitivity_grows_as_the_layer_shrinks():
    """On a real forward (the engine, tiny Llama): smaller sizes give larger layer output errors."""
    model = tiny_model("llama", dtype=torch.float32)
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="lowrank", ratio=0.3, stage="w", allocation="sensitivity")
    src = _source(model)
    adapter = check_family(config, src.keys())
    entries = matrix_entries(config, src.keys(), adapter)
    calib_input = C.CompressRun(src, config, options, calib, calibration=SEQ40, progress=False)
    members = A.group_entries(entries, options)
    curves = A.measure_sensitivity(calib_input, adapter, members, None)  # low rank: no Kronecker factor
    assert set(curves) >= {"layers.0", "layers.1", "embed"}
    for name, curve in curves.items():
        errors = [e for _, e in sorted(curve)]
        assert errors[0] > errors[-1] >= 0, (name, curve)


def test_uniform_allocation_and_presets_need_no_sensitivity_and_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="unknown allocation"):
        C.CompressOptions(allocation="greedy").validate()
    with pytest.raises(ValueError, match="one global PCA"):
        C.CompressOptions(structure="slice", q_mode="segment", allocation="sensitivity").validate()
    C.CompressOptions(structure="slice", allocation="sensitivity").validate()
    with pytest.raises(ValueError, match="calibration"):
        C.CompressOptions(stage="none", allocation="sensitivity").validate()
    with pytest.raises(ValueError, match="unknown preset"):
        C.CompressOptions.preset("slicegpt")


# ----------------------------------------------------------------------------- SliceGPT widths
def _slice_widths(smollm2_shapes, scale=None):
    """Per-segment widths at ratio 0.25 for the same convex error curve in every group (optionally
    scaled per group), and the uniform plan."""
    config, keys, dense_total = smollm2_shapes
    options = C.CompressOptions(structure="slice", ratio=0.25, allocation="sensitivity")
    uniform = C.plan_compression(config, keys, dense_total, None, options)
    entries = matrix_entries(config, keys, check_family(config, keys))
    curves = {
        name: [(x, (scale or {}).get(name, 1.0) * (1 - x) ** 2) for x in A.MEASURED_WIDTHS]
        for name in A.slice_groups(30)
    }
    widths, _ = A.allocate_slice(entries, 30, 576, True, uniform.accounting.target_params, curves, uniform.residual)
    keep = {f"segment{k}": w / 576 for k, w in enumerate(widths)}
    return uniform, C.plan_compression(config, keys, dense_total, None, options, keep=keep), widths


def test_slice_widths_meet_the_budget_and_are_uniform_for_equal_sensitivity(smollm2_shapes):
    uniform, allocated, widths = _slice_widths(smollm2_shapes)
    target, dense_total = uniform.accounting.target_params, smollm2_shapes[2]
    got = allocated.accounting.compressed_model_params
    assert got <= target and target - got <= 1e-3 * dense_total, (got, target)
    # decoder layers 0 .. L-2 cost the same per unit of width (the last one pays for the head's mix
    # instead of the next layer's q/k/v; the embedding for its 49152 rows): equal widths, to one grid step
    layer_widths = widths[1:-2]
    assert max(layer_widths) - min(layer_widths) <= 8, widths
    assert widths[0] < min(layer_widths)  # the embedding's width is 85x as expensive
    assert allocated.residual_sizes == widths


def test_slice_widths_move_to_a_sensitive_layer(smollm2_shapes):
    uniform, even, widths = _slice_widths(smollm2_shapes)
    _, skewed, skewed_widths = _slice_widths(smollm2_shapes, {"layers.7": 50.0})
    # layer 7 writes segments 15 and 16
    assert skewed_widths[15] == skewed_widths[16] >= max(skewed_widths)
    assert skewed_widths[15] > widths[15]
    target, dense_total = uniform.accounting.target_params, smollm2_shapes[2]
    got = skewed.accounting.compressed_model_params
    assert got <= target and target - got <= 1e-3 * dense_total
    assert skewed.residual_sizes == skewed_widths


def test_measured_slice_sensitivity_grows_as_the_width_shrinks():
    """On a real forward (the engine, tiny Llama): narrower widths give larger layer output errors;
    the sliced layer at full width is the layer itself (error 0)."""
    from hf_symmetry.conversion.compress.pca import pca

    model = tiny_model("llama", dtype=torch.float32)
    config = model.config.to_dict()
    calib = input_ids(batch=1, length=120, seed=3)[0]
    options = C.CompressOptions(structure="slice", ratio=0.3, allocation="sensitivity")
    src = _source(model)
    adapter = check_family(config, src.keys())
    stats = C.collect_statistics(
        C.CompressRun(src, config, calib_ids=calib, calibration=SEQ40, progress=False),
        want_normed=False,
        want_stream=True,
    )
    Q = pca(sum(C_ / C_.trace() for C_ in stats.stream))
    calib_input = C.CompressRun(src, config, options, calib, calibration=SEQ40, progress=False)
    curves = A.measure_slice_sensitivity(calib_input, adapter, Q, stats.stream, tied=False)
    assert set(curves) == {"layers.0", "layers.1", "embed"}
    for name, curve in curves.items():
        errors = [e for _, e in sorted(curve)]
        assert errors[0] > errors[-1] > 0, (name, curve)
    layer = model.model.layers[0]
    x = torch.randn(1, 5, config["hidden_size"])
    pos = model.model.rotary_emb(x, torch.arange(5)[None])
    full = A._sliced_layer(layer, adapter, torch.eye(config["hidden_size"]))

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        assert torch.allclose(
            first(full(x, position_embeddings=pos)), first(layer(x, position_embeddings=pos)), atol=1e-6
        )


# ----------------------------------------------------------------------------- preset
def test_procrustesgpt_llama_preset_is_the_papers_configuration():
    """Embedding and head dense, V dense, q/k/o/gate/up/down at 75 % each; parameters removed are
    reported over the whole model."""
    model = tiny_model("qwen2", dtype=torch.float32)  # untied head: it stays dense too
    options = C.CompressOptions.preset("procrustesgpt-llama", structure="lowrank", stage="none")
    assert not options.compress_embeddings and options.dense_modules == ("v",) and options.matrix_keep == 0.75
    plan, _ = C.plan_for(_source(model), model.config.to_dict(), options)
    per = plan.accounting.per_matrix
    assert per["embed"]["ratio"] == 0 and per["lm_head"]["ratio"] == 0 and per["layers.0.v_proj"]["ratio"] == 0
    for m in ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert abs(per[f"layers.1.{m}"]["ratio"] - 0.25) < 0.07, (m, per[f"layers.1.{m}"])
    dense = sum(p.numel() for p in model.parameters())
    acc = plan.accounting
    assert acc.ratio_over_model == pytest.approx(1 - acc.compressed_model_params / dense)
    assert acc.target_ratio is None
    assert acc.target_params == acc.compressed_model_params  # what an allocation of the preset must meet
    assert "matrix_keep" in options.applicable(C.CALIBRATION) and "ratio" not in options.applicable(C.CALIBRATION)


# ----------------------------------------------------------------------------- remote code
ISOLATED_LOADER = textwrap.dedent("""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    out = {}
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(FOLDER + "/" + name, trust_remote_code=True).eval()
        with torch.no_grad():
            logits = model(load_file(IDS)["ids"][None]).logits[0]
        save_file({"logits": logits.contiguous()}, OUTPUT + "." + name)
        out[name] = type(model).__module__
    out["imported"] = "hf_symmetry" in sys.modules
    print(json.dumps(out))
""")


def test_preset_and_allocations_load_as_remote_code_without_hf_symmetry(tiny_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str((7 * i) % 97) for i in range(400)))
    root = tmp_path / "out"
    common = ["--calib", str(calib), "--calib-seq-len", "64", "--f-iters", "1", "--quiet"]
    runs = {
        "preset": ["--preset", "procrustesgpt-llama", "--structure", "gs", "--stage", "f"],
        "lowrank-sensitivity": ["--structure", "lowrank", "--allocation", "sensitivity", "--ratio", "0.3"],
        "slice-sensitivity": ["--structure", "slice", "--allocation", "sensitivity", "--ratio", "0.3"],
    }
    for name, flags in runs.items():
        assert main(["compress", str(tiny_dir), str(root / name), *flags, *common]) == 0, name
    assert "--ratio does not apply" not in capsys.readouterr().err
    assert (
        main(
            ["compress", str(tiny_dir), str(root / "bad"), "--preset", "procrustesgpt-llama", "--ratio", "0.3", *common]
        )
        == 2
    )
    assert "--ratio does not apply" in capsys.readouterr().err and not (root / "bad").exists()
    acc = json.loads((root / "lowrank-sensitivity" / "compression_report.json").read_text())["accounting"]
    assert acc["allocation"] == "sensitivity" and set(acc["allocation_report"]["groups"]) >= {"layers.0", "layers.1"}
    assert acc["compressed_model_params"] == acc["compressed_model_params_counted"]
    assert acc["allocation_report"]["allocated"] <= acc["allocation_report"]["budget"]
    widths = json.loads((root / "slice-sensitivity" / "config.json").read_text())["residual_sizes"]
    assert len(set(widths)) > 1, widths  # the remote-code load below sees varying widths
    sliced = json.loads((root / "slice-sensitivity" / "compression_report.json").read_text())["accounting"]
    assert sliced["compressed_model_params"] == sliced["compressed_model_params_counted"]
    assert sliced["allocation_report"]["widths"] == widths
    preset = json.loads((root / "preset" / "compression_report.json").read_text())["accounting"]
    assert preset["per_matrix"]["embed"]["ratio"] == 0 and preset["per_matrix"]["layers.0.v_proj"]["ratio"] == 0
    for name in runs:
        weights = root / name / "model.safetensors"
        assert oct(weights.stat().st_mode & 0o777) == "0o644"
    ids = input_ids(batch=1, length=12)[0]
    save_file({"ids": ids.contiguous()}, str(tmp_path / "ids.safetensors"))
    out = str(tmp_path / "logits")
    meta = run_without_hf_symmetry(
        ISOLATED_LOADER,
        tmp_path,
        timeout=600,
        FOLDER=str(root),
        NAMES=list(runs),
        IDS=str(tmp_path / "ids.safetensors"),
        OUTPUT=out,
    )
    assert meta["imported"] is False
    for name in runs:
        assert meta[name].startswith("transformers_modules."), name
        local = AutoModelForCausalLM.from_pretrained(root / name).eval()
        with torch.no_grad():
            ref = local(ids[None]).logits[0]
        assert (load_file(out + "." + name)["logits"] - ref).abs().max().item() <= 1e-5, name
