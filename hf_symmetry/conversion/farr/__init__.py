"""FaRR (fuse and rank reduce, docs/math.md §5): analyse the fused attention maps of a checkpoint and
write a model with smaller per-layer head dims.

Two streaming passes over the checkpoint: the first reads each layer, folds its pre-norm γ
(pre-LN families) and keeps only the singular values of each KV group's fused maps, from which
the per-layer ranks are chosen; the second truncates, splits back with ``√Σ`` on each side and
writes the layer. Ranks: ``τ`` gives each KV group the smallest rank keeping a fraction τ of its
fused energy and each layer the largest of its groups (batched attention needs one head dim per
layer); a parameter fraction spends a global budget greedily on the rank increments that keep
the most relative energy per parameter.

The output is a FaRR model (:mod:`hf_symmetry.modeling.modeling_farr`): the stock Llama-family
decoder or BERT/RoBERTa encoder with per-layer head dims, saved with its remote code.

Beyond the seed: the data-free Frobenius metric ignores which input directions real activations
use, and on SmolLM2 its smallest fused directions turn out to matter (see BENCHMARKS.md). With
calibration (:func:`attention_input_moments`), each map is measured by its output energy on the
model's own attention inputs (:class:`fused.InputWeights`) and truncated in that metric: same
architecture and parameter count, far smaller loss. Calibrated, the first pass is the layer-wise
calibration engine's (:func:`calibrated_analysis`): each layer's input moments become its metric
(eigendecomposition on ``--device``) and its spectra as the engine reaches it; the metrics wait
for the second pass in files next to the output (:class:`LayerWeights`), so host memory is one
layer's worth whatever the depth.

The steps, one module each:

- :mod:`.options` — :class:`FarrOptions` (τ or parameter budget, paths, basis);
- :mod:`.target` — the FaRR family of a source checkpoint and the refusals made before any work;
- :mod:`.analysis` — the data-free analysis pass (fused spectra, one layer at a time);
- :mod:`.calibrated` — the calibrated analysis on the layer-wise calibration engine, and the
  per-layer metrics kept for the reduction pass;
- :mod:`.ranks` — per-layer ranks from τ or from the parameter budget;
- :mod:`.reduce` — the reduction pass (truncate, split back, stream the layers to a sink);
- :mod:`.in_memory` — the state-dict and loaded-model entry points;
- :mod:`.on_disk` — the checkpoint-folder entry point (remote code, report, calibration tokens);
- :mod:`.card` — the effective-rank heatmap and the model card;
- :mod:`.spectra` — the ``spectra`` report;
- :mod:`.fused_check` — the fused maps checked against the module's own forward, with hooks
  (``spectra --check-layout``, tests).
"""

from __future__ import annotations

from .analysis import LayerAnalysis, analyze, analyze_layer, prepare_layer
from .calibrated import LayerWeights, attention_input_moments, calibrated_analysis
from .card import CARD_TAUS, HEATMAP_FILE, farr_card_data, write_rank_heatmap
from .on_disk import REPORT_FILE, calibration_tokens, farr_checkpoint, save_farr_config
from .in_memory import build_farr_model, farr_model, farr_state_dict
from .options import FarrOptions
from .ranks import RankPlan, plan_ranks, ranks_for_tau
from .reduce import FarrReport, reduce_layer, run_farr
from .spectra import spectra_report
from .target import FarrTarget, farr_target, qk_layers

__all__ = [
    "LayerAnalysis",
    "analyze",
    "analyze_layer",
    "prepare_layer",
    "LayerWeights",
    "attention_input_moments",
    "calibrated_analysis",
    "CARD_TAUS",
    "HEATMAP_FILE",
    "farr_card_data",
    "write_rank_heatmap",
    "REPORT_FILE",
    "calibration_tokens",
    "farr_checkpoint",
    "save_farr_config",
    "build_farr_model",
    "farr_model",
    "farr_state_dict",
    "FarrOptions",
    "RankPlan",
    "plan_ranks",
    "ranks_for_tau",
    "FarrReport",
    "run_farr",
    "reduce_layer",
    "spectra_report",
    "FarrTarget",
    "farr_target",
    "qk_layers",
]
