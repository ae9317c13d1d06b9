"""Streaming rotation on disk: sharded input, atomic output, bad input, reproducibility."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_symmetry import cli
from hf_symmetry.checkpoint_io import CheckpointReader, ShardedWriter
from hf_symmetry.conversion import rotate
from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint, rotate_state_dict
from hf_symmetry.testing import tiny_model

OPTIONS = RotateOptions(residual="hadamard", heads="random", ffn=True, scaling=True, seed=3)


@pytest.fixture
def tiny_llama_dir(tmp_path) -> Path:
    model = tiny_model("llama", dtype=torch.float32)
    out = tmp_path / "tiny-llama"
    model.save_pretrained(out, max_shard_size="40KB")  # several shards with an index
    model.generation_config.save_pretrained(out)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return reader.get(reader.keys())


def _digest(folder: Path) -> str:
    """Weights and config (the card records wall time, so it differs run to run)."""
    h = hashlib.sha256()
    for f in sorted([*folder.glob("*.safetensors"), *folder.glob("*.json")]):
        if f.name != "hf_symmetry_card.json":
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_sharded_checkpoint_rotates_like_the_in_memory_path(tiny_llama_dir, tmp_path):
    assert (tiny_llama_dir / "model.safetensors.index.json").exists()
    out = tmp_path / "out"
    rotate_checkpoint(tiny_llama_dir, out, OPTIONS, max_shard_size="30KB", progress=False)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    streamed = _tensors(out)
    in_memory, config = rotate_state_dict(
        _tensors(tiny_llama_dir), json.loads((tiny_llama_dir / "config.json").read_text()), OPTIONS
    )
    assert streamed.keys() == in_memory.keys()
    for k in streamed:
        assert torch.equal(streamed[k], in_memory[k]), k
    saved = json.loads((out / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False and config["tie_word_embeddings"] is False
    for side in ("generation_config.json", "tokenizer_config.json"):
        assert (out / side).read_bytes() == (tiny_llama_dir / side).read_bytes()


def test_rotated_folder_loads_as_stock_model_with_same_logits(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out = tmp_path / "out"
    rotate_checkpoint(tiny_llama_dir, out, OPTIONS, progress=False)
    a = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    b = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(b) is LlamaForCausalLM
    ids = torch.randint(2, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (a(ids).logits - b(ids).logits).abs().max().item() < 1e-4
    assert torch.equal(b.model.norm.weight, torch.ones_like(b.model.norm.weight))


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_llama_dir, tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        rotate_checkpoint(tiny_llama_dir, tmp_path / name, RotateOptions(seed=seed), progress=False)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")


def test_interrupted_run_leaves_no_output(tiny_llama_dir, tmp_path, monkeypatch):
    real = rotate.transform_layer

    def crash_on_second_layer(i, *args, **kwargs):
        if i == 1:
            raise RuntimeError("injected failure mid-write")
        return real(i, *args, **kwargs)

    monkeypatch.setattr(rotate, "transform_layer", crash_on_second_layer)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected"):
        rotate_checkpoint(tiny_llama_dir, out, OPTIONS, max_shard_size="10KB", progress=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]  # no temporary leftovers


def test_overwrite_replaces_only_on_success(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="--overwrite"):
        rotate_checkpoint(tiny_llama_dir, out, OPTIONS, progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    with pytest.raises(FileExistsError, match="'keep.txt', which hf-symmetry did not write"):
        rotate_checkpoint(tiny_llama_dir, out, OPTIONS, overwrite=True, progress=False)  # not ours to replace
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    rotate_checkpoint(tiny_llama_dir, out, OPTIONS, overwrite=True, progress=False)
    rotate_checkpoint(tiny_llama_dir, out, OPTIONS, overwrite=True, progress=False)  # what hf-symmetry wrote
    assert (out / "config.json").exists()


def test_low_precision_globals_are_rounded_once(tmp_path):
    """The embeddings of a bfloat16 checkpoint are folded and rotated a block of rows at a time in
    float64 and rounded once: the same bits as the whole float64 computation rounded at the end."""
    from hf_symmetry.symmetry import groups

    model = tiny_model("llama", dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # a final norm that really folds
    model = model.to(torch.bfloat16)
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    options = RotateOptions(residual="hadamard", heads="none", ffn=False, seed=5)
    rotate_checkpoint(src, tmp_path / "out", options, progress=False)
    got = _tensors(tmp_path / "out")
    sd = model.state_dict()
    Q = rotate.residual_rotation(options, model.config.hidden_size)
    gamma = sd["model.norm.weight"].double()
    embed = sd["model.embed_tokens.weight"].double()
    assert got["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.embed_tokens.weight"], (embed @ Q).to(torch.bfloat16))
    assert torch.equal(got["lm_head.weight"], ((embed * gamma) @ Q).to(torch.bfloat16))
    # negative control: rounding after the fold and again after the rotation gives other bits
    twice = ((embed * gamma).to(torch.bfloat16).double() @ Q).to(torch.bfloat16)
    assert not torch.equal(got["lm_head.weight"], twice)
    assert isinstance(Q, groups.RandomHadamard)


def test_actions_copy_plain_dicts_and_update_given_ones_in_place():
    from hf_symmetry.symmetry import actions

    layer = {"up.weight": torch.randn(6, 4), "gate.weight": torch.randn(6, 4), "down.weight": torch.randn(4, 6)}
    before = {k: v.clone() for k, v in layer.items()}
    perm = torch.tensor([2, 0, 1, 5, 4, 3])
    out = actions.permute_ffn(layer, perm)
    assert out is not layer and all(torch.equal(layer[k], before[k]) for k in layer)  # the caller's dict is intact
    given = actions.OwnedTensors(layer)
    same = actions.permute_ffn(given, perm)
    assert same is given and torch.equal(given["up.weight"], before["up.weight"][perm])
    assert all(torch.equal(out[k], given[k]) for k in out)


@pytest.mark.parametrize("reserve", [ShardedWriter.HEADER_RESERVE, 64], ids=["header-in-place", "header-copied"])
def test_writer_output_is_valid_safetensors(tmp_path, monkeypatch, reserve):
    """Both ways of writing the header (into the reserved region; behind-the-data copy when it
    does not fit) give files that safetensors reads back exactly, and sharding by size works."""
    from safetensors.torch import load_file

    monkeypatch.setattr(ShardedWriter, "HEADER_RESERVE", reserve)
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7),
        "c": torch.randn(4).to(torch.bfloat16),
        "d": torch.tensor(2.5, dtype=torch.float64),
        "e": torch.tensor([True, False]),
    }
    writer = ShardedWriter(tmp_path, max_shard_bytes=10**6, metadata={"k": "v"})
    writer.add(tensors)
    assert writer.close() == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no spool files left
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    writer = ShardedWriter(sharded, max_shard_bytes=64)
    writer.add({k: v for k, v in tensors.items() if k in "ab"})
    assert writer.close() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert torch.equal(load_file(str(sharded / "model-00002-of-00002.safetensors"))["b"], tensors["b"])


def test_writer_streams_row_blocks(tmp_path):
    """A :class:`RowBlocks` tensor (made a block of rows at a time, e.g. a low-rank embedding's row
    factor) is written as its blocks come, cast to its dtype, between whole tensors: the file holds
    exactly the tensor the blocks make. Blocks that do not add up to its rows are an error."""
    from hf_symmetry.checkpoint_io import RowBlocks

    W = torch.randn(10, 3, dtype=torch.float64)
    lazy = RowBlocks((10, 3), torch.float64, lambda: (W[i : i + 4] for i in range(0, 10, 4))).to(torch.float32)
    writer = ShardedWriter(tmp_path)
    writer.add({"a": torch.ones(2), "u": lazy, "z": torch.zeros(3)})
    writer.close()
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("u"), W.float()) and torch.equal(f.get_tensor("u"), lazy.materialise())
        assert torch.equal(f.get_tensor("a"), torch.ones(2)) and torch.equal(f.get_tensor("z"), torch.zeros(3))
    short = RowBlocks((10, 3), torch.float32, lambda: iter([W[:4]]))
    with pytest.raises(RuntimeError, match="gave 4 rows"):
        ShardedWriter(tmp_path / "x" if (tmp_path / "x").mkdir() is None else None).add({"u": short})


def test_row_blocks_along_another_dimension_and_permuted(tmp_path):
    """Row blocks along dimension 1 (a Kronecker factor ``[r, vocab, n2]``) are not contiguous pieces
    of the tensor: the writer makes them whole; permuted to ``[vocab, r, n2]`` (the module's layout)
    they are, and stream. Both files hold the tensor the blocks make."""
    from hf_symmetry.checkpoint_io import RowBlocks

    B = torch.randn(3, 10, 2, dtype=torch.float64)
    math = RowBlocks(B.shape, torch.float64, lambda: (B[:, i : i + 4] for i in range(0, 10, 4)), row_dim=1)
    module = math.permute(1, 0, 2)
    assert not math.streamable and module.streamable and module.row_dim == 0 and module.shape == (10, 3, 2)
    assert torch.equal(math.materialise(), B) and torch.equal(module.materialise(), B.permute(1, 0, 2))
    writer = ShardedWriter(tmp_path)
    writer.add({"math": math, "module": module})
    writer.close()
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("math"), B) and torch.equal(f.get_tensor("module"), B.permute(1, 0, 2))


# ----------------------------------------------------------------------------- CLI errors


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # drop whatever the fixtures printed
    code = cli.main(list(map(str, argv)))
    err = capsys.readouterr().err.strip()
    return code, err.splitlines()[-1] if err else ""


def test_cli_missing_model_path(capsys, tmp_path):
    code, err = _cli(capsys, "rotate", tmp_path / "nope", tmp_path / "out")
    assert code == 2 and err.startswith("hf-symmetry rotate: error:") and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_cli_unsupported_model_type(capsys, tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    src = tmp_path / "bloom"
    BloomForCausalLM(BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=20)).save_pretrained(src)
    code, err = _cli(capsys, "rotate", src, tmp_path / "out", "--no-verify")
    assert code == 2 and "unsupported model_type 'bloom'" in err and "llama" in err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_nonempty_out(capsys, tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    code, err = _cli(capsys, "rotate", tiny_llama_dir, out, "--no-verify")
    assert code == 2 and "--overwrite" in err


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_cli_corrupt_safetensors(capsys, tiny_llama_dir, tmp_path, damage):
    shard = sorted(tiny_llama_dir.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" if damage == "header" else data[:-100])
    code, err = _cli(capsys, "rotate", tiny_llama_dir, tmp_path / "out", "--no-verify")
    assert code == 2 and "corrupt safetensors" in err
    assert not (tmp_path / "out").exists()


def test_cli_refused_symmetry_is_one_line(capsys, tmp_path):
    src = tmp_path / "bert"
    tiny_model("bert", dtype=torch.float32).save_pretrained(src)
    code, err = _cli(capsys, "rotate", src, tmp_path / "out", "--no-verify")
    assert code == 2 and "post-LN" in err
    code, _ = _cli(capsys, "rotate", src, tmp_path / "out", "--no-verify", "--residual", "none", "--quiet")
    assert code == 0 and (tmp_path / "out" / "model.safetensors").exists()
