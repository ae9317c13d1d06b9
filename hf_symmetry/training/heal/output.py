"""The healed folder (main process only): adapters merged into the weights, the model saved in its own
family and source dtype, tokenizer, generation config and layer map copied, optional ``adapter/``,
and the public ``heal_report.json``; written to a temporary sibling renamed into place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


from ...checkpoint_io import atomic_output_dir, config_dtype
from ...conversion.layer_map import MAP_FILE
from ...hub.lineage import public_report
from .checks import read_config
from .report import HealReport

ADAPTER_DIR = "adapter"


def write_output(
    trained, tok, src: Path, out: Path, report: HealReport, plan, *, overwrite: bool, save_adapter: bool
) -> None:
    """The healed folder ``out`` from the trained model (with adapters when ``plan`` is a LoRA plan),
    the tokenizer and ``src``'s side files; ``report`` gains the adapter folder when it is saved."""
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        if plan is not None:
            if save_adapter:
                save_adapter_folder(trained, tmp / ADAPTER_DIR)
                report.adapter_dir = str(out / ADAPTER_DIR)
            model = trained.merge_and_unload()
        else:
            model = trained
        dtype = config_dtype(read_config(src))
        model = model.to("cpu", dtype)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        gen = src / "generation_config.json"
        if gen.is_file() and not (tmp / "generation_config.json").is_file():
            shutil.copy2(gen, tmp / "generation_config.json")

        if (src / MAP_FILE).is_file():  # the healed model relates to the original as its input did
            shutil.copy2(src / MAP_FILE, tmp / MAP_FILE)
        (tmp / "heal_report.json").write_text(
            json.dumps(public_heal_report(report.as_dict()), indent=2, default=str) + "\n"
        )


def save_adapter_folder(trained, folder: Path) -> None:
    """The PEFT adapter of ``trained`` in ``folder``, byte-deterministic: peft writes a config entry that it holds
    as a set (``target_modules``) as a list in Python's hash order, which changes with ``PYTHONHASHSEED`` from
    one run to the next; those entries are rewritten sorted, in peft's own JSON layout."""
    trained.save_pretrained(folder)
    held = trained.peft_config[trained.active_adapter].to_dict()
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in held.items():
        if isinstance(value, set) and isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def public_heal_report(d: dict) -> dict:
    return public_report({**d, "teacher": Path(d["teacher"]).name})
