"""heal's symmetry-aware layer targets (the conversions' layer maps) and its cached teacher samples.

Tiny stock Llama teacher on a real byte-level tokenizer, converted by the real conversions
(compress --structure slice at full width, to-tpa at full rank, FaRR at τ = 1): at zero distortion
the per-layer loss through the recorded map is 0 to float round-off; a wrong map (another rotation,
a permuted layer) gives a clearly positive loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from heal_models import byte_tokenizer, tiny  # noqa: E402

from hf_symmetry.assets import resolve_text  # noqa: E402
from hf_symmetry.calibration import CalibrationText  # noqa: E402
from hf_symmetry.conversion.layer_map import MAP_FILE, LayerMap, read_layer_map  # noqa: E402
from hf_symmetry.training.distill import layer_outputs, layer_state_loss  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny 4-layer Llama teacher (float64, peaked), its training/calibration text, and its conversions."""
    root = tmp_path_factory.mktemp("heal-layers")
    tok = byte_tokenizer()
    import transformers as T

    from heal_models import COMMON

    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=len(tok),
        **{**COMMON, "num_hidden_layers": 4},
        initializer_range=0.1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    teacher = T.LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # non-trivial norms: folding them is part of what the map must get right
        for n, p in teacher.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    text = resolve_text("britannica-calib").read_text(encoding="utf-8")[:24_000]
    (root / "train.txt").write_text(text, encoding="utf-8")
    return root


def _ids(n=3, seed=0):
    return torch.randint(0, 256, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _states(model, ids):
    with torch.no_grad(), layer_outputs(model) as states:
        model(input_ids=ids, use_cache=False)
    return list(states)


def _load(folder):
    import hf_symmetry  # noqa: F401
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def _loss(student_dir, teacher_dir, layer_map=None, permute=False):
    ids = _ids()
    s, t = _states(_load(student_dir), ids), _states(_load(teacher_dir), ids)
    if permute:
        t = t[1:] + t[:1]
    return layer_state_loss(s, t, layer_map or read_layer_map(student_dir)).item()


@pytest.fixture(scope="module")
def sliced(root):
    from hf_symmetry.conversion.compress import CompressOptions, compress_checkpoint
    from hf_symmetry.conversion.compress import plan as plan_module

    out = root / "slice-full"
    with pytest.MonkeyPatch.context() as mp:  # SliceGPT at full width: its PCA rotation alone, exact
        mp.setattr(plan_module, "nearest_width", lambda params, target, widths: max(widths))
        compress_checkpoint(
            root / "teacher",
            out,
            CompressOptions(structure="slice", ratio=0.01, ratio_slack=1.0),
            CalibrationText(root / "train.txt", tokens=2048, seq_len=64),
            progress=False,
        )
    return out


@pytest.fixture(scope="module")
def tpa(root):
    from hf_symmetry.conversion.to_tpa import convert_checkpoint_to_tpa

    out = root / "tpa-full"
    report = convert_checkpoint_to_tpa(root / "teacher", out, progress=False)
    assert report.exact
    return out


def test_full_width_slicing_has_zero_layer_loss_and_a_wrong_rotation_does_not(root, sliced):
    m = read_layer_map(sliced)
    assert m.kind == "rotation" and m.num_layers == 4 and m.hidden_size == 32
    assert len(m.bases) == 1 and set(m.layer_width) == {32}  # one global Q, full width
    Q = m.bases[0].double()
    assert torch.allclose(Q.T @ Q, torch.eye(32, dtype=torch.float64), atol=1e-5)
    assert not torch.allclose(Q.abs(), torch.eye(32, dtype=torch.float64), atol=0.1)  # a real rotation
    assert _loss(sliced, root / "teacher") < 1e-10
    # negative controls: another rotation, and the right map on the wrong layers
    other = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    wrong = LayerMap("rotation", 32, [0] * 4, [32] * 4, [other.float()])
    assert _loss(sliced, root / "teacher", wrong) > 0.3
    assert _loss(sliced, root / "teacher", LayerMap.identity(4, 32)) > 0.3
    assert _loss(sliced, root / "teacher", permute=True) > 0.05
    # the map is no parameter: the card and report count the weights only
    from hf_symmetry.hub.cards import count_stored_parameters

    model = _load(sliced)
    assert count_stored_parameters(sliced) == sum(p.numel() for p in model.parameters())


def test_per_segment_rotations_map_each_layer_through_its_own_segment(root):
    """SliceGPT with one PCA per residual segment, at full width: exact (dense skips), and every layer
    has its own rotation — the map must pick the segment the layer writes (2l + 2), not a neighbour."""
    from hf_symmetry.conversion.compress import CompressOptions, compress_checkpoint
    from hf_symmetry.conversion.compress import plan as plan_module

    out = root / "slice-segments"
    with pytest.MonkeyPatch.context() as mp:  # the widest SliceGPT plan: full width
        mp.setattr(plan_module, "nearest_width", lambda params, target, widths: max(widths))
        compress_checkpoint(
            root / "teacher",
            out,
            CompressOptions(structure="slice", q_mode="segment", ratio=0.01, ratio_slack=1.0),
            CalibrationText(root / "train.txt", tokens=2048, seq_len=64),
            progress=False,
        )
    m = read_layer_map(out)
    assert len(m.bases) == 4 and m.layer_basis == [0, 1, 2, 3]
    assert _loss(out, root / "teacher") < 1e-10
    shifted = LayerMap("rotation", 32, [1, 2, 3, 0], m.layer_width, m.bases)  # a neighbour's rotation
    assert _loss(out, root / "teacher", shifted) > 0.3


def test_full_rank_tpa_has_zero_layer_loss_and_a_permuted_layer_does_not(root, tpa):
    m = read_layer_map(tpa)
    assert m.kind == "identity" and m.num_layers == 4
    assert _loss(tpa, root / "teacher") < 1e-10
    assert _loss(tpa, root / "teacher", permute=True) > 0.05


def test_full_rank_farr_has_zero_layer_loss(root):
    from hf_symmetry.conversion.farr import FarrOptions, farr_checkpoint

    out = root / "farr-full"
    farr_checkpoint(root / "teacher", out, FarrOptions(tau=1.0), progress=False)
    assert read_layer_map(out).kind == "identity"
    assert _loss(out, root / "teacher") < 1e-10
    assert _loss(out, root / "teacher", permute=True) > 0.05


def test_a_lossy_slice_records_its_narrower_width(root):
    from hf_symmetry.conversion.compress import CompressOptions, compress_checkpoint

    out = root / "slice-25"
    compress_checkpoint(
        root / "teacher",
        out,
        CompressOptions(structure="slice", ratio=0.25, ratio_slack=1.0),
        CalibrationText(root / "train.txt", tokens=2048, seq_len=64),
        progress=False,
    )
    m = read_layer_map(out)
    w = m.layer_width[0]
    assert w < 32 and m.bases[0].shape == (32, w)
    lossy = _loss(out, root / "teacher")
    assert 0 < lossy < _loss(out, root / "teacher", permute=True)


# ----------------------------------------------------------------------------- heal with layer targets
def _heal(root, student, out, **kw):
    from hf_symmetry.training.heal import HealJob, HealOptions, heal_checkpoint

    opts = dict(
        tokens=8 * SEQ * 4, seq_len=SEQ, batch_size=8, lora_rank=4, lr=3e-2, validation_fraction=0.1, save_steps=100
    )
    opts["teacher_sample_fraction"] = 0.0  # text only unless a test asks (the default: test_default_heal_...)
    return heal_checkpoint(
        HealJob(
            student,
            out,
            root / "teacher",
            [root / "train.txt"],
            HealOptions(**{**opts, **kw}),
            progress=False,
            device="cpu",
            eval_texts=None,
            heldout_kl_sequences=4,
        )
    )


def test_heal_distils_the_layer_states_through_the_map(root, tmp_path):
    from hf_symmetry.conversion.to_tpa import ToTPAOptions, convert_checkpoint_to_tpa

    student = root / "tpa-lossy"
    if not student.exists():
        convert_checkpoint_to_tpa(root / "teacher", student, ToTPAOptions(k_rank=1, v_rank=1), progress=False)
    before = _loss(student, root / "teacher")
    r = _heal(root, student, tmp_path / "out", layer_loss_weight=1.0)
    assert r.layer_targets == "identity"
    assert (tmp_path / "out" / MAP_FILE).is_file()  # the healed model keeps its map
    assert _loss(tmp_path / "out", root / "teacher") < before
    assert r.heldout_kl_after < r.heldout_kl_before


def test_heal_without_a_layer_map_falls_back_to_the_logits_in_one_line(root, tmp_path, capsys):
    student = root / "plain"
    if not student.exists():
        tiny("llama", 257, seed=3, tokenizer=byte_tokenizer()).save_pretrained(student)
        byte_tokenizer().save_pretrained(student)
    capsys.readouterr()
    r = _heal(root, student, tmp_path / "out", layer_loss_weight=1.0, tokens=8 * SEQ * 2)
    err = [line for line in capsys.readouterr().err.splitlines() if "layer map" in line]
    assert len(err) == 1 and "distilling the logits only" in err[0]
    assert r.layer_targets.startswith("none: plain has no layer map")


def test_a_map_of_another_depth_is_not_used(root, tpa, tmp_path, capsys):
    import shutil

    student = tmp_path / "student"
    shutil.copytree(tpa, student)
    LayerMap.identity(3, 32).save(student)
    capsys.readouterr()
    r = _heal(root, student, tmp_path / "out", layer_loss_weight=1.0, tokens=8 * SEQ * 2)
    assert r.layer_targets.startswith("none: the layer map has 3 layers")
    assert "distilling the logits only" in capsys.readouterr().err


def test_negative_layer_loss_weight_is_refused():
    from hf_symmetry.training.heal import HealOptions

    with pytest.raises(ValueError, match="--layer-loss-weight"):
        HealOptions(layer_loss_weight=-1).validate()


# ----------------------------------------------------------------------------- teacher samples
def test_teacher_samples_are_deterministic_cached_reused_and_invalidated(root, tmp_path, monkeypatch):
    from hf_symmetry.training.distill import cached_teacher_samples, teacher_samples

    tok = byte_tokenizer()
    teacher = _load(root / "teacher").float()
    a = teacher_samples(teacher, tok, 5, 12, seed=7, batch_size=2, progress=False)
    b = teacher_samples(teacher, tok, 5, 12, seed=7, batch_size=2, progress=False)
    c = teacher_samples(teacher, tok, 5, 12, seed=8, batch_size=2, progress=False)
    assert a.shape == (5, 12) and torch.equal(a, b) and not torch.equal(a, c)
    assert (a[:, 0] == tok.bos_token_id).all() and len(set(a[:, 1:].flatten().tolist())) > 10

    folder = tmp_path / "teacher"
    import shutil

    shutil.copytree(root / "teacher", folder)
    monkeypatch.setenv("HF_SYMMETRY_CACHE", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "teacher-samples"
    s1, p1, reused1 = cached_teacher_samples(teacher, tok, folder, 5, 12, seed=7, batch_size=2, progress=False)
    assert not reused1 and p1.is_file() and torch.equal(s1, a)
    s2, p2, reused2 = cached_teacher_samples(teacher, tok, folder, 5, 12, seed=7, batch_size=2, progress=False)
    assert reused2 and p2 == p1 and torch.equal(s2, s1)
    # another seed is another file; a changed teacher (new weights file) samples anew
    _, p3, reused3 = cached_teacher_samples(teacher, tok, folder, 5, 12, seed=8, batch_size=2, progress=False)
    assert not reused3 and p3 != p1
    changed = _load(folder)
    with torch.no_grad():
        changed.lm_head.weight.mul_(3.0)
    changed.save_pretrained(folder)
    s4, p4, reused4 = cached_teacher_samples(changed.float(), tok, folder, 5, 12, seed=7, batch_size=2, progress=False)
    assert not reused4 and p4 != p1 and p1.is_file()
    assert len(list(cache.glob("*.safetensors"))) == 3 and not list(cache.glob(".*"))


def test_heal_reuses_cached_teacher_samples(root, tpa, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SYMMETRY_CACHE", str(tmp_path / "cache"))
    r1 = _heal(root, tpa, tmp_path / "one", teacher_samples=4, tokens=8 * SEQ * 2)
    r2 = _heal(root, tpa, tmp_path / "two", teacher_samples=4, tokens=8 * SEQ * 2)
    assert not r1.teacher_samples_reused and r2.teacher_samples_reused
    assert len(list((tmp_path / "cache" / "teacher-samples").glob("*.safetensors"))) == 1


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def test_default_heal_draws_half_its_sequences_from_the_teacher(root, tpa, tmp_path, monkeypatch):
    """Issue 30's default recipe: pure KD with half of the tokens // seq_len training sequences sampled from
    the teacher, the same for a seed (read back from the cache); fraction 0 is the text-only recipe."""
    from hf_symmetry.training.heal import HealOptions

    monkeypatch.setenv("HF_SYMMETRY_CACHE", str(tmp_path / "cache"))
    default = HealOptions()
    assert default.teacher_sample_fraction == 0.5 and default.teacher_samples is None and default.lm_weight == 0
    assert default.sample_count() == default.tokens // default.seq_len // 2
    tokens = 8 * SEQ * 4  # 32 sequences: 16 from the teacher, 16 of text
    fraction = default.teacher_sample_fraction
    a = _heal(root, tpa, tmp_path / "a", tokens=tokens, teacher_sample_fraction=fraction)
    b = _heal(root, tpa, tmp_path / "b", tokens=tokens, teacher_sample_fraction=fraction)
    text_only = _heal(root, tpa, tmp_path / "c", tokens=tokens, teacher_sample_fraction=0.0)
    assert a.teacher_samples == b.teacher_samples == 16 and a.options["teacher_samples"] == 16
    assert a.data["train_sequences"] == 16 and not a.teacher_samples_reused and b.teacher_samples_reused
    assert len(list((tmp_path / "cache" / "teacher-samples").glob("*.safetensors"))) == 1
    assert text_only.teacher_samples == 0 and text_only.data["train_sequences"] == 32
    wa, wb, wc = (_weights(tmp_path / d) for d in "abc")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # same seed, same samples, same model
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)  # the samples change the training (negative control)
    o = HealOptions(tokens=4096, seq_len=128, teacher_sample_fraction=0.0)
    assert o.sample_count() == 0 and o.text_tokens() == 4096
    assert HealOptions(tokens=4096, seq_len=128, teacher_samples=3, teacher_sample_fraction=0.5).sample_count() == 3
    with pytest.raises(ValueError, match="teacher-sample-fraction"):
        HealOptions(teacher_sample_fraction=1.5).validate()


def test_cli_teacher_sample_defaults_and_flags(monkeypatch):
    import hf_symmetry.commands.heal as heal_module  # where the heal command looks HealRun up
    from hf_symmetry.cli import main as cli

    seen = []

    def fake(job):
        seen.append(job.options)
        raise ValueError("stop here")

    monkeypatch.setattr(heal_module, "HealRun", fake)
    # the inputs named below are never read (HealRun is faked): the up-front input checks are skipped
    monkeypatch.setattr("hf_symmetry.cli.check_inputs", lambda args: None)
    monkeypatch.setattr("hf_symmetry.commands.runner.resolve_model", Path)
    base = ["heal", "in", "out", "--teacher", "t", "--text", "x.txt", "--tokens", "4096", "--seq-len", "128"]
    for extra in ([], ["--teacher-sample-fraction", "0", "--lm-weight", "0.5"], ["--teacher-samples", "3"]):
        assert cli([*base, *extra, "--quiet"]) == 2
    assert [o.sample_count() for o in seen] == [16, 0, 3] and [o.lm_weight for o in seen] == [0, 0.5, 0]
    assert seen[1].text_tokens() == 4096


def test_cli_passes_the_layer_loss_weight(monkeypatch):
    import hf_symmetry.commands.heal as heal_module  # where the heal command looks HealRun up
    from hf_symmetry.cli import main as cli

    seen = {}

    def fake(job):
        seen["options"] = job.options
        raise ValueError("stop here")

    monkeypatch.setattr(heal_module, "HealRun", fake)
    # the inputs named below are never read (HealRun is faked): the up-front input checks are skipped
    monkeypatch.setattr("hf_symmetry.cli.check_inputs", lambda args: None)
    monkeypatch.setattr("hf_symmetry.commands.runner.resolve_model", Path)
    assert (
        cli(
            [
                "heal",
                "in",
                "out",
                "--teacher",
                "t",
                "--text",
                "x.txt",
                "--layer-loss-weight",
                "0.5",
                "--teacher-samples",
                "3",
                "--quiet",
            ]
        )
        == 2
    )
    assert seen["options"].layer_loss_weight == 0.5 and seen["options"].teacher_samples == 3
