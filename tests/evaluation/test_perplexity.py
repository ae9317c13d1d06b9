"""Sliding-window perplexity: every token scored exactly once, with the right context."""

import math

import pytest
import torch

from hf_symmetry.evaluation.perplexity import perplexity


class _Recorder(torch.nn.Module):
    """A fake LM: uniform logits, records which (context, target) pairs it was asked about."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.windows = []

    def forward(self, input_ids):
        self.windows.append(input_ids[0].tolist())
        return type("Out", (), {"logits": torch.zeros(1, input_ids.shape[1], self.vocab)})()


@pytest.mark.parametrize("n,window,stride", [(1000, 128, 64), (1000, 128, 128), (130, 128, 32), (50, 128, 16)])
def test_each_token_scored_once(n, window, stride):
    model = _Recorder(vocab=11)
    ids = torch.arange(n) % 11
    r = perplexity(model, ids, window=window, stride=stride, progress=False)
    assert r.tokens == n and r.predicted == n - 1  # n tokens read, the first is context only
    assert math.isclose(r.perplexity, 11.0, rel_tol=1e-6)
    assert model.windows[-1][-1] == ids[-1].item()
    assert all(len(w) <= window for w in model.windows)


def test_perplexity_of_a_known_distribution():
    """A model that puts probability p on the true next token has perplexity 1/p."""
    vocab, p = 5, 0.6

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):
            nxt = (input_ids[0] + 1) % vocab
            logits = torch.full((input_ids.shape[1], vocab), math.log((1 - p) / (vocab - 1)))
            logits[torch.arange(input_ids.shape[1]), nxt] = math.log(p)
            return type("Out", (), {"logits": logits[None]})()

    r = perplexity(Oracle(), torch.arange(300) % vocab, window=64, stride=16, progress=False)
    assert math.isclose(r.perplexity, 1 / p, rel_tol=1e-5)


def test_bad_stride_is_refused():
    with pytest.raises(ValueError, match="stride"):
        perplexity(_Recorder(3), torch.arange(10) % 3, window=8, stride=9, progress=False)


@pytest.mark.slow
def test_eval_cli_on_default_model(capsys, smollm2, smollm2_tokenizer):
    from hf_symmetry import cli
    from hf_symmetry.assets import text_path
    from hf_symmetry.text import read_text, tokenize_text

    assert cli.main(["eval", "--max-tokens", "400", "--quiet"]) == 0
    out = capsys.readouterr().out
    ids = tokenize_text(smollm2_tokenizer, read_text(text_path("britannica-eval")), 400)
    expected = perplexity(smollm2, ids, progress=False).perplexity
    assert f"perplexity {expected:.6g} over the first 400 tokens, sliding window 512, stride 256" in out
    assert 5 < expected < 200  # a real model on real prose
