"""``rotate --for-quantization --target gguf-imatrix --write-imatrix`` (issue 39): the importance-matrix file has
llama-imatrix's GGUF layout, and its values are the second moments of the *converted* model (what llama-imatrix
would collect on it), not the original's; the scale search measures its error under llama-quantize's
importance-weighted quantizers."""

import json

import numpy as np
import torch

from hf_symmetry.conversion.quantization.imatrix import ROLES, gguf_name, read_imatrix, write_imatrix
from hf_symmetry.conversion.quantization.llamacpp import GGMLQuantizer, layer_quantizers, tensor_type
from hf_symmetry.conversion.quantization.scales import search_scales


def test_imatrix_file_has_llama_imatrix_layout(tmp_path):
    """KV ``general.type = imatrix``, ``imatrix.datasets/chunk_count/chunk_size``, no architecture; per weight an
    F32 ``in_sum2`` of ne ``[n, 1]`` and ``counts`` of ne ``[1, 1]``, in sorted name order; read back by the gguf
    package as in_sum2 / counts."""
    import gguf

    sums = np.array([4.0, 8.0, 1.0], dtype=np.float32)
    path = write_imatrix(tmp_path / "m.gguf", {"blk.1.ffn_up.weight": (sums, 4), "blk.0.attn_q.weight": (sums, 2)},
                         ["calib.txt"], 3, 512)  # fmt: skip
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in reader.fields
    assert reader.fields["imatrix.datasets"].contents() == ["calib.txt"]
    assert reader.fields["imatrix.chunk_count"].contents() == 3
    assert reader.fields["imatrix.chunk_size"].contents() == 512
    names = [t.name for t in reader.tensors]
    assert names == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts"] + [
        "blk.1.ffn_up.weight.in_sum2",
        "blk.1.ffn_up.weight.counts",
    ]
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight.in_sum2"] == [3, 1] and shapes["blk.0.attn_q.weight.counts"] == [1, 1]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    values, meta = read_imatrix(path)
    assert np.array_equal(values["blk.0.attn_q.weight"], sums / 2)
    assert np.array_equal(values["blk.1.ffn_up.weight"], sums / 4)


def test_written_imatrix_is_the_converted_models_second_moments(tmp_path, capsys):
    """The file ``--write-imatrix`` writes equals the calibration engine's ``E[x_j²]`` measured on the written
    checkpoint (every layer and linear, relative 1e-4), and differs from the original model's (negative control:
    the scales moved them), so ``llama-quantize --imatrix`` weighs the columns the search weighed."""
    from test_preset_cli import _tiny_folder
    from transformers import AutoTokenizer

    from hf_symmetry.calibration.data import calibration_ids
    from hf_symmetry.checkpoint_io import CheckpointReader
    from hf_symmetry.cli import main
    from hf_symmetry.conversion.quantization.scales import layer_stats

    src, text = _tiny_folder(tmp_path)
    out, imat = tmp_path / "out", tmp_path / "out.imatrix.gguf"
    argv = ["rotate", str(src), str(out), "--for-quantization", "--target", "gguf-imatrix", "--scales", "Q4_K_M"]
    argv += ["--calibration-text", str(text), "--calibration-tokens", "512", "--write-imatrix", str(imat)]
    assert main([*argv, "--no-verify", "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "warning:" in printed and str(imat) in printed
    values, meta = read_imatrix(imat)
    assert meta["chunk_size"] == 512 and meta["datasets"] == [str(text)] and meta["type"] == "imatrix"
    ids = calibration_ids(AutoTokenizer.from_pretrained(src), str(text), 512)

    def moments(folder):
        reader = CheckpointReader(folder)
        return layer_stats(reader, reader.config, ids)

    converted, original = moments(out), moments(src)
    assert len(values) == 7 * len(converted)
    worst, moved = 0.0, 0.0
    for i, (st, st0) in enumerate(zip(converted, original)):
        for lin, (_, site) in ROLES.items():
            want = st[site].diagonal().numpy()
            got = values[gguf_name(i, lin)]
            worst = max(worst, float(np.abs(got - want).max() / want.max()))
            moved = max(moved, float(np.abs(got - st0[site].diagonal().numpy()).max() / want.max()))
    assert worst < 1e-4, worst
    assert moved > 1e-2, moved
    params = json.loads((out / "hf_symmetry_card.json").read_text())["data"]["parameters"]
    assert params["target"] == "gguf-imatrix" and params["scales"] == "Q4_K_M"


def test_search_under_the_imatrix_quantizer_never_loses_to_no_scaling():
    """The gguf-imatrix search measures each α under llama-quantize's weighted quantizer with the scaled layer's own
    importance (diag(H)/s²); α = 0 is on the grid, so the chosen error never exceeds the unscaled one, and with a
    planted loud channel the search does scale."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 256, generator=g, dtype=torch.float64) * 0.05
    x = torch.randn(512, 256, generator=g, dtype=torch.float64)
    x[:, 9] *= 40
    H = x.T @ x / 512
    for qtype in ("Q4_0", "Q3_K", "Q4_K"):
        s, info = search_scales(W, H, GGMLQuantizer([(64, qtype)]))
        assert info["error"] <= info["unscaled"]
        if qtype != "Q4_K":  # (Q4_K's weighted search protects the loud column well enough here: α = 0)
            assert info["alpha"] > 0 and not torch.all(s == 1) and info["error"] < 0.9 * info["unscaled"], qtype
    unweighted = search_scales(W, H, GGMLQuantizer([(64, "Q4_0")], imatrix=False))[1]
    assert unweighted["unscaled"] > 3 * search_scales(W, H, GGMLQuantizer([(64, "Q4_0")]))[1]["unscaled"]


def test_the_mixture_gives_each_site_its_readers_types():
    """Q4_K_M on a 576-wide SmolLM2-like layer: q, k (and v off the more-bits layers) fall back to Q5_0, v of a
    more-bits layer is Q6_K -> Q8_0, down is Q6_K there; Q3_K_M's o is Q4_K -> Q5_0."""
    layer = {f"{n}.weight": torch.zeros(r, c) for n, r, c in
             [("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576), ("gate", 1536, 576),
              ("up", 1536, 576), ("down", 576, 1536)]}  # fmt: skip
    sites = layer_quantizers("Q4_K_M", layer, 0, 30, 3)
    assert sites["attn_norm"].segments == [(576, "Q5_0"), (192, "Q5_0"), (192, "Q8_0")]
    assert sites["down"].segments == [(576, "Q6_K")] and sites["ffn_norm"].segments == [(1536, "Q5_0")] * 2
    assert layer_quantizers("Q4_K_M", layer, 3, 30, 3)["down"].segments == [(576, "Q4_K")]
    assert tensor_type("Q3_K_M", "o", 5, 30, 576) == "Q5_0" and tensor_type("Q3_K_M", "o", 5, 30, 256) == "Q4_K"
    assert tensor_type("Q4_0", "down", 0, 30, 1536, imatrix=True) == "Q4_1"
    assert tensor_type("Q4_0", "down", 0, 30, 1536, imatrix=False) == "Q4_0"
