"""What makes an output folder of one of hf_symmetry's own families load with ``trust_remote_code=True`` where
hf_symmetry is not installed: ``config.json`` with its ``auto_map``, and the family's flat files from
:mod:`hf_symmetry.modeling` next to the weights. Every conversion that writes such a folder (compress, to-tpa,
farr, and rotate or compress of a LayerNorm decoder) writes it through here: the config object of a model class
(:func:`save_family_config`), a config object with the auto classes it names (:func:`save_config_with_code`), or
a config dict whose ``auto_map`` comes from :func:`family_auto_map`, with the files of :func:`copy_family_files`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
from accelerate import init_empty_weights
from transformers import PretrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import custom_object_save, get_relative_import_files


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
    """The family's flat files (``configuration_*.py``, ``modeling_*.py``) next to the weights, as they are, with
    the sibling files they import relatively (e.g. ``structured_linear.py``), as ``custom_object_save`` does."""
    files = [Path(module.__file__) for module in modules]
    files += [Path(f) for module in modules for f in get_relative_import_files(module.__file__)]
    for file in dict.fromkeys(files):
        shutil.copyfile(file, Path(folder) / file.name)


def family_auto_map(config_class: type[PretrainedConfig], model_classes: dict[str, type]) -> dict[str, str]:
    """``auto_map``: ``AutoConfig`` and each auto class (``{"AutoModel": cls, ...}``) by the flat file that
    defines it (``configuration_x.XConfig``, ``modeling_x.XModel``)."""

    def ref(cls: type) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    return {"AutoConfig": ref(config_class), **{auto: ref(cls) for auto, cls in model_classes.items()}}


def family_modules(config_class: type[PretrainedConfig], model_classes: dict[str, type]) -> list[ModuleType]:
    """The flat files that define the family's classes, each once (models first, then the config)."""
    names = dict.fromkeys([*(cls.__module__ for cls in model_classes.values()), config_class.__module__])
    return [sys.modules[name] for name in names]


def save_config_with_code(config: PretrainedConfig, model_classes: dict[str, type], folder: Path) -> None:
    """config.json with the ``auto_map`` of ``model_classes`` (:func:`family_auto_map`) plus the flat files that
    define them, so the folder loads with ``trust_remote_code=True`` where hf_symmetry is not installed."""
    config.auto_map = family_auto_map(type(config), model_classes)
    config.save_pretrained(folder)  # also copies the configuration file (register_for_auto_class)
    copy_family_files(folder, *family_modules(type(config), model_classes))
