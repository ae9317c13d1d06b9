"""``match``: align SOURCE to ANCHOR inside SOURCE's symmetry orbit (Zhang et al. 2025, rotation symmetry; docs/math.md
§2).

The result computes exactly SOURCE's function but sits as close to ANCHOR, weight by weight, as
the chosen symmetries allow, so that averaging-style merges combine corresponding units:

* per KV group, QK rotation by closed-form Procrustes (all of O(d_h) without RoPE; the exact
  per-pair SO(2) optimum in the checkpoint's pairing layout with RoPE; free non-rotary dims for
  partial rotary), summed over the group's query heads;
* per KV group, VO rotation by Procrustes over V rows and every O column block of the group;
* optionally per-group QK and VO scalings (the quartic of Zhang et al. 2025, eq. 12);
* FFN neurons by linear assignment;
* optionally (beyond the paper; RMSNorm families) one residual-stream rotation after norm
  fusion, by Procrustes on the embeddings and LM head, refined by block-coordinate passes over
  every residual reader and writer when ``residual_iters > 0``.

Solvers live in :mod:`hf_symmetry.symmetry.procrustes`; the group actions that apply them are the
same ones ``rotate`` uses (:mod:`hf_symmetry.symmetry.actions`). Distances are squared Frobenius
norms per component, before and after, in the frame the models are compared in (norm-folded
when the residual stream is matched: folding is function-preserving and both sides get it).

The pieces, one module each:

- :mod:`.options` — :class:`MatchOptions` and the :class:`MatchPlan` they resolve to on one family;
- :mod:`.solution` — the group element found (:class:`LayerMatch`, :class:`MatchSolution`), and Gram
  matrices carried through it;
- :mod:`.distances` — distances to the anchor per component and per layer (:class:`MatchDistances`);
- :mod:`.align` — the per-layer solve (:func:`align_layer`);
- :mod:`.residual` — the residual frame: norm folding, the explicit LM head, the residual statistics;
- :mod:`.pair` — one pair, streaming (:class:`PairMatcher`, :func:`run_pair`);
- :mod:`.checks` — the refusals before any work (:func:`plan_pair`), shared with ``merge``;
- :mod:`.in_memory` — :func:`match_state_dict`, :func:`fold_state_dict`;
- :mod:`.on_disk` — :func:`match_checkpoint` on HF folders, with its report and card.
"""

from .on_disk import MatchReport, match_checkpoint
from .distances import squared_distances
from .in_memory import MatchResult, fold_state_dict, match_state_dict
from .options import MatchOptions, MatchPlan

__all__ = [
    "MatchOptions",
    "MatchPlan",
    "MatchReport",
    "MatchResult",
    "fold_state_dict",
    "match_checkpoint",
    "match_state_dict",
    "squared_distances",
]
