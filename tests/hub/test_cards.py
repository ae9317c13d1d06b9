"""Model cards: rendered from model_cards/<kind>.md, metadata that huggingface_hub's own parsers
read back unchanged, measured sizes, lineage, and updates that keep what they should."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import EvalResult, ModelCard, metadata_load
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

from hf_symmetry.hub import card_eval_results, template_dir, update_card, write_card
from hf_symmetry.hub.cards import kv_cache_bytes_per_token, measure_folder, perplexity_result
from hf_symmetry.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]

LM_EVAL_ENTRY = {
    "task_type": "multiple-choice",
    "task_name": "arc_easy",
    "dataset_type": "allenai/ai2_arc",
    "dataset_name": "arc_easy",
    "dataset_config": "ARC-Easy",
    "dataset_split": "test",
    "metric_type": "acc_norm",
    "metric_value": 0.4375,
    "source_name": "lm-evaluation-harness 0.4.13",
    "source_url": "https://github.com/EleutherAI/lm-evaluation-harness",
    "notes": "25 examples",
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("card") / "tiny-llama"
    tiny_model("llama", dtype=torch.float32).save_pretrained(folder)
    return folder


def _fresh(tiny_folder, tmp_path):
    import shutil

    out = tmp_path / tiny_folder.name
    shutil.copytree(tiny_folder, out)
    return out


def test_metadata_round_trips_through_huggingface_hub_parsers(tiny_folder, tmp_path):
    folder = _fresh(tiny_folder, tmp_path)
    text = tmp_path / "eval.txt"
    text.write_text("Some held-out prose.\n")
    ppl = perplexity_result(12.345678901234, text, max_tokens=2048, window=512, stride=256, tokens=2047)
    write_card(
        folder,
        "rotate",
        {
            "inputs": ["default"],
            "parameters": {"residual": "hadamard"},
            "seed": 3,
            "exactness": {"max_abs_dlogit": 3.1e-5, "tokens": 512, "text": str(text)},
            "eval_results": [ppl, LM_EVAL_ENTRY],
            "repo_id": "user/tiny-rot",
        },
    )
    card = ModelCard.load(folder / "README.md")
    meta = card.data
    assert meta.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # lineage from the embedded asset
    assert meta.library_name == "transformers" and "hf_symmetry-rotate" in meta.tags
    assert meta.hf_symmetry["seed"] == 3 and meta.hf_symmetry["parameters"] == {"residual": "hadamard"}
    assert meta.hf_symmetry["exactness"]["max_abs_dlogit"] == 3.1e-5
    # model-index, parsed by huggingface_hub, carries the numbers exactly
    name, results = model_index_to_eval_results(meta.to_dict()["model-index"])
    assert name == "user/tiny-rot"
    by_metric = {r.metric_type: r for r in results}
    assert by_metric["perplexity"].metric_value == 12.345678901234
    assert by_metric["perplexity"].dataset_args["text"] == "eval.txt"
    assert by_metric["acc_norm"] == EvalResult(**{k: v for k, v in LM_EVAL_ENTRY.items() if k != "notes"})
    assert eval_results_to_model_index(name, results) == meta.to_dict()["model-index"]
    assert metadata_load(folder / "README.md")["hf_symmetry"]["size"] == meta.hf_symmetry["size"]
    assert card_eval_results(folder) == results
    # the body says it too, and no local path leaks into what gets published
    assert "3.10e-05" in card.text and "12.3457" in card.text and "| arc_easy |" in card.text
    assert str(tmp_path) not in card.content
    assert "_text_path" not in card.content
    # the local record keeps what re-rendering needs
    record = json.loads((folder / "hf_symmetry_card.json").read_text())
    assert record["kind"] == "rotate" and str(tmp_path) not in json.dumps(record)  # no local path, even locally
    from hf_symmetry.hub.cards import remembered_texts  # the text is found again by its sha256 (user cache)

    sha = record["data"]["eval_results"][0]["dataset_args"]["text_sha256"]
    assert str(text.resolve()) in remembered_texts(sha)


def test_kind_template_with_generic_fallback(tiny_folder, tmp_path):
    folder = _fresh(tiny_folder, tmp_path)
    write_card(folder, "rotate", {"extra": {"applied": ["qk_rotation"]}})
    assert "functionally equivalent re-parametrisation" in (folder / "README.md").read_text()
    write_card(folder, "no-such-kind", {"summary": "Custom summary."})
    body = (folder / "README.md").read_text()
    assert "Custom summary." in body and "re-parametrisation" not in body
    assert ModelCard.load(folder / "README.md").data.hf_symmetry["kind"] == "no-such-kind"
    with pytest.raises(ValueError, match="card kind"):
        write_card(folder, "../etc", {})


def test_size_figures_are_measured(tiny_folder):
    size = measure_folder(tiny_folder)
    model = tiny_model("llama", dtype=torch.float32)
    cfg = model.config
    assert size["parameters"] == sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert size["bytes"] == (tiny_folder / "model.safetensors").stat().st_size
    assert size["dtype"] == "float32"
    assert size["kv_cache_bytes_per_token"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    # encoders have no KV cache; unknown custom families report their own
    assert (
        kv_cache_bytes_per_token(
            {
                "model_type": "bert",
                "architectures": ["BertModel"],
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "hidden_size": 8,
            },
            4,
        )
        is None
    )
    assert (
        kv_cache_bytes_per_token(
            {
                "model_type": "hf_symmetry_new",
                "architectures": ["XForCausalLM"],
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "hidden_size": 8,
            },
            4,
        )
        is None
    )


def _measured_cache_bytes_per_token(model, tokens: int = 7) -> float:
    """What the model's cache really holds per token after a forward pass."""
    ids = torch.randint(3, 50, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    if hasattr(cache, "cached_elements"):  # TPA: factor cache
        elements = cache.cached_elements()["per_token"]
    else:
        elements = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    return elements * 4 / tokens


@pytest.mark.parametrize("family", ["llama", "tpa", "tpa-noncontextual", "farr-llama", "compressed-llama"])
def test_kv_cache_figure_matches_what_the_cache_holds(family):
    from test_push import tiny_compressed_llama, tiny_farr_llama, tiny_tpa

    model = (
        {
            "llama": lambda: tiny_model("llama", dtype=torch.float32),
            "tpa": tiny_tpa,
            "tpa-noncontextual": lambda: tiny_tpa(contextual_a=False),
            "farr-llama": tiny_farr_llama,
            "compressed-llama": tiny_compressed_llama,
        }[family]()
        .float()
        .eval()
    )
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}  # as save_pretrained writes
    assert kv_cache_bytes_per_token(config, 4) == _measured_cache_bytes_per_token(model)


def test_size_override_and_plots(tiny_folder, tmp_path):
    folder = _fresh(tiny_folder, tmp_path)
    (folder / "spectra.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    write_card(
        folder,
        "generic",
        {
            "size": {"kv_cache_bytes_per_token": 123, "attention_parameters": 4567},
            "plots": [{"path": "spectra.png", "caption": "FaRR spectra"}],
        },
    )
    card = ModelCard.load(folder / "README.md")
    assert card.data.hf_symmetry["size"]["kv_cache_bytes_per_token"] == 123
    assert "![FaRR spectra](spectra.png)" in card.text and "| attention parameters | 4,567 |" in card.text
    with pytest.raises(FileNotFoundError, match="missing.png"):
        write_card(folder, "generic", {"plots": ["missing.png"]})


def test_update_card_replaces_the_same_metric_and_keeps_the_rest(tiny_folder, tmp_path):
    folder = _fresh(tiny_folder, tmp_path)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("aaa\n")
    b.write_text("bbb\n")
    write_card(folder, "rotate", {"seed": 1, "eval_results": [perplexity_result(10.0, a), LM_EVAL_ENTRY]})
    update_card(folder, eval_results=[perplexity_result(9.5, a), perplexity_result(20.0, b)], repo_id="user/x")
    got = {(r.dataset_name, r.metric_type): r.metric_value for r in card_eval_results(folder)}
    assert got == {
        ("a.txt (local text)", "perplexity"): 9.5,
        ("b.txt (local text)", "perplexity"): 20.0,
        ("arc_easy", "acc_norm"): 0.4375,
    }
    card = ModelCard.load(folder / "README.md")
    assert card.data.hf_symmetry["seed"] == 1  # the conversion facts stay
    assert 'from_pretrained("user/x")' in card.text  # usage names the repo now


def test_update_keeps_a_foreign_readme_text(tiny_folder, tmp_path):
    folder = _fresh(tiny_folder, tmp_path)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n\n# My model\n\nHand-written words.\n")
    update_card(folder, eval_results=[LM_EVAL_ENTRY])
    card = ModelCard.load(folder / "README.md")
    assert card.data.license == "mit" and "Hand-written words." in card.text
    assert [r.metric_value for r in card.data.eval_results] == [0.4375]


def test_lineage_follows_a_chain_of_conversions(tiny_folder, tmp_path):
    first = _fresh(tiny_folder, tmp_path / "a")
    write_card(first, "rotate", {"inputs": ["default"]})
    second = _fresh(tiny_folder, tmp_path / "b")
    write_card(second, "generic", {"inputs": [str(first), "org/other-model"]})
    meta = ModelCard.load(second / "README.md").data
    assert meta.base_model == ["HuggingFaceTB/SmolLM2-135M-Instruct", "org/other-model"]
    # inputs are named as they are (a local folder by its name); lineage goes to base_model
    assert meta.hf_symmetry["inputs"] == [first.name, "org/other-model"]
    third = _fresh(tiny_folder, tmp_path / "c")
    write_card(third, "generic", {"inputs": [str(tmp_path / "nowhere")]})  # unknown origin: named, not linked
    meta = ModelCard.load(third / "README.md").data
    assert meta.base_model is None and meta.hf_symmetry["inputs"] == ["nowhere"]


def test_templates_ship_with_the_package():
    """One set of templates: inside the package (found by editable installs and wheels alike),
    with the repo-root model_cards/ pointing at it."""
    assert template_dir() == ROOT / "hf_symmetry" / "model_cards"
    assert {"generic.md", "rotate.md"} <= {p.name for p in template_dir().glob("*.md")}
    assert (ROOT / "model_cards").resolve() == template_dir()
    assert 'hf_symmetry = ["model_cards/*.md"]' in (ROOT / "pyproject.toml").read_text()  # package data
