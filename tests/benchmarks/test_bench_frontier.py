"""benchmarks/bench_frontier.py's accounting: the KV cache from a config, the Pareto frontier, the best pipeline
at a budget, and quantization of weights whose input dimension is not a whole number of blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_frontier as bf  # noqa: E402

LLAMA = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def _config(tmp_path: Path, **extra) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    return tmp_path


def test_kv_elements_llama_farr_and_tpa(tmp_path):
    # SmolLM2: 30 layers x (keys + values) x 3 KV heads x head dim 64
    assert bf.kv_elements(_config(tmp_path)) == 30 * 2 * 3 * 64
    # FaRR: each layer's own value head dim (a cache sized from layer 0 alone would be 30 x 3 x (64 + 9))
    dims = [9] + [48] * 29
    farr = bf.kv_elements(_config(tmp_path, head_dim=64, v_head_dims=dims))
    assert farr == sum(3 * (64 + v) for v in dims)
    assert farr != 30 * 3 * (64 + 9)
    # TPA with non-contextual A: (R_K + R_V) x d_h per layer; contextual A adds the heads
    assert bf.kv_elements(_config(tmp_path, head_dim=64, k_rank=2, v_rank=2, contextual_a=False)) == 30 * 4 * 64
    assert bf.kv_elements(_config(tmp_path, head_dim=64, k_rank=2, v_rank=2, contextual_a=True)) == 30 * 4 * (64 + 9)


def _points(**rows):
    return {n: {"weight_bytes": b, "kv_bytes": 0, "perplexity": {"hamlet": p}} for n, (b, p) in rows.items()}


def test_frontier_and_best_at_a_budget():
    points = _points(big=(300, 30.0), mid=(150, 33.0), worse_mid=(160, 40.0), small=(100, 2900.0))
    assert bf.frontier(points, "hamlet") == ["small", "mid", "big"]  # worse_mid: bigger and worse than mid
    assert bf.best_at(points, "hamlet", 155) == "mid"
    assert bf.best_at(points, "hamlet", 120) == "small"
    assert bf.best_at(points, "hamlet", 99) is None
    assert bf.best_at(points, "britannica-eval", 1000) is None  # a text no point was measured on


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(100, 8, bias=False)  # 100 inputs: not a whole number of blocks of 32


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer()])
        self.head = torch.nn.Linear(8, 8, bias=False)  # outside the layers: stays in float


def test_quantize_pads_to_whole_blocks_and_counts_the_padded_size():
    from hf_symmetry.evaluation.weight_quant import quantizer

    torch.manual_seed(0)
    model = _Model()
    W = model.layers[0].proj.weight.detach().clone()
    head = model.head.weight.detach().clone()
    with pytest.raises(ValueError, match="groups of 32"):  # negative control: unpadded, the quantizer refuses
        quantizer("Q4_0").roundtrip(W)
    stored, what = bf.quantize_(model, "Q4_0")
    assert what["linears"] == 1 and what["padded"] == 1 and what["quantized_params"] == 800
    assert stored[model.layers[0].proj.weight.data_ptr()] == 8 * 128 * 4.5 / 8
    expected = quantizer("Q4_0").roundtrip(torch.nn.functional.pad(W, (0, 28)))[:, :100]
    assert torch.equal(model.layers[0].proj.weight.detach(), expected)
    assert not torch.equal(expected, W)  # the round trip changed the weight
    assert torch.equal(model.head.weight.detach(), head)
    # bytes: the quantized weight at its stored size, the head at 2 bytes per element
    assert bf.storage_bytes(model, stored, 2) == 8 * 128 * 4.5 / 8 + 64 * 2
