"""Publishing against a fake Hub on 127.0.0.1 (tests/fake_hub.py): push in one commit after the
isolated load check, then ``from_pretrained("user/repo", trust_remote_code=True)`` from that
server gives the recorded logits; refusals publish nothing.

Adding a model family to the round trip is one entry in ``FAMILIES``."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from fake_hub import FakeHub
from hf_symmetry.evaluation.compare import load_model
from hf_symmetry.hub import card_eval_results, write_card
from hf_symmetry.hub.push import push_folder

V = 61  # vocab of the tiny custom-family models


def _randomize(model, seed: int = 0):
    """O(1) weights so that logit differences mean something (HF init is ~0.02)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() >= 2 and "embed" not in name:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            else:
                p.copy_(0.5 * noise)
    return model.float().eval()


def tiny_tpa(**overrides):
    from hf_symmetry.modeling.configuration_tpa import TPAConfig
    from hf_symmetry.modeling.modeling_tpa import TPAForCausalLM

    return TPAForCausalLM(
        TPAConfig(
            **{
                **dict(
                    vocab_size=V,
                    hidden_size=30,
                    num_attention_heads=3,
                    head_dim=6,
                    num_hidden_layers=2,
                    q_rank=5,
                    k_rank=3,
                    v_rank=2,
                    intermediate_size=40,
                    max_position_embeddings=128,
                    pad_token_id=0,
                    bos_token_id=1,
                    eos_token_id=2,
                ),
                **overrides,
            }
        )
    )


def tiny_farr_llama():
    from hf_symmetry.modeling.configuration_farr import FarrLlamaConfig
    from hf_symmetry.modeling.modeling_farr import FarrLlamaForCausalLM

    return FarrLlamaForCausalLM(
        FarrLlamaConfig(
            vocab_size=V,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=40,
            max_position_embeddings=128,
            v_head_dims=[5, 3],
            o_bias=True,
        )
    )


def tiny_farr_bert():
    from hf_symmetry.modeling.configuration_farr import FarrBertConfig
    from hf_symmetry.modeling.modeling_farr import FarrBertModel

    return FarrBertModel(
        FarrBertConfig(
            vocab_size=V,
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=40,
            max_position_embeddings=64,
            qk_head_dims=[6, 8],
            v_head_dims=[5, 3],
        ),
        add_pooling_layer=False,
    )


def tiny_compressed_llama():
    from hf_symmetry.modeling.configuration_compressed_llama import LAYER_MODULES, CompressedLlamaConfig
    from hf_symmetry.modeling.modeling_compressed_llama import CompressedLlamaForCausalLM

    low = {
        m: ({"type": "lowrank", "rank": 4} if m in ("q_proj", "up_proj") else {"type": "dense"}) for m in LAYER_MODULES
    }
    return CompressedLlamaForCausalLM(
        CompressedLlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            skip_connections="orthogonal",
            layer_structures=[low, low],
        )
    )


def rotated_llama(tmp_path, rotated_dir):
    """A stock Llama rotated by ``hf-symmetry rotate`` (its card has exactness and perplexity)."""
    out = tmp_path / "rotated"
    shutil.copytree(rotated_dir, out)
    return out


def saved(factory, kind="generic"):
    """Folder builder for a model factory: save_pretrained plus a card."""

    def build(tmp_path, rotated_dir=None):
        model = _randomize(factory())
        out = tmp_path / "model"
        model.save_pretrained(out)
        write_card(out, kind, {"title": "tiny", "summary": "A tiny random model for the publishing tests."})
        return out

    return build


FAMILIES = {
    "rotated-llama": rotated_llama,
    "tpa": saved(tiny_tpa),
    "farr-llama": saved(tiny_farr_llama),
    "farr-bert": saved(tiny_farr_bert),  # an encoder: AutoModel, hidden states
    "compressed-llama": saved(tiny_compressed_llama),
}


# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with FakeHub(lifetime=900) as hub:
        yield hub


def _go_online(mp: pytest.MonkeyPatch, server: FakeHub, tmp_path) -> None:
    """The fake Hub as HF_ENDPOINT, with a valid token and online mode."""
    from huggingface_hub import constants

    mp.setenv("HF_ENDPOINT", server.url)
    mp.setenv("HF_TOKEN", server.token)
    mp.setattr(constants, "HF_HUB_OFFLINE", False)
    # huggingface_hub reads HF_ENDPOINT at import; downloads use these module constants
    mp.setattr(constants, "ENDPOINT", server.url)
    mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))


@pytest.fixture
def hub(server, monkeypatch, tmp_path):
    server.repos.clear()
    server.requests.clear()
    server.refuse_commits = False
    _go_online(monkeypatch, server, tmp_path)
    return server


@pytest.fixture(scope="module")
def rotated_push(server, smollm2_dir, tmp_path_factory):
    """Built once: a tiny Llama with the SmolLM2 tokenizer (so checks run on real text), rotated and
    published by ``hf-symmetry rotate ... --push-to-hub``: the card gets max |Δlogit| and the
    perplexity it measured, the load check runs, then the push."""
    from hf_symmetry.cli import main
    from hf_symmetry.testing import tiny_model

    tmp = tmp_path_factory.mktemp("rotated")
    base = tmp / "base"
    tiny_model("llama", dtype=torch.float32, vocab_size=49152).save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / f).is_file():
            shutil.copy(smollm2_dir / f, base / f)
    with pytest.MonkeyPatch.context() as mp:
        server.repos.clear()
        _go_online(mp, server, tmp)
        assert (
            main(
                [
                    "rotate",
                    str(base),
                    str(tmp / "rotated"),
                    "--quiet",
                    "--tokens",
                    "64",
                    "--ppl-tokens",
                    "128",
                    "--push-to-hub",
                    "user/rotated-cli",
                    "--json",
                    str(tmp / "rotate.json"),
                ]
            )
            == 0
        )
        repo = server.repos["user/rotated-cli"]
    return tmp / "rotated", json.loads((tmp / "rotate.json").read_text()), repo


@pytest.fixture(scope="module")
def rotated_dir(rotated_push):
    return rotated_push[0]


def test_rotate_with_push_to_hub_checks_then_publishes(rotated_push):
    folder, summary, repo = rotated_push
    push = summary["push"]
    assert push["repo_id"] == "user/rotated-cli" and len(repo.commits) == 1 and push["commit_oid"] == repo.sha
    assert (
        set(repo.files) == set(push["files"])
        and repo.files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    )
    check = push["check"]
    assert check["max_abs_diff"] == 0.0 and check["tokenizer"]  # same code, same weights
    (ppl,) = check["perplexities"]  # the card's figure, recomputed
    assert ppl["text"] == "britannica-eval" and ppl["recorded"] == summary["verification"]["perplexity_converted"]
    assert ppl["rel_diff"] <= 1e-6


def _logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.fixture(scope="module")
def published(server, rotated_dir, tmp_path_factory):
    """Every family pushed to the fake Hub and its local folder deleted; then all of them loaded
    back with ``from_pretrained(repo_id, trust_remote_code=True)`` in one Python where
    hf_symmetry cannot be imported (one interpreter start for all families)."""
    from hf_symmetry.hub.check import isolated_env, run_isolated_many

    tmp = tmp_path_factory.mktemp("published")
    rows = {}
    with pytest.MonkeyPatch.context() as mp:
        server.repos.clear()
        _go_online(mp, server, tmp)
        for family, build in FAMILIES.items():
            folder = build(tmp / family, rotated_dir)
            config = json.loads((folder / "config.json").read_text())
            ids = torch.randint(3, min(config["vocab_size"], 1000), (1, 20), generator=torch.Generator().manual_seed(1))
            recorded = _logits(load_model(folder), ids)
            other = _logits(_randomize(load_model(folder), seed=7), ids)  # negative control: another model
            # the isolated load check is the loader used below; it has its own tests
            result = push_folder(folder, f"user/{family}", check=False, progress=False)
            shutil.rmtree(folder)  # only the Hub has it now
            rows[family] = dict(
                config=config,
                ids=ids,
                recorded=recorded,
                other=other,
                result=result,
                repo=server.repos[f"user/{family}"],
            )
        server.requests.clear()
        work = tmp / "download"
        work.mkdir()
        env = isolated_env(work)
        env.update(HF_ENDPOINT=server.url, HF_TOKEN=server.token, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
        loaded = run_isolated_many([{"model": f"user/{f}", "ids": r["ids"][0]} for f, r in rows.items()], work, env)
        for (family, row), (facts, out) in zip(rows.items(), loaded):
            row.update(facts=facts, got=out.unsqueeze(0))
        requests = list(server.requests)
    return rows, requests


@pytest.mark.parametrize("family", list(FAMILIES))
def test_push_then_from_pretrained_gives_the_recorded_logits(family, published):
    rows, requests = published
    row = rows[family]
    repo, result, config = row["repo"], row["result"], row["config"]
    assert len(repo.commits) == 1 and result.commit_oid == repo.sha  # one commit, all files
    assert set(repo.files) == set(result.files)
    assert {"config.json", "model.safetensors", "README.md"} <= set(repo.files)
    assert "hf_symmetry_card.json" not in repo.files  # local record stays local
    for ref in (config.get("auto_map") or {}).values():  # the remote code travels
        assert f"{ref.rsplit('.', 1)[0]}.py" in repo.files

    assert ("GET", f"/user/{family}/resolve/{repo.sha}/model.safetensors") in requests
    assert row["facts"]["hf_symmetry_importable"] is False
    if config.get("auto_map"):
        assert row["facts"]["class"].startswith("transformers_modules."), row["facts"]["class"]
    assert (row["got"] - row["recorded"]).abs().max().item() <= 1e-6
    assert (row["got"] - row["other"]).abs().max().item() > 1e-2


def test_rotated_card_on_the_hub_round_trips(hub, tmp_path, rotated_dir):
    from huggingface_hub import ModelCard, hf_hub_download
    from huggingface_hub.repocard_data import model_index_to_eval_results

    folder = rotated_llama(tmp_path, rotated_dir)
    record = json.loads((folder / "hf_symmetry_card.json").read_text())["data"]
    push_folder(folder, "user/rot-card", private=True, check=False, progress=False)
    assert hub.repos["user/rot-card"].private
    with pytest.raises(Exception, match="Repository Not Found|RepoNotFound|404"):  # private: no token, no card
        hf_hub_download("user/rot-card", "README.md", cache_dir=str(tmp_path / "anon"), token=False)
    readme = hf_hub_download("user/rot-card", "README.md", cache_dir=str(tmp_path / "c"))
    card = ModelCard.load(readme)
    assert card.data.hf_symmetry["method"] == "rotate"
    assert card.data.hf_symmetry["exactness"]["max_abs_dlogit"] == record["exactness"]["max_abs_dlogit"]
    name, results = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert name == "user/rot-card"
    (ppl,) = results
    assert ppl.metric_type == "perplexity" and ppl.metric_value == record["exactness"]["perplexity_converted"]
    assert str(tmp_path) not in card.content  # no local paths published


# -------------------------------------------------------------------------------- refusals
def test_refused_commit_publishes_nothing(hub, tmp_path, rotated_dir):
    folder = saved(tiny_tpa)(tmp_path, rotated_dir)
    hub.refuse_commits = True
    with pytest.raises(ValueError, match="refused the commit.*nothing was published"):
        push_folder(folder, "user/refused", check=False, progress=False)
    assert "user/refused" not in hub.repos  # the repo this push created is gone again
    assert any(p.endswith("/commit/main") for _, p in hub.requests)

    hub.refuse_commits = False  # an existing repo keeps its history untouched
    push_folder(folder, "user/refused", check=False, progress=False)
    first = hub.repos["user/refused"].sha
    hub.refuse_commits = True
    with pytest.raises(ValueError, match="refused the commit"):
        push_folder(folder, "user/refused", check=False, progress=False)
    assert len(hub.repos["user/refused"].commits) == 1 and hub.repos["user/refused"].sha == first


def test_missing_token_fails_before_any_work(hub, monkeypatch, tmp_path, rotated_dir):
    from hf_symmetry.cli import main

    monkeypatch.delenv("HF_TOKEN")
    folder = saved(tiny_tpa)(tmp_path, rotated_dir)
    before = (folder / "README.md").read_text()
    with pytest.raises(ValueError, match="no Hugging Face token"):
        push_folder(folder, "user/x", progress=False)
    assert hub.requests == [] and hub.repos == {}
    assert (folder / "README.md").read_text() == before  # not even the card was touched
    # a conversion with --push-to-hub refuses while parsing, before converting anything
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main(["rotate", str(folder), str(out), "--push-to-hub", "user/x"])
    assert exc.value.code == 2 and not out.exists()


def test_folder_that_does_not_load_is_not_published(hub, tmp_path, rotated_dir):
    folder = saved(tiny_tpa)(tmp_path, rotated_dir)
    # the shipped modeling code needs hf_symmetry: it loads here, but not for anyone else
    modeling = folder / "modeling_tpa.py"
    modeling.write_text("import hf_symmetry.modeling  # noqa\n" + modeling.read_text())
    with pytest.raises(ValueError, match="does not load without hf_symmetry"):
        push_folder(folder, "user/broken", progress=False)
    assert hub.repos == {} and not any(p.startswith("/api/repos") for _, p in hub.requests)


def test_bad_input_is_refused_clearly(hub, tmp_path, rotated_dir):
    folder = saved(tiny_tpa)(tmp_path, rotated_dir)
    with pytest.raises(ValueError, match="repo id"):
        push_folder(folder, "no-namespace", progress=False)
    (folder / "extra.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ValueError, match="pickled"):
        push_folder(folder, "user/x", progress=False)
    (folder / "extra.bin").unlink()
    (folder / "modeling_tpa.py").unlink()
    with pytest.raises(FileNotFoundError, match="modeling_tpa.py"):
        push_folder(folder, "user/x", progress=False)
    assert hub.repos == {}


def test_eval_results_from_push_land_in_the_card(hub, tmp_path, rotated_dir):
    """push --eval-text: the card on the Hub carries exactly the perplexity the evaluation gave."""
    from huggingface_hub import ModelCard, hf_hub_download

    from hf_symmetry.cli import main

    folder = rotated_llama(tmp_path, rotated_dir)
    text = tmp_path / "sample.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "push.json"
    # (the load check, which recomputes recorded perplexities, has its own tests above and below)
    assert (
        main(["push", str(folder), "user/evald", "--eval-text", str(text), "--no-check", "--quiet", "--json", str(out)])
        == 0
    )
    pushed = json.loads(out.read_text())
    (entry,) = pushed["eval_results"]
    card = ModelCard.load(hf_hub_download("user/evald", "README.md", cache_dir=str(tmp_path / "c")))
    on_hub = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert on_hub[("sample.txt (local text)", "perplexity")] == entry["metric_value"]
    assert len(on_hub) == 2  # plus the verification perplexity
    assert card_eval_results(folder)[-1].metric_value == entry["metric_value"]  # the local card too


def test_check_refuses_a_card_whose_figures_do_not_reproduce(hub, tmp_path, rotated_dir):
    """Negative control of the check's comparison with the recorded figures."""
    folder = rotated_llama(tmp_path, rotated_dir)
    record_path = folder / "hf_symmetry_card.json"
    record = json.loads(record_path.read_text())
    record["data"]["eval_results"][0]["metric_value"] *= 1.01
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="perplexity on britannica-eval .* but the card records"):
        push_folder(folder, "user/tampered", progress=False)
    assert hub.repos == {}
