"""Training: one Trainer setup shared by ``hf-symmetry heal`` and ``examples/train_clm.py``.

* :mod:`.data`  — text files / JSONL → document split → packed fixed-length sequences;
* :mod:`.trainer` — :func:`train` (transformers' Trainer: accumulation, cosine schedule, clipping, bf16,
  progress bar, eval, checkpoints and resume, multi-process under accelerate/torchrun);
* :mod:`.heal` — ``hf-symmetry heal``: recovery fine-tuning of a converted model by distillation (a package:
  options, checks, models, the run, output, report);
* :mod:`.distill` — the distillation loss used by ``heal``;
* :mod:`.peft_targets` — which parameters LoRA adapts, for stock and hf_symmetry families;
* :mod:`.tpa_paper_configs` — equal-parameter T6 / MHA / GQA / MLA configurations (``examples/train_clm.py``).
"""

from .data import PackedDataset, TextData, build_datasets, pack_documents, read_documents, split_documents
from .trainer import TrainOutcome, TrainSettings, is_main_process, last_checkpoint, per_device_batch, train, world_size

__all__ = [
    "PackedDataset",
    "TextData",
    "build_datasets",
    "pack_documents",
    "read_documents",
    "split_documents",
    "TrainOutcome",
    "TrainSettings",
    "is_main_process",
    "last_checkpoint",
    "per_device_batch",
    "train",
    "world_size",
]
