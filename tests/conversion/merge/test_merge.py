"""Merging (Zhang et al. 2025, §5): merge rules against hand-computed cases, the pipeline on tiny models
(matched statistics, planted pairs, anchors), recipes and refusals, the CLI, and mergekit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_symmetry.cli import build_parser, main
from hf_symmetry.commands.merge import recipe_from_args
from hf_symmetry.conversion import merge as merge_module
from hf_symmetry.conversion.merge import fisher as merge_fisher
from hf_symmetry.conversion.merge import methods as merge_methods
from hf_symmetry.conversion.merge import tensor_rules
from hf_symmetry.conversion.merge import merge_pass as merge_stream
from hf_symmetry.conversion.match import MatchOptions, fold_state_dict, match_state_dict
from hf_symmetry.conversion.merge import merge_state_dicts
from hf_symmetry.conversion.merge.tensor_rules import fisher_average, regmean, task_arithmetic, ties, weighted_average
from hf_symmetry.conversion.merge.recipe import load_recipe, recipe_from_dict
from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
from hf_symmetry.evaluation.compare import model_from_state_dict
from hf_symmetry.testing import input_ids, outputs, tiny_model

T = torch.tensor
CALIB = torch.randint(2, 97, (256,), generator=torch.Generator().manual_seed(0))


def _sd(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _recipe(method: str, n: int = 2, **extra) -> dict:
    return {"merge_method": method, "models": [f"m{j}" for j in range(n)], **extra}


def _close(a: dict, b: dict, tol: float) -> bool:
    # the models a merge builds run on its device (CUDA where visible); compare on the host
    return all((a[k].double().cpu() - b[k].double().cpu()).abs().max() <= tol for k in a.keys() & b.keys())


# --------------------------------------------------------------------------- rules by hand


def test_weighted_average_and_task_arithmetic_by_hand():
    a, b = T([1.0, 2.0]), T([3.0, 6.0])
    assert torch.equal(weighted_average([a, b], [1, 3]), T([2.5, 5.0], dtype=torch.float64))
    assert torch.equal(weighted_average([a, b], [1, 3], normalize=False), T([10.0, 20.0], dtype=torch.float64))
    base, t1, t2 = T([1.0, 2.0, 3.0]), T([2.0, 2.0, 5.0]), T([0.0, 3.0, 3.0])
    # deltas [1, 0, 2] and [-1, 1, 0]; weighted sum [0.5, 0.5, 2]; λ = 0.5
    assert torch.allclose(
        task_arithmetic(base, [t1, t2], [1.0, 0.5], lam=0.5), T([1.25, 2.25, 4.0], dtype=torch.float64)
    )
    assert torch.allclose(
        task_arithmetic(base, [t1, t2], [1.0, 0.5], lam=0.5, normalize=True),
        T([1 + 0.25 / 1.5, 2 + 0.25 / 1.5, 3 + 1 / 1.5], dtype=torch.float64),
    )


def test_ties_by_hand():
    base = torch.zeros(4)
    t1, t2, t3 = T([3.0, -1.0, 2.0, 0.5]), T([-2.0, -2.5, 1.0, 4.0]), T([1.0, 1.5, -4.0, 0.1])
    # trim to 2 of 4: [3,0,2,0], [0,-2.5,0,4], [0,1.5,-4,0]; elected signs of the sum [3,-1,-2,4]: + - - +;
    # disjoint means over the agreeing entries: [3, -2.5, -4, 4]
    expected = T([3.0, -2.5, -4.0, 4.0], dtype=torch.float64)
    assert torch.equal(ties(base, [t1, t2, t3], [1, 1, 1], [0.5] * 3), expected)
    # weights [1, 2, 1]: weighted sum [3, -3.5, -2, 8], same signs, weighted means unchanged
    assert torch.equal(ties(base, [t1, t2, t3], [1, 2, 1], [0.5] * 3), expected)
    # without normalising: the weighted sums of agreeing entries; λ scales the result
    assert torch.equal(
        ties(base, [t1, t2, t3], [1, 2, 1], [0.5] * 3, lam=2.0, normalize=False),
        2 * T([3.0, -5.0, -4.0, 8.0], dtype=torch.float64),
    )
    # density 1: sign election only
    assert torch.equal(ties(base, [t1, t2], [1, 1], [1, 1]), T([3.0, -1.75, 1.5, 2.25], dtype=torch.float64))


def test_fisher_average_by_hand():
    out = fisher_average([T([1.0, 4.0]), T([3.0, 0.0])], [T([1.0, 3.0]), T([3.0, 1.0])], [1, 1], floor=0)
    assert torch.equal(out, T([2.5, 3.0], dtype=torch.float64))
    # zero Fisher everywhere falls back to the weighted average through the floor
    out = fisher_average([T([1.0]), T([3.0])], [T([0.0]), T([0.0])], [1, 3], floor=1e-12)
    assert torch.allclose(out, T([2.5], dtype=torch.float64))


def test_regmean_solves_the_merged_regression():
    gen = torch.Generator().manual_seed(1)
    X = [torch.randn(40, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    W = [torch.randn(3, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    got = regmean(W, [x.T @ x for x in X], [1.0, 1.0], alpha=1.0)
    want = torch.linalg.lstsq(torch.cat(X), torch.cat([x @ w.T for x, w in zip(X, W)])).solution.T
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.allclose(regmean([W[0], W[0]], [x.T @ x for x in X], [1, 2], alpha=0.5), W[0], atol=1e-12)
    with pytest.raises(ValueError, match="singular"):
        regmean(W, [torch.zeros(6, 6)] * 2, [1, 1], alpha=1.0)


# --------------------------------------------------------------------------- the pipeline


@pytest.mark.parametrize("method", ["regmean", "fisher", "average"])
def test_merging_identical_models_returns_that_model(method):
    sd = _sd(tiny_model("qwen2"))
    merged = merge_state_dicts([sd, sd], tiny_model("qwen2").config, _recipe(method), calibration_ids=CALIB)
    assert _close(sd, merged.state_dict, 1e-10)


@pytest.mark.parametrize(
    "method,extra",
    [
        ("average", {}),
        ("regmean", {}),
        ("fisher", {}),
        ("ties", {"parameters": {"density": 0.5}}),
        ("task_arithmetic", {"parameters": {"lambda": 0.7}}),
    ],
)
def test_merging_a_planted_pair_after_matching_returns_the_anchor(method, extra, exact_rmsnorm):
    model = tiny_model("llama")
    anchor = _sd(model)
    planted, cfg = rotate_state_dict(anchor, model.config, RotateOptions(residual="random", scaling=True, seed=5))
    base = {"base_model": "anchor"} if method in ("ties", "task_arithmetic") else {}
    dicts = [anchor, planted]
    recipe = _recipe(method, match={"residual": True, "scaling": True}, **base, **extra)
    merged = merge_state_dicts(dicts, cfg, recipe, base=anchor if base else None, calibration_ids=CALIB)
    ids = input_ids()
    got = outputs(model_from_state_dict(merged.outcome.config, merged.state_dict, torch.float64), ids)
    assert (got - outputs(model, ids)).abs().max() < 1e-9
    if method == "average":  # negative control: the same merge without matching
        plain = merge_state_dicts(dicts, cfg, _recipe(method, **extra))
        bad = outputs(model_from_state_dict(plain.outcome.config, plain.state_dict, torch.float64), ids)
        assert (bad - outputs(model, ids)).abs().max() > 0.1


def test_fisher_and_regmean_use_statistics_of_the_matched_models(monkeypatch, exact_rmsnorm):
    a_model, s_model = tiny_model("llama", seed=0), tiny_model("llama", seed=13)
    anchor, source = _sd(a_model), _sd(s_model)
    options = {"residual": True, "scaling": True}
    matched = match_state_dict(anchor, source, s_model.config, MatchOptions(**options))
    folded = fold_state_dict(anchor, a_model.config)

    seen = []
    real_fisher = merge_fisher.fisher_diagonal
    monkeypatch.setattr(
        merge_fisher,
        "fisher_diagonal",
        lambda model, *a, **k: seen.append(model.state_dict()) or real_fisher(model, *a, **k),
    )
    merge_state_dicts([anchor, source], s_model.config, _recipe("fisher", match=options), calibration_ids=CALIB)
    assert _close(seen[0], folded.state_dict, 1e-12) and _close(seen[1], matched.state_dict, 1e-12)
    assert not _close(seen[1], {k: v for k, v in source.items()}, 1e-3)  # not the unmatched source

    grams = []
    real_group = merge_stream.regmean_group

    def spy(models, *a, **k):  # the Grams each merged linear group gets (cloned: the solver consumes them)
        taken = []
        grams.append(taken)
        return real_group(((taken.append(G.clone()) or G, W) for G, W in models), *a, **k)

    monkeypatch.setattr(merge_stream, "regmean_group", spy)
    merge_state_dicts([anchor, source], s_model.config, _recipe("regmean", match=options), calibration_ids=CALIB)
    # Grams recomputed on the matched models, in the order the pipeline visits linear layers
    from hf_symmetry.architectures import Adapter
    from hf_symmetry.calibration import token_batches
    from hf_symmetry.conversion.merge.statistics import gram_matrices

    batches = token_batches(CALIB, 256, 4, keep_partial=False)  # the recipe's default batching
    recomputed = []
    for sd, cfg in ((folded.state_dict, folded.config), (matched.state_dict, matched.config)):
        m = model_from_state_dict(cfg, sd, torch.float64)
        recomputed.append(gram_matrices(m, Adapter.from_config(cfg, list(sd)), batches, progress=False))
    down = [G for G in grams if G[0].shape[0] == 80]  # down_proj inputs (intermediate 80), layers 0 and 1
    for i, G in enumerate(down):
        for j in range(2):
            want = recomputed[j][f"layers.{i}.down_in"]
            assert (G[j] - want).abs().max() <= 1e-8 * want.abs().max()


def _whole_model_grams(model, batches) -> dict:
    """Σ xᵀx of the input of every linear layer over ``batches``: forward pre-hooks on the whole model."""
    grams, handles = {}, []

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            grams[name] = grams.get(name, 0) + x.T @ x

        return pre

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(hook(name)))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in handles:
        h.remove()
    return grams


def test_regmean_statistics_collected_in_the_merge_pass_equal_a_whole_model_reference(monkeypatch):
    """RegMean measures each layer's Grams inside the merge pass (one layer at a time); the merged
    tensors equal RegMean with Grams from hooks on the whole models."""
    from hf_symmetry.calibration import token_batches

    models = [
        tiny_model("llama", seed=0, tie_word_embeddings=False),
        tiny_model("llama", seed=7, tie_word_embeddings=False),
    ]
    sds = [_sd(m) for m in models]
    seen = []
    real_layer = merge_stream.LayerGrams.layer

    def spy(self, i, *args, **kwargs):
        out = real_layer(self, i, *args, **kwargs)
        seen.append((i, [sorted(g) for g in out]))
        return out

    monkeypatch.setattr(merge_stream.LayerGrams, "layer", spy)
    merged = merge_state_dicts(sds, models[0].config, _recipe("regmean"), calibration_ids=CALIB).state_dict
    n_layers = models[0].config.num_hidden_layers
    assert [i for i, _ in seen] == list(range(n_layers))  # one layer's statistics per merge step
    assert all(k.startswith(f"layers.{i}.") for i, keys in seen for ks in keys for k in ks)

    batches = token_batches(CALIB, 256, 4, keep_partial=False)  # the recipe's default batching
    grams = [_whole_model_grams(m, batches) for m in models]
    linear = {n for n, mod in models[0].named_modules() if isinstance(mod, torch.nn.Linear)}
    assert "lm_head" in linear
    worst = 0.0
    for key, got in merged.items():
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and module in linear:
            want = regmean([sd[key] for sd in sds], [g[module] for g in grams], [1.0, 1.0], alpha=0.9)
        else:
            want = (sds[0][key] + sds[1][key]) / 2
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    assert worst < 1e-10
    average = merge_state_dicts(sds, models[0].config, _recipe("average")).state_dict  # negative control
    assert (
        average["model.layers.0.mlp.down_proj.weight"] - merged["model.layers.0.mlp.down_proj.weight"]
    ).abs().max() > 1e-2


@pytest.mark.parametrize(
    "method,parameters",
    [
        ("task_arithmetic", {"lambda": 0.7}),
        ("task_arithmetic", {"lambda": 1.2, "normalize": True}),
        ("ties", {"density": 0.4, "lambda": 0.9}),
        ("ties", {"density": 0.7, "normalize": False}),
    ],
)
def test_task_vector_merges_of_state_dicts_equal_the_rules_applied_tensor_by_tensor(method, parameters):
    """task_arithmetic and TIES through the pipeline (no matching) give, for every tensor, the rule
    applied to that tensor of the inputs and the base; the base is not an input's copy, so a merge
    that ignored it, averaged, or swapped the two rules would differ (negative control below)."""
    models = [tiny_model("llama", seed=s, tie_word_embeddings=False) for s in (0, 3, 5)]
    sds = [_sd(m) for m in models]
    weights = [1.0, 0.6]
    recipe = {
        "merge_method": method,
        "base_model": "b",
        "models": [{"model": f"m{j}", "parameters": {"weight": w}} for j, w in enumerate(weights)],
        "parameters": parameters,
    }
    merged = merge_state_dicts(sds[1:], models[0].config, recipe, base=sds[0]).state_dict
    lam = parameters.get("lambda", 1.0)
    assert set(merged) == set(sds[0])
    for key, got in merged.items():
        base, inputs = sds[0][key], [sd[key] for sd in sds[1:]]
        if method == "ties":
            density = [parameters["density"]] * 2
            want = ties(base, inputs, weights, density, lam, parameters.get("normalize", True))
        else:
            want = task_arithmetic(base, inputs, weights, lam, parameters.get("normalize", False))
        assert torch.allclose(got, want.to(got.dtype), rtol=0, atol=1e-12), key
    other = "ties" if method == "task_arithmetic" else "task_arithmetic"
    swapped = {k: v for k, v in parameters.items() if k != "density"}
    control = merge_state_dicts(
        sds[1:], models[0].config, {**recipe, "merge_method": other, "parameters": swapped}, base=sds[0]
    ).state_dict
    key = "model.layers.0.mlp.down_proj.weight"
    assert (control[key] - merged[key]).abs().max() > 1e-3


class _Scaled(merge_methods.MergeMethod):
    """A method added in one class: the weighted average times ``scale``, optionally sign-flipped."""

    name = "scaled"
    title = "scaled average"
    paper = "(a test's own)"
    parameters = (
        merge_methods.Parameter("scale", float, 2.0, "scaled: factor on the average (default 2)"),
        merge_methods.Parameter("flip_sign", bool, False, "scaled: negate the average"),
    )

    def combine(self, models, base, entries, params, fishers):
        sign = -1.0 if params["flip_sign"] else 1.0
        return sign * params["scale"] * weighted_average(models, [e.weight for e in entries])


def _merge_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    return capsys.readouterr().out


def test_a_merge_method_is_one_registered_class_flags_recipe_checks_and_merge_follow(monkeypatch, capsys):
    """A method declared as one class in MERGE_METHODS gets its --method choice and one flag per parameter
    (help from the declaration), the recipe checks its parameters' types and fills their defaults, and the
    merge uses them; unregistered (negative control) there is no flag and no such method."""
    assert "--scale" not in _merge_help(capsys)
    with pytest.raises(ValueError, match="unknown merge method 'scaled'"):
        recipe_from_dict({"merge_method": "scaled", "models": ["a", "b"]})
    monkeypatch.setitem(merge_methods.MERGE_METHODS, "scaled", _Scaled)
    text = _merge_help(capsys)
    assert "--scale SCALE" in text and "scaled: factor on the average (default 2)" in text
    assert "--flip-sign" in text and "--flip-sign FLIP" not in text  # a switch, no value
    assert text.index("--alpha") < text.index("--scale") < text.index("--normalize") < text.index("--flip-sign")
    assert "scaled average" in text  # the description names it
    recipe = recipe_from_dict({"merge_method": "scaled", "models": ["a", "b"]})
    assert recipe.parameters == {"scale": 2.0, "flip_sign": False}
    with pytest.raises(ValueError, match="scale must be a number"):
        recipe_from_dict({"merge_method": "scaled", "models": ["a", "b"], "parameters": {"scale": "big"}})
    with pytest.raises(ValueError, match="flip_sign must be true or false"):
        recipe_from_dict({"merge_method": "scaled", "models": ["a", "b"], "parameters": {"flip_sign": 1}})
    with pytest.raises(ValueError, match="density applies to ties only"):
        recipe_from_dict({"merge_method": "scaled", "models": ["a", "b"], "parameters": {"density": 0.5}})
    args = build_parser().parse_args(["merge", "--method", "scaled", "a", "b", "out", "--scale", "3", "--flip-sign"])
    recipe, out = recipe_from_args(args)
    assert recipe.method == _Scaled() and recipe.parameters == {"scale": 3.0, "flip_sign": True} and out == "out"
    models = [tiny_model("llama", seed=s) for s in (0, 1)]
    sds = [_sd(m) for m in models]
    merged = merge_state_dicts(sds, models[0].config, recipe).state_dict
    key = "model.layers.0.mlp.down_proj.weight"
    want = -3.0 * weighted_average([sd[key] for sd in sds], [1.0, 1.0])
    assert torch.allclose(merged[key], want.to(merged[key].dtype), rtol=0, atol=1e-6)


def test_three_models_anchor_nearest_the_mean_and_the_others_matched():
    a, b = _sd(tiny_model("llama", seed=0)), _sd(tiny_model("llama", seed=1))
    middle = {k: (a[k] + b[k]) / 2 + 0.01 * torch.randn_like(a[k]) for k in a}
    cfg = tiny_model("llama").config
    out = merge_state_dicts([a, middle, b], cfg, _recipe("average", n=3, match=True)).outcome
    assert out.anchor == 1
    assert min(out.anchor_distances.values()) == out.anchor_distances["m1"]
    assert set(out.distances) == {"m0", "m2"}
    for d in out.distances.values():
        assert d["total"]["after"] < d["total"]["before"]
    # a named anchor wins
    assert merge_state_dicts([a, middle, b], cfg, _recipe("average", n=3, match=True, anchor="m2")).outcome.anchor == 2


# --------------------------------------------------------------------------- recipes and refusals


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"merge_method": "slerp", "models": ["a", "b"]}, "unknown merge method 'slerp'"),
        ({"merge_method": "ties", "models": ["a", "b"]}, "needs base_model"),
        ({"merge_method": "task_arithmetic", "models": ["a", "b"]}, "needs base_model"),
        ({"merge_method": "average", "models": ["a"]}, "at least two models"),
        ({"merge_method": "average", "models": ["a", "b"], "tokenizer_source": "a"}, "unknown key 'tokenizer_source'"),
        ({"merge_method": "average", "models": ["a", "b"], "parameters": {"density": 0.5}}, "ties only"),
        ({"merge_method": "regmean", "models": ["a", "b"], "parameters": {"alpha": 2}}, "alpha must be in"),
        (
            {"merge_method": "ties", "base_model": "c", "models": [{"model": "a", "parameters": {"density": 0}}, "b"]},
            "density",
        ),
        ({"merge_method": "average", "models": ["a", "b"], "match": {"residual": "yes"}}, "match.residual"),
        ({"merge_method": "average", "models": ["a", "b"], "anchor": "z"}, "anchor 'z'"),
        ({"merge_method": "regmean", "models": ["a", "b"], "calibration": False}, "needs calibration"),
    ],
)
def test_bad_recipes_are_refused_with_one_clear_line(raw, message):
    with pytest.raises(ValueError, match=message):
        recipe_from_dict(raw)


def test_bad_recipe_file_fails_before_any_work(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"merge_method": "dare_magic", "models": ["nowhere-a", "nowhere-b"]}))
    assert main(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown merge method 'dare_magic'" in err[0]
    assert not (tmp_path / "out").exists()
    recipe.write_text(yaml.safe_dump({"merge_method": "ties", "models": ["nowhere-a", "nowhere-b"]}))
    assert main(["merge", str(recipe), str(tmp_path / "out")]) == 2
    assert "needs base_model" in capsys.readouterr().err
    assert main(["merge", str(recipe), str(tmp_path / "out"), "--alpha", "0.5"]) == 2
    assert "cannot be combined with a recipe" in capsys.readouterr().err


def _save(model, folder: Path) -> Path:
    model.to(torch.float32).save_pretrained(folder)
    return folder


def _word_tokenizer(folder: Path) -> None:
    """A 97-word tokenizer for the tiny models (unknown words map to id 0), so perplexities run."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]"] + "the of and to in a is was by for with as on from that at his it an are which or be".split()
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(97 - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def test_incompatible_inputs_are_refused_before_any_work(tmp_path, capsys):
    a = _save(tiny_model("llama"), tmp_path / "a")
    b = _save(tiny_model("qwen2"), tmp_path / "b")
    capsys.readouterr()
    assert main(["merge", "--method", "average", str(a), str(b), str(tmp_path / "out"), "--quiet"]) == 2
    assert "is a qwen2 model but" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    g = _save(tiny_model("gpt2"), tmp_path / "g")
    capsys.readouterr()
    assert main(["merge", "--method", "fisher", str(g), str(g), str(tmp_path / "out"), "--quiet"]) == 2
    assert "tokenizer" in capsys.readouterr().err  # fisher needs calibration text, i.e. a tokenizer
    bert = _save(tiny_model("bert"), tmp_path / "bert")
    with pytest.raises(ValueError, match="language-model head"):
        merge_state_dicts(
            [_sd(tiny_model("bert"))] * 2, tiny_model("bert").config, _recipe("fisher"), calibration_ids=CALIB
        )
    assert bert.exists()


def test_recipe_cli_streams_a_matched_merge_into_a_stock_folder_with_a_card(tmp_path, capsys):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    models = [tiny_model("llama", seed=s, dtype=torch.float32) for s in (0, 1, 2)]
    paths = [_save(m, tmp_path / f"m{j}") for j, m in enumerate(models)]
    _word_tokenizer(paths[0])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "merge_method": "ties",
                "base_model": "m0",
                "models": [
                    {"model": "m1", "parameters": {"weight": 1.0, "density": 0.6}},
                    {"model": "m2", "parameters": {"weight": 0.5}},
                ],
                "parameters": {"density": 0.8, "lambda": 0.9},
                "match": {"residual": True, "scaling": True},
                "evaluation": {"tokens": 300},
            }
        )
    )
    out = tmp_path / "merged"
    assert main(["merge", str(recipe), str(out), "--quiet", "--max-shard-size", "60KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()  # streamed into several shards
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # the same merge in memory
    r = load_recipe(recipe)
    assert [m.density for m in r.models] == [0.6, 0.8] and r.models[0].model == str(paths[1])
    sds = [{k: v.double() for k, v in _sd(m).items()} for m in models]
    want = merge_state_dicts(sds[1:], models[0].config, r, base=sds[0])
    got = loaded.state_dict()
    assert _close({k: v for k, v in want.state_dict.items() if k in got}, got, 1e-5)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # no input has a Hub ancestor; paths stay private
    assert card.data.hf_symmetry["inputs"] == ["m1", "m2", "m0"]
    assert card.data.hf_symmetry["method"] == "merge/ties"
    assert "hf_symmetry-merge" in card.data.tags
    assert set(card.data.hf_symmetry["extra"]["distances"]) == {"m1", "m2"}
    assert "Matching to `m0`, squared Frobenius distance" in card.text
    assert str(tmp_path) not in (out / "README.md").read_text()
    # measured figures: the merge's perplexity as model-index metadata, every input's in the text
    (result,) = card.data.eval_results
    assert result.metric_type == "perplexity" and result.metric_value > 1
    assert "| **this merge** |" in card.text and "| `m2` |" in card.text
    assert (out / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["merge", str(recipe), str(out), "--quiet"]) == 2  # non-empty OUT
    assert "not empty" in capsys.readouterr().err


# --------------------------------------------------------------------------- mergekit


def _mergekit_yaml() -> str | None:
    exe = Path(sys.executable).parent / "mergekit-yaml"
    return str(exe) if exe.is_file() else shutil.which("mergekit-yaml")


@pytest.mark.skipif(_mergekit_yaml() is None, reason="mergekit is not installed (pip install '.[test]' installs it)")
def test_mergekit_linear_merge_of_anchor_and_matched_source_equals_our_average(tmp_path):
    from safetensors.torch import load_file

    a = _save(tiny_model("llama", seed=0), tmp_path / "anchor")
    s = _save(tiny_model("llama", seed=6), tmp_path / "source")
    assert main(["match", str(a), str(s), str(tmp_path / "matched"), "--scaling", "--quiet", "--no-verify"]) == 0
    recipe = tmp_path / "linear.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "dtype": "float32",
                "models": [
                    {"model": str(a), "parameters": {"weight": 1.0}},
                    {"model": str(tmp_path / "matched"), "parameters": {"weight": 1.0}},
                ],
            }
        )
    )
    res = subprocess.run(
        [_mergekit_yaml(), str(recipe), str(tmp_path / "mk")], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert main(["merge", str(recipe), str(tmp_path / "ours"), "--quiet"]) == 0  # the same recipe file
    theirs, ours = load_file(tmp_path / "mk" / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert set(theirs) == set(ours)
    for k in ours:
        assert torch.allclose(theirs[k], ours[k], atol=1e-6, rtol=0), k
    # and the matched average is closer to the anchor than the plain one
    anchor, source = load_file(a / "model.safetensors"), load_file(s / "model.safetensors")
    plain = {k: (anchor[k] + source[k]) / 2 for k in anchor}
    assert sum((ours[k] - anchor[k]).pow(2).sum() for k in ours) < sum(
        (plain[k] - anchor[k]).pow(2).sum() for k in ours
    )
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "llama"


def test_fisher_merge_spills_matched_inputs_and_fishers_to_disk_and_equals_the_in_memory_merge(tmp_path, monkeypatch):
    """The folder merge keeps each matched input and each Fisher in files (one model in host memory
    at a time, for its backward pass) and writes what the in-memory merge computes; none of those
    files is left in OUT."""
    from transformers import AutoModelForCausalLM

    from hf_symmetry.conversion.merge import merge_checkpoints

    models = [tiny_model("llama", seed=s, dtype=torch.float32) for s in (0, 4)]
    paths = [_save(m, tmp_path / f"m{j}") for j, m in enumerate(models)]
    _word_tokenizer(paths[0])
    spilled = []
    real_write = merge_fisher.Spill.write
    monkeypatch.setattr(
        merge_fisher.Spill,
        "write",
        lambda self, name, fill: spilled.append((self.folder is not None, name)) or real_write(self, name, fill),
    )
    raw = {
        "merge_method": "fisher",
        "models": [str(p) for p in paths],
        "match": {"residual": True},
        "calibration": {"tokens": 256},
        "evaluation": False,
    }
    merge_checkpoints(recipe_from_dict(raw), tmp_path / "out", progress=False)
    assert spilled == [(True, "matched-0"), (True, "matched-1"), (True, "fisher-0"), (True, "fisher-1")]
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")] == [".hf-symmetry-files"]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()

    from hf_symmetry.calibration import calibration_ids
    from hf_symmetry.evaluation.compare import load_tokenizer

    ids = calibration_ids(load_tokenizer(paths[0]), "britannica-calib", 256)
    want = merge_state_dicts(
        [_sd(m) for m in models], models[0].config, recipe_from_dict(raw), calibration_ids=ids
    ).state_dict
    assert _close({k: v for k, v in want.items() if k in got}, got, 1e-5)


def test_fisher_merge_that_cannot_fit_is_refused_before_any_work(tmp_path, monkeypatch):
    """Fisher's backward pass needs the whole model: when weights, gradients and Fisher exceed the free
    memory of the GPUs and the host, the merge is refused in one line before matching or loading anything."""
    from hf_symmetry.conversion.merge import statistics as stats

    model = tiny_model("llama", dtype=torch.float32)
    monkeypatch.setattr(stats, "_available_memory", lambda: {"cpu": 10_000})
    monkeypatch.setattr(merge_fisher, "run_pair", lambda *a, **k: pytest.fail("matching started"))
    with pytest.raises(stats.FisherMemoryError, match="Fisher merging needs about .* GB .* only 0.0 GB is free") as exc:
        merge_state_dicts(
            [_sd(model)] * 2, model.config, _recipe("fisher", match={"residual": True}), calibration_ids=CALIB
        )
    assert "\n" not in str(exc.value) and isinstance(exc.value, ValueError)  # the CLI prints it as one line
    path = _save(model, tmp_path / "m")
    _word_tokenizer(path)
    assert (
        main(["merge", "--method", "fisher", str(path), str(path), str(tmp_path / "out"), "--quiet", "--no-verify"])
        == 2
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


# --------------------------------------------------------------------------- RegMean's memory-lean pass


def _textbook_regmean(weights, grams, model_weights, alpha):
    """RegMean written out (the form before the memory-lean solver): Wᵀ = (Σ w G̃)⁻¹ Σ w G̃ Wᵀ."""
    lhs, rhs = 0, 0
    for W, G, mw in zip(weights, grams, model_weights):
        G = alpha * G + (1 - alpha) * torch.diag(torch.diagonal(G))
        lhs = lhs + mw * G
        rhs = rhs + mw * G @ W.double().T
    return torch.linalg.solve(lhs, rhs).T


def test_regmean_group_and_row_block_solver_equal_the_textbook_formula():
    """One factorisation for the linears that share an input, Grams consumed one model at a time:
    bitwise the textbook result; the LM head's row blocks agree to rounding."""
    from hf_symmetry.conversion.merge.tensor_rules import RegMeanSolver, regmean_group

    gen = torch.Generator().manual_seed(3)
    X = [torch.randn(200, 24, generator=gen, dtype=torch.float64) for _ in range(3)]
    grams = [x.T @ x for x in X]
    q, k = ([torch.randn(rows, 24, generator=gen) for _ in range(3)] for rows in (30, 8))
    mw, alpha = [1.0, 2.0, 0.5], 0.7
    got = regmean_group(((G.clone(), [a, b]) for G, a, b in zip(grams, q, k)), mw, alpha)
    assert torch.equal(got[0], _textbook_regmean(q, grams, mw, alpha))
    assert torch.equal(got[1], _textbook_regmean(k, grams, mw, alpha))
    kept = [G.clone() for G in grams]
    assert torch.equal(regmean(q, grams, mw, alpha), got[0]) and all(map(torch.equal, grams, kept))  # not consumed
    head = [torch.randn(97, 24, generator=gen) for _ in range(3)]
    want = _textbook_regmean(head, grams, mw, alpha)
    solver = RegMeanSolver(grams, mw, alpha)
    assert torch.equal(solver.solve(head), want)  # one block
    blocks = torch.cat([solver.solve([h[r : r + 10] for h in head]) for r in range(0, 97, 10)])
    assert (blocks - want).abs().max() <= 1e-12 * want.abs().max()
    assert (_textbook_regmean(head, grams, mw, 1.0) - want).abs().max() > 1e-3 * want.abs().max()  # control


@pytest.mark.parametrize("match", [None, {}])
def test_streamed_regmean_of_checkpoints_equals_the_in_memory_merge(tmp_path, monkeypatch, match):
    """Through folders, RegMean reads each layer a group at a time, lets every input's Grams wait
    in files once its layer has run (the solver reads them back a block of rows at a time), and
    merges the embeddings and the LM head a block of rows at a time (blocks forced small here): the
    same tensors as the in-memory merge, which holds every Gram and reads each tensor whole."""
    from safetensors.torch import load_file

    from hf_symmetry.assets import resolve_text
    from hf_symmetry.text import read_text, tokenize_text
    from hf_symmetry.evaluation.compare import load_tokenizer

    models = [tiny_model("llama", seed=s, tie_word_embeddings=False) for s in (0, 7)]
    paths = []
    for j, m in enumerate(models):
        m.save_pretrained(tmp_path / f"m{j}")  # float64, so the comparison is exact
        paths.append(tmp_path / f"m{j}")
    _word_tokenizer(paths[0])
    spilled = []
    real_init = merge_stream.LayerGramSet.__init__

    def spy(self, grams, folder, *args, **kwargs):
        spilled.append(folder is not None)
        return real_init(self, grams, folder, *args, **kwargs)

    monkeypatch.setattr(merge_stream.LayerGramSet, "__init__", spy)
    monkeypatch.setattr(merge_stream, "BLOCK_ELEMENTS", 10 * models[0].config.hidden_size)  # 10 rows a block
    monkeypatch.setattr(tensor_rules, "GRAM_BLOCK_ELEMENTS", 500)  # a Gram read 6-10 rows at a time
    reads = []
    real_rows = merge_stream.StoredGram.rows
    monkeypatch.setattr(
        merge_stream.StoredGram,
        "rows",
        lambda self, start, stop: reads.append((stop - start, self.shape[0])) or real_rows(self, start, stop),
    )
    raw = {
        "merge_method": "regmean",
        "models": [str(p) for p in paths],
        "evaluation": False,
        "calibration": {"tokens": 600},
        **({"match": match} if match is not None else {}),
    }
    report = merge_module.merge_checkpoints(recipe_from_dict(raw), tmp_path / "out", progress=False)
    got = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
    assert not (tmp_path / "out" / ".merge-work").exists()
    # every input's Grams waited in files while the next input's layer ran and the layer was merged
    assert spilled.count(True) == models[0].config.num_hidden_layers * 2
    if match is None:  # the solver read them back a block of rows at a time, never whole
        assert reads and max(rows for rows, _ in reads) <= 10 and all(rows < n for rows, n in reads)
    else:  # matched: each Gram is carried into the anchor's frame whole
        assert not reads

    ids = tokenize_text(load_tokenizer(paths[0]), read_text(resolve_text("britannica-calib")), 600)
    want = merge_state_dicts([_sd(m) for m in models], models[0].config, recipe_from_dict(raw), calibration_ids=ids)
    assert set(got) == set(want.state_dict)
    for key, w in want.state_dict.items():
        if key == "lm_head.weight":  # solved in row blocks: the same to rounding
            assert (got[key] - w).abs().max() <= 1e-12 * w.abs().max()
        else:
            assert torch.equal(got[key], w), key
    if match is not None:  # the embeddings' distances summed block by block
        for name, d in want.outcome.distances.items():
            for kind in ("before", "after"):
                assert report.distances[name]["total"][kind] == pytest.approx(d["total"][kind], rel=1e-10)
