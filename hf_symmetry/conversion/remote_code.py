"""What makes an output folder of one of hf_symmetry's own families load with ``trust_remote_code=True`` where
hf_symmetry is not installed: ``config.json`` with its ``auto_map``, and the family's flat files from
:mod:`hf_symmetry.modeling` next to the weights. Every conversion that writes such a folder (compress, to-tpa,
farr, and rotate or compress of a LayerNorm decoder) writes it through here."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import torch
from accelerate import init_empty_weights
from transformers import PretrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import custom_object_save


def save_family_config(model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype, folder: Path):
    """config.json with ``auto_map`` plus the flat remote-code files, as ``save_pretrained`` writes them (the
    weights are streamed separately): the model class's own registration names the files."""
    with init_empty_weights():
        skeleton = model_class(config)
    skeleton.config.dtype = str(dtype).split(".")[1]
    skeleton.config.architectures = [type(skeleton).__name__]
    custom_object_save(skeleton, folder, config=skeleton.config)
    skeleton.config.save_pretrained(folder)


def copy_family_files(folder: Path, *modules: ModuleType) -> None:
    """The family's flat files (``configuration_*.py``, ``modeling_*.py``) next to the weights, as they are."""
    for module in modules:
        shutil.copyfile(module.__file__, Path(folder) / Path(module.__file__).name)
