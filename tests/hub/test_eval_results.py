"""The evaluation bridge: perplexity on a local text and lm-eval on local task files (offline),
with the numbers the evaluation produced landing unchanged in the model card."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_symmetry.assets import text_path
from hf_symmetry.cli import main
from hf_symmetry.evaluation.bridge import SMOKE_TASK, write_smoke_task
from hf_symmetry.text import read_text
from hf_symmetry.hub import card_eval_results


@pytest.fixture(scope="module")
def lm_folder(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer: real tokens, millisecond forwards."""
    from hf_symmetry.testing import tiny_model

    folder = tmp_path_factory.mktemp("eval") / "tiny-lm"
    tiny_model("llama", dtype=torch.float32, vocab_size=49152).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / f).is_file():
            shutil.copy(smollm2_dir / f, folder / f)
    return folder


def test_smoke_task_is_arc_easy_format_built_from_local_text(tmp_path):
    task_dir = write_smoke_task(tmp_path / "tasks", "britannica-eval", n=12, seed=1)
    items = [json.loads(line) for line in (task_dir / f"{SMOKE_TASK}.jsonl").read_text().splitlines()]
    source = " ".join(read_text(text_path("britannica-eval")).split())
    assert len(items) == 12
    for item in items:
        assert item["choices"]["label"] == ["A", "B", "C", "D"] and len(set(item["choices"]["text"])) == 4
        answer = item["choices"]["text"][item["choices"]["label"].index(item["answerKey"])]
        assert f"{item['question']} {answer}" in source  # the key is the true continuation
        wrong = [t for t in item["choices"]["text"] if t != answer]
        assert all(f"{item['question']} {t}" not in source for t in wrong)
    assert sorted({i["answerKey"] for i in items}) != ["A"]  # the key is not always in one place
    yaml_text = (task_dir / f"{SMOKE_TASK}.yaml").read_text()
    assert "not a benchmark" in yaml_text and "NOT ARC-Easy" in yaml_text


def test_eval_perplexity_goes_into_the_card_unchanged(lm_folder, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(lm_folder, folder)
    text = tmp_path / "prose.txt"
    text.write_text(" ".join(read_text(text_path("britannica-eval")).split()[:300]))
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                str(folder),
                "--text",
                str(text),
                "--window",
                "64",
                "--stride",
                "32",
                "--update-card",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    (result,) = card_eval_results(folder)
    assert result.metric_type == "perplexity" and result.metric_value == summary["perplexity"]
    assert result.dataset_args == {
        "text": "prose.txt",
        "window": 64,
        "stride": 32,
        "tokens": summary["tokens"],
        "max_tokens": 2048,  # the bounded default
        "text_sha256": result.dataset_args["text_sha256"],
    }


def test_bad_eval_arguments_are_refused_before_loading(lm_folder, tmp_path, capsys):
    assert main(["eval", str(lm_folder), "--tasks", "x", "--task-dir", str(tmp_path / "nope")]) == 2
    assert "task folder" in capsys.readouterr().err
    assert main(["eval", "default", "--update-card"]) == 2
    assert "--update-card needs MODEL to be a model folder" in capsys.readouterr().err


def test_lm_eval_scores_go_into_the_card_unchanged(lm_folder, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'hf_symmetry[eval]')")
    folder = tmp_path / "m"
    shutil.copytree(lm_folder, folder)
    tasks = write_smoke_task(tmp_path / "tasks", "britannica-eval", n=8)
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                str(folder),
                "--tasks",
                SMOKE_TASK,
                "--task-dir",
                str(tasks),
                "--limit",
                "6",
                "--update-card",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    produced = json.loads(out.read_text())["lm_eval"][SMOKE_TASK]
    card = {r.metric_type: r for r in card_eval_results(folder)}
    assert set(card) == {"acc", "acc_norm"}
    for metric in ("acc", "acc_norm"):
        assert card[metric].metric_value == produced[f"{metric},none"]
        assert 0.0 <= card[metric].metric_value <= 1.0
        # labelled as what it is: local smoke data, never ARC-Easy
        assert card[metric].dataset_type == f"local/{SMOKE_TASK}" and "not a benchmark" in card[metric].dataset_name
        assert card[metric].dataset_args["samples"] == 6
        assert card[metric].source_name.startswith("lm-evaluation-harness")
