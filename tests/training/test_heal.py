"""hf-symmetry heal: recovery fine-tuning by distillation with PEFT on the shared Trainer setup.

Tiny models of every family (stock Llama, TPA, compressed with every structure kind, FaRR) on a
real byte-level tokenizer; the teacher is a tiny Llama with peaked next-token distributions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from heal_models import FAMILIES, byte_tokenizer, save_tiny, tiny  # noqa: E402

from hf_symmetry.assets import resolve_text  # noqa: E402
from hf_symmetry.cli import main as cli  # noqa: E402
from hf_symmetry.training.heal import HealJob, HealOptions, heal_checkpoint, run_dir_for  # noqa: E402
from hf_symmetry.training.peft_targets import apply_lora, lora_plan  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok):
    """Teacher (tiny Llama, peaked) and one student folder per family, plus a training text."""
    root = tmp_path_factory.mktemp("heal")
    teacher = tiny("llama", len(tok), seed=0, tokenizer=tok, init_std=0.1)
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    for i, fam in enumerate(FAMILIES):
        save_tiny(fam, root / fam, tok, seed=10 + i, teacher=teacher)
    text = resolve_text("britannica-calib").read_text(encoding="utf-8")[:24_000]
    (root / "train.txt").write_text(text, encoding="utf-8")
    return root


def _opts(**kw) -> HealOptions:
    base = dict(
        tokens=8 * SEQ * 8, seq_len=SEQ, batch_size=8, lora_rank=4, lr=3e-2, validation_fraction=0.1, save_steps=100
    )
    base["teacher_sample_fraction"] = 0.0  # text only, no samples in the user's cache (default: test_heal_layers)
    return HealOptions(**{**base, **kw})


def _heal(folders, family, out, **kw):
    extra = {k: kw.pop(k) for k in ("resume", "callbacks", "save_adapter") if k in kw}
    return heal_checkpoint(
        HealJob(
            folders / family,
            out,
            folders / "teacher",
            [folders / "train.txt"],
            _opts(**kw),
            progress=False,
            device="cpu",
            eval_texts=None,
            heldout_kl_sequences=8,
            **extra,
        )
    )


def _weights(folder) -> dict:
    return load_file(str(Path(folder) / "model.safetensors"))


# ----------------------------------------------------------------------------- merge == unmerged
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_model_equals_the_unmerged_peft_model(family, tmp_path, exact_rmsnorm):
    # exact_rmsnorm: transformers' RMSNorm (Llama, FaRR) rounds through float32, which turns the merge's
    # float64 round-off into ~1e-8 differences on some draws
    import zlib

    import hf_symmetry  # noqa: F401
    from transformers import AutoModelForCausalLM

    model = tiny(family, 97, seed=1).double()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(input_ids=ids).logits.clone()
    plan = lora_plan(model, 4)
    if family == "compressed":  # every structured factor kind is adapted, none is skipped
        kinds = {n.rsplit(".", 1)[-1] for n in plan.target_parameters}
        assert {"kron_a", "kron_b", "lr_u", "lr_v", "gs_left", "gs_right", "weight"} <= kinds
        assert not plan.target_modules
    else:
        assert len(plan.target_modules) >= 2 * 6
    peft_model = apply_lora(model, plan)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                # zlib.crc32, not hash(): Python salts string hashes per process
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
        unmerged = peft_model(input_ids=ids).logits.clone()
    assert (unmerged - base).abs().max() > 1e-3  # the adapters do change the model
    merged = peft_model.merge_and_unload()
    assert type(merged).__name__ == type(tiny(family, 97)).__name__
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, unmerged, atol=1e-10, rtol=0)
    merged.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float64).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, unmerged, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- healing works
# One healing run per family, each also exercising one option (shared by the tests below):
# stock Llama by full fine-tuning; TPA from a top-k teacher cache plus teacher samples, saving the
# adapter; compressed with checkpoints every 2 steps (the reference for resuming); FaRR plain LoRA.
RUN_OPTIONS = {
    "llama": dict(full=True, lr=3e-3),
    "tpa": dict(teacher_cache=True, cache_k=64, teacher_samples=4, save_adapter=True),
    "compressed": dict(save_steps=2),
    "farr": {},
}


@pytest.fixture(scope="module")
def healed(folders, tmp_path_factory):
    runs = {}

    def get(family):
        if family not in runs:
            out = tmp_path_factory.mktemp(f"healed-{family}") / "out"
            runs[family] = (_heal(folders, family, out, **RUN_OPTIONS[family]), out)
        return runs[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_steps_lower_the_heldout_kl_to_the_teacher(folders, healed, family):
    r, out = healed(family)
    assert r.steps == 8 and r.train_tokens == 8 * 8 * SEQ
    assert r.heldout_kl_after < 0.7 * r.heldout_kl_before, (r.heldout_kl_before, r.heldout_kl_after)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == json.loads((folders / family / "config.json").read_text())["model_type"]
    if family != "llama":  # custom family: remote code travels with the folder
        code = cfg["auto_map"]["AutoModelForCausalLM"].split(".")[0] + ".py"
        assert (out / code).read_text() == (folders / family / code).read_text()
    assert not run_dir_for(out).exists()
    assert "teacher" in (out / "README.md").read_text()


def test_learning_rate_zero_changes_nothing(folders, tmp_path):
    r = _heal(folders, "compressed", tmp_path / "out", lr=0.0)
    before, after = _weights(folders / "compressed"), _weights(tmp_path / "out")
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert r.heldout_kl_after == pytest.approx(r.heldout_kl_before, rel=1e-6)
    assert "teacher samples (data-free distillation): no" in (tmp_path / "out" / "README.md").read_text()


def test_teacher_cache_teacher_samples_and_adapter(healed):
    r, out = healed("tpa")
    assert r.teacher_samples == 4 and r.data["train_sequences"] + 4 >= 8
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert "**yes**, 4 sequences sampled from the teacher" in (out / "README.md").read_text()


def test_full_finetuning_trains_every_weight(folders, healed):
    r, out = healed("llama")
    assert r.mode == "full" and r.lora is None
    before, after = _weights(folders / "llama"), _weights(out)
    assert all(not torch.equal(before[k], after[k]) for k in before if "proj" in k)


# ----------------------------------------------------------------------------- resume, processes
def test_interrupted_run_resumed_equals_uninterrupted(folders, healed, tmp_path):
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise KeyboardInterrupt

    full, full_out = healed("compressed")
    with pytest.raises(KeyboardInterrupt):
        _heal(folders, "compressed", tmp_path / "b", save_steps=2, callbacks=[Interrupt()])
    assert not (tmp_path / "b").exists() and run_dir_for(tmp_path / "b").is_dir()
    resumed = _heal(folders, "compressed", tmp_path / "b", save_steps=2, resume=True)
    assert resumed.resumed_from.endswith("checkpoint-4") and resumed.steps == full.steps
    a, b = _weights(full_out), _weights(tmp_path / "b")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
    assert any(not torch.equal(a[k], w) for k, w in _weights(folders / "compressed").items())


def test_two_processes_give_the_weights_of_one_process(folders, tmp_path, monkeypatch):
    # the CLI's default recipe: half the sequences sampled from the teacher, by the main process of the
    # two-process run from the cache the one-process run filled (a cache of the test's own)
    monkeypatch.setenv("HF_SYMMETRY_CACHE", str(tmp_path / "cache"))
    args = [
        "heal",
        str(folders / "tpa"),
        None,
        "--teacher",
        str(folders / "teacher"),
        "--text",
        str(folders / "train.txt"),
        "--tokens",
        str(4 * SEQ * 4),
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "4",
        "--lora-rank",
        "4",
        "--lr",
        "3e-2",
        "--no-verify",
        "--quiet",
        "--device",
        "cpu",
    ]
    one = [a if a is not None else str(tmp_path / "one") for a in args]
    assert cli(one) == 0
    two = [a if a is not None else str(tmp_path / "two") for a in args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    import socket

    with socket.socket() as s:  # a free port: other runs may use torchrun's default
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "hf_symmetry",
            *two,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # every rank's own lines first (the first failing rank's traceback is not at the end), then the tail
    ranks = "\n".join(line for line in res.stderr.splitlines() if "[rank" in line and "]:" in line)
    assert res.returncode == 0, ranks[:3000] + "\n...\n" + res.stderr[-1500:]
    report = json.loads((tmp_path / "two" / "heal_report.json").read_text())
    assert report["processes"] == 2 and report["teacher_samples"] == 8  # half of the 16 sequences
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    changed = 0
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-6, rtol=1e-5), (k, (a[k] - b[k]).abs().max())
        changed += not torch.equal(a[k], _weights(folders / "tpa")[k])
    assert changed


# ----------------------------------------------------------------------------- bad input
def _bad(folders, tmp_path, capsys, *extra, student="llama", teacher="teacher", text=None):
    out = tmp_path / "out"
    argv = [
        "heal",
        str(folders / student),
        str(out),
        "--teacher",
        str(folders / teacher if teacher in ("teacher", "other-vocab") else teacher),
        "--text",
        str(text or folders / "train.txt"),
        "--seq-len",
        str(SEQ),
        "--no-verify",
        "--quiet",
        "--device",
        "cpu",
        *extra,
    ]
    before = set(tmp_path.iterdir())
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-symmetry heal: error:")
    assert not run_dir_for(out).exists()
    return err[0], set(tmp_path.iterdir()) - before


def test_teacher_with_another_vocabulary_is_refused(folders, tmp_path, capsys):
    from transformers import AutoTokenizer

    other = folders / "other-vocab"
    if not other.exists():
        t = AutoTokenizer.from_pretrained(folders / "teacher")
        t.add_tokens(["<extra>"])
        m = tiny("llama", len(t), tokenizer=t)
        m.save_pretrained(other)
        t.save_pretrained(other)
    err, new = _bad(folders, tmp_path, capsys, teacher="other-vocab")
    assert "tokenizers differ" in err and not new


def test_unsupported_student_is_refused(folders, tmp_path, capsys):
    from transformers import BertConfig, BertModel

    bert = tmp_path / "bert"
    BertModel(
        BertConfig(vocab_size=257, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ).save_pretrained(bert)
    byte_tokenizer().save_pretrained(bert)
    err, new = _bad(folders, tmp_path, capsys, student=str(bert))
    assert "unsupported student" in err and new == set()


def test_empty_text_is_refused(folders, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    err, new = _bad(folders, tmp_path, capsys, text=empty)
    assert "empty" in err and not new


def test_lora_rank_larger_than_a_layer_is_refused(folders, tmp_path, capsys):
    err, new = _bad(folders, tmp_path, capsys, "--lora-rank", "40", student="compressed")
    assert "LoRA rank 40 is larger than layer" in err and not new


def test_existing_output_folder_is_refused(folders, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    err, _ = _bad(folders, tmp_path, capsys)
    assert "exists" in err and os.listdir(tmp_path / "out") == ["keep.txt"]


def test_too_few_perplexity_tokens_are_refused_before_training(folders, tmp_path, capsys):
    text = str(folders / "train.txt")
    out = tmp_path / "out"
    argv = [
        "heal",
        str(folders / "llama"),
        str(out),
        "--teacher",
        str(folders / "teacher"),
        "--text",
        text,
        "--seq-len",
        str(SEQ),
        "--quiet",
        "--device",
        "cpu",
        "--eval-text",
        text,
        "--ppl-tokens",
        "1",
    ]
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ppl-tokens must be 0 (skip) or at least 2" in err[0]
    assert not out.exists() and not run_dir_for(out).exists()


def test_heal_shares_the_perplexity_flags_of_the_other_commands():
    """--ppl-tokens (and the older --eval-tokens) set the held-out token count; --text stays the training text."""
    from hf_symmetry.cli import build_parser

    parser = build_parser()
    base = ["heal", "in", "out", "--teacher", "t", "--text", "train.txt"]
    assert parser.parse_args(base + ["--ppl-tokens", "512"]).eval_tokens == 512
    assert parser.parse_args(base + ["--eval-tokens", "256"]).eval_tokens == 256
    args = parser.parse_args(base)
    assert args.eval_tokens == 2048 and args.train_text == ["train.txt"] and not args.no_verify


def test_a_rotated_layer_norm_decoder_heals(folders, tmp_path, tok):
    """``rotate --residual`` on OPT writes the RMS-decoder family (remote code): heal takes it as a student
    (it once refused every hf_symmetry_rms_decoder folder as an unknown model type) and a few steps lower
    its held-out KL to the teacher."""
    from hf_symmetry.training.heal import check_student
    from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint
    from transformers import OPTConfig, OPTForCausalLM

    src = tmp_path / "opt"
    torch.manual_seed(7)
    OPTForCausalLM(
        OPTConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            pad_token_id=1,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).save_pretrained(src)
    tok.save_pretrained(src)
    student = tmp_path / "opt-rotated"
    rotate_checkpoint(src, student, RotateOptions(residual="hadamard", heads="none", ffn=False), progress=False)
    assert check_student(student)["model_type"] == "hf_symmetry_rms_decoder"
    r = heal_checkpoint(
        HealJob(
            student,
            tmp_path / "out",
            folders / "teacher",
            [folders / "train.txt"],
            _opts(full=True, lr=3e-3),
            progress=False,
            device="cpu",
            eval_texts=None,
            heldout_kl_sequences=8,
        )
    )
    assert r.steps == 8 and r.heldout_kl_after < 0.7 * r.heldout_kl_before, (r.heldout_kl_before, r.heldout_kl_after)


@pytest.mark.parametrize("main_process", [False, True])
def test_the_other_processes_of_a_data_parallel_run_only_convert(tmp_path, capsys, main_process):
    """The runner's ``main_process`` (heal under accelerate or torchrun): a process other than the first checks OUT
    and converts (it trains) without OUT's lock, and verifies, writes and prints nothing; the first one does it all
    (the negative control)."""
    from types import SimpleNamespace

    from hf_symmetry.commands.runner import Conversion, run_conversion

    class Steps(Conversion):
        publishes = False

        def check(self):
            self.steps = ["check"]

        def inputs(self):
            return []

        def convert(self):
            self.steps.append("convert (locked)" if (tmp_path / ".out.lock").exists() else "convert")
            return {}, ["converted"]

        def verify(self, report, lines):
            self.steps.append("verify")
            return False

        def summary(self, report):
            return {"summary": True}

    args = SimpleNamespace(out=str(tmp_path / "out"), json_out=str(tmp_path / "s.json"))
    command = Steps(args)
    command.main_process = main_process
    assert run_conversion(command) == 0
    printed = capsys.readouterr().out
    if main_process:
        assert command.steps == ["check", "convert (locked)", "verify"] and printed.startswith("converted\ndone in ")
        assert (tmp_path / "s.json").is_file()
    else:
        assert command.steps == ["check", "convert"] and printed == "" and not (tmp_path / "s.json").exists()


def test_every_recipe_flag_reaches_the_options_of_the_run():
    """heal's recipe flags are declared on HealOptions (hf_symmetry.flags): each one given a value other than its
    default comes back in the job's options; fields without a flag keep their defaults (the negative control:
    no flag sets them)."""
    from dataclasses import fields

    from hf_symmetry.cli import build_parser
    from hf_symmetry.commands.heal import Heal
    from hf_symmetry.flags import FLAG

    argv = ["heal", "in", "out", "--teacher", "t", "--text", "a.txt", "--text", "b.txt", "--tokens", "4096"]
    argv += ["--seq-len", "64", "--batch-size", "4", "--grad-accum", "2", "--full", "--lr", "0.01"]
    argv += ["--warmup-steps", "3", "--temperature", "2", "--lm-weight", "0.25", "--teacher-cache", "--cache-k", "8"]
    argv += ["--teacher-samples", "5", "--layer-loss-weight", "0.5", "--logit-chunk", "0", "--eval-steps", "7"]
    argv += ["--save-steps", "9", "--seed", "11", "--no-verify"]
    job = Heal(build_parser().parse_args(argv)).job()
    assert job.train_texts == ["a.txt", "b.txt"] and job.eval_texts == []
    expected = dict(tokens=4096, seq_len=64, batch_size=4, grad_accum=2, full=True, lr=0.01, warmup_steps=3)
    expected |= dict(temperature=2.0, lm_weight=0.25, teacher_cache=True, cache_k=8, teacher_samples=5)
    expected |= dict(layer_loss_weight=0.5, logit_chunk=0, eval_steps=7, save_steps=9, seed=11)
    assert job.options == HealOptions(**expected)
    default = HealOptions()
    flagged = {f.name for f in fields(HealOptions) if FLAG in f.metadata}
    unflagged = {f.name for f in fields(HealOptions)} - flagged
    assert set(expected) | {"lora_rank", "teacher_sample_fraction"} == flagged
    assert unflagged == {"weight_decay", "max_grad_norm", "validation_fraction"}
    assert all(getattr(job.options, n) == getattr(default, n) for n in unflagged)
    plain = Heal(build_parser().parse_args(["heal", "in", "out", "--teacher", "t", "--text", "a.txt"])).job()
    assert plain.options == default and plain.eval_texts == ["britannica-eval"]
