"""``heal``: recovery fine-tuning of a converted model by distillation from the original.

The run (:func:`heal_checkpoint`, given one :class:`HealJob`; the command runs the same :class:`HealRun` on
``commands/runner.py``):

1. **Checks, before any work** (one ``ValueError``/``FileExistsError`` each, nothing written): options,
   OUT (must not exist unless ``overwrite``), the run folder (``<OUT>.heal-run``: must exist for
   ``resume``, must not otherwise), the student is a causal LM of a supported family, teacher and
   student share the tokenizer and output vocabulary, the training text is non-empty and long
   enough for one sequence, the LoRA rank fits every adapted projection.
2. **Data**: the training text packed into ``seq_len`` sequences (:mod:`.data`),
   split by document into train and held-out; by default half of the training sequences
   (``teacher_sample_fraction``, or ``teacher_samples`` of them) sampled from the teacher instead
   (cached under the hf_symmetry cache and reused while the teacher is unchanged); optionally the
   teacher's top-k logits of every training sequence cached on disk (``teacher_cache``) so that
   later epochs and resumed runs skip the teacher.
3. **Adapters**: LoRA on every projection (:mod:`.peft_targets`; for the
   compressed family its structured factors) or ``full`` fine-tuning of all weights.
4. **Training**: :func:`hf_symmetry.training.train` with :class:`~.distill.DistillationLoss`
   (logits, plus with ``layer_loss_weight > 0`` the decoder-layer states through the conversion's layer
   map, :mod:`hf_symmetry.conversion.layer_map`; a student without one is distilled on the logits only, said in one
   line);
   checkpoints in the run folder make ``resume`` continue an interrupted run.
5. **Output** (main process only): adapters merged into the weights, the model saved in its own
   family (``save_pretrained``: custom families carry their remote code), tokenizer copied, optional
   ``adapter/`` (the PEFT adapter alone), held-out perplexity before/after, model card. Written to a
   temporary sibling and renamed, so OUT is complete or absent. The run folder is removed on success.

The pieces, one module each:

- :mod:`.options` — :class:`HealOptions`, the recipe of a run and the figures derived from it, and
  :class:`HealJob`, what a run is asked to do, as one object (inputs, recipe, how it runs);
- :mod:`.checks` — the refusals before any work: OUT and the run folder, the student's family;
- :mod:`.models` — the models loaded in float32, the weightless skeleton, perplexities;
- :mod:`.pipeline` — :class:`HealRun`, the run from the checks to the card (made from the job: the checks and
  what is derived once; :meth:`~HealRun.train`; :meth:`~HealRun.verify`), and :func:`heal_checkpoint`;
- :mod:`.output` — the healed folder (merged weights, tokenizer, layer map, ``adapter/``, report);
- :mod:`.report` — :class:`HealReport` and the model card.
"""

from __future__ import annotations

from .checks import check_student, run_dir_for
from .options import HealJob, HealOptions
from .output import ADAPTER_DIR
from .pipeline import HealRun, heal_checkpoint
from .report import HealReport

__all__ = [
    "HealJob",
    "HealOptions",
    "HealReport",
    "HealRun",
    "heal_checkpoint",
    "run_dir_for",
    "check_student",
    "ADAPTER_DIR",
]
