"""The refusals of a healing run made before any work: where the run keeps its checkpoints
(:func:`run_dir_for`) and whether OUT and the run folder allow the run, and whether a folder is a
causal LM heal can train (:func:`check_student`)."""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from ...checkpoint_io import check_output_dir
from ...modeling import causal_lm_model_types


def run_dir_for(out) -> Path:
    """Where a run keeps its checkpoints and caches until OUT is written: ``<OUT>.heal-run``."""
    out = Path(out).absolute()
    return out.with_name(out.name + ".heal-run")


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def check_student(folder: Path) -> dict:
    """The student's config, or ``ValueError`` if it is not a causal LM heal can train."""
    cfg = read_config(folder)
    arch = " ".join(cfg.get("architectures") or [])
    mt = cfg.get("model_type")
    if "CausalLM" not in arch and "LMHeadModel" not in arch:
        raise ValueError(
            f"unsupported student {folder.name}: heal needs a causal language model, this is "
            f"{arch or mt} (no next-token distribution to distil)"
        )
    ours = causal_lm_model_types()
    known = mt in ours or mt in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if not known:
        raise ValueError(
            f"unsupported student {folder.name}: model_type {mt!r} is neither a transformers "
            f"family nor one of hf_symmetry's ({', '.join(ours)})"
        )
    return cfg


def check_output(out: Path, overwrite: bool, resume: bool) -> Path:
    """The run folder, after refusing an OUT that exists (unless ``overwrite``), a ``resume`` with no
    interrupted run and a fresh run where an interrupted one waits."""
    check_output_dir(out, overwrite)
    run = run_dir_for(out)
    if resume and not (run.is_dir() and any(run.glob("checkpoint-*"))):
        raise FileNotFoundError(f"--resume: no interrupted run to continue ({run} has no checkpoint)")
    if not resume and run.exists():
        raise FileExistsError(f"an interrupted run exists at {run}: pass --resume to continue it, or remove it")
    return run
