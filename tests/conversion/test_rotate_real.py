"""Rotation of real pretrained checkpoints: SmolLM2-135M (Llama, RoPE, GQA 9/3, tied
embeddings) and all-MiniLM-L6-v2 (BERT), on real text, in float32."""

import pytest
import torch

from hf_symmetry import cli
from hf_symmetry.conversion.rotate import RotateOptions, rotate_state_dict
from hf_symmetry.evaluation.compare import model_output

pytestmark = pytest.mark.slow


def _load_into(model, state_dict, config):
    new = type(model)(type(model.config).from_dict(config)).eval()
    assert not new.load_state_dict(state_dict, strict=True).missing_keys
    return new


def test_smollm2_per_head_symmetries_reach_float32_floor(smollm2, eval_ids):
    options = RotateOptions(residual="none", heads="random", ffn=True, scaling=True, seed=1)
    sd, cfg = rotate_state_dict(smollm2.state_dict(), smollm2.config, options)
    delta = (model_output(smollm2, eval_ids) - model_output(_load_into(smollm2, sd, cfg), eval_ids)).abs().max().item()
    print(f"SmolLM2 per-head + FFN + scaling: max |Δlogit| = {delta:.2e} over {eval_ids.numel()} tokens")
    assert delta <= 1e-3
    assert not torch.equal(
        sd["model.layers.3.self_attn.k_proj.weight"], smollm2.state_dict()["model.layers.3.self_attn.k_proj.weight"]
    )


def test_smollm2_rotated_by_cli_is_a_stock_llama_with_same_outputs(
    smollm2_dir, smollm2, smollm2_tokenizer, eval_ids, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out = tmp_path / "smollm2-rotated"
    assert (
        cli.main(
            [
                "rotate",
                str(smollm2_dir),
                str(out),
                "--residual",
                "hadamard",
                "--heads",
                "random",
                "--seed",
                "0",
                "--no-verify",
                "--quiet",
            ]
        )
        == 0
    )
    rotated = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no remote code
    assert type(rotated) is LlamaForCausalLM
    assert not rotated.config.tie_word_embeddings
    assert all(
        torch.equal(m.weight, torch.ones_like(m.weight)) for n, m in rotated.named_modules() if n.endswith("norm")
    )
    delta = (model_output(smollm2, eval_ids) - model_output(rotated, eval_ids)).abs().max().item()
    print(f"SmolLM2 residual Hadamard + heads + FFN: max |Δlogit| = {delta:.2e} over {eval_ids.numel()} tokens")
    assert delta <= 1e-3
    # the weights really are different
    w0 = smollm2.model.layers[0].self_attn.q_proj.weight
    assert (rotated.model.layers[0].self_attn.q_proj.weight - w0).abs().max() > 1e-2

    prompt = smollm2_tokenizer("The plays of Shakespeare", return_tensors="pt")
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=smollm2_tokenizer.eos_token_id)
    with torch.no_grad():
        a = smollm2.generate(**prompt, **kwargs)
        b = rotated.generate(**prompt, **kwargs)
    assert smollm2_tokenizer.decode(a[0]) == smollm2_tokenizer.decode(b[0])

    # the verify command agrees, end to end
    capsys.readouterr()
    assert (
        cli.main(
            ["verify", str(smollm2_dir), str(out), "--tokens", "128", "--ppl-tokens", "300", "--tolerance", "1e-3"]
        )
        == 0
    )
    assert "max |Δlogit|" in capsys.readouterr().out


def test_minilm_head_rotations_and_permutations_preserve_hidden_states(minilm_dir):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir).eval()
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    from hf_symmetry.assets import text_path

    batch = tok(text_path("britannica-eval").read_text()[:4000], return_tensors="pt", truncation=True, max_length=256)
    options = RotateOptions(residual="none", heads="random", ffn=True, scaling=True, seed=2)
    sd, cfg = rotate_state_dict(model.state_dict(), model.config, options)
    rotated = _load_into(model, sd, cfg)
    with torch.no_grad():
        h0 = model(**batch).last_hidden_state
        h1 = rotated(**batch).last_hidden_state
    delta = (h0 - h1).abs().max().item()
    print(f"MiniLM heads + FFN + scaling: max |Δhidden| = {delta:.2e} over {batch['input_ids'].numel()} tokens")
    assert delta <= 1e-3
