"""``merge``: combine models of one architecture, optionally matched to an anchor first.

Pipeline (docs/math.md §2):

1. checks, before any work: one family and shapes, one vocabulary, a base where the method
   needs one, a supported matching plan, calibration text for data-dependent methods;
2. the anchor: the base model when one is given, else the input nearest the mean of all inputs
   (or the one the recipe names); every other input is matched to it
   (:mod:`hf_symmetry.conversion.match`);
3. the merge rule, tensor by tensor (:mod:`hf_symmetry.conversion.merge.tensor_rules`).

Weight-only methods (average, task arithmetic, TIES) and RegMean stream layer by layer
(:mod:`hf_symmetry.conversion.merge.merge_pass`): each layer of every input is read, matched and merged
one group of tensors at a time before the next layer is read, and the vocabulary-sized globals a
block of rows at a time where the rule allows. RegMean's Gram matrices are collected inside that
pass (:class:`~hf_symmetry.conversion.merge.merge_pass.LayerGrams`: one calibration run per input,
advanced one decoder layer at a time, so host memory holds one layer's Grams whatever the depth),
on the inputs as given, and carried exactly through the match (``RᵀGR``, ``PᵀGP``;
:meth:`~hf_symmetry.conversion.match.solution.MatchSolution.transform_grams`); the globals (LM head:
the Gram of the final norm's output) are merged after the last layer. Fisher needs a full backward
pass, so it holds each *matched* model (a diagonal Fisher does not transform under rotations) placed
by accelerate (:func:`hf_symmetry.conversion.merge.statistics.fisher_model`).

The pieces, one module each:

- :mod:`.recipe` — the YAML recipe (:class:`MergeRecipe`);
- :mod:`.methods` — the merge methods as classes (:class:`~.methods.MergeMethod`: what each needs and
  how it combines tensors; the recipe's method name is parsed into one once);
- :mod:`.tensor_rules` — the merge rules on tensors; :mod:`.rule` — :class:`MergeRule`, a method applied to
  canonical layers and globals;
- :mod:`.anchor` — the anchor the inputs are matched to;
- :mod:`.statistics` — Fisher and Gram statistics; :mod:`.fisher` — Fisher merging's passes (matched
  inputs and Fishers, spilled to files);
- :mod:`.stream` — the streaming layer-by-layer merge and its Gram store;
- :mod:`.pipeline` — :func:`run_merge`: checks, anchor, match and merge on tensor sources;
- :mod:`.in_memory` — :func:`merge_state_dicts`; :mod:`.on_disk` — :func:`merge_checkpoints` on HF
  folders, with its report and card; :mod:`.evaluate` — :func:`evaluate_merge`.
"""

from .on_disk import MergeReport, merge_checkpoints
from .evaluate import evaluate_merge
from .in_memory import MergeResult, merge_state_dicts
from .pipeline import MergeOutcome, Participants, run_merge

__all__ = [
    "MergeOutcome",
    "MergeReport",
    "MergeResult",
    "Participants",
    "evaluate_merge",
    "merge_checkpoints",
    "merge_state_dicts",
    "run_merge",
]
