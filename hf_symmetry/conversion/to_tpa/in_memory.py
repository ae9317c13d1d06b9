"""The in-memory entry point: a loaded model converted into a :class:`TPAForCausalLM`
(:func:`convert_model_to_tpa`), its state dict read through the family's adapter like a checkpoint."""

from __future__ import annotations

import copy
import time

import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...modeling.modeling_tpa import GLOBAL_MODULES as TPA_GLOBAL_MODULES
from ...modeling.modeling_tpa import LAYER_PREFIX as TPA_LAYER_PREFIX
from ...modeling.modeling_tpa import TPAForCausalLM
from ..stream import DictSource
from .grams import attention_input_grams
from .layer import LayerFit, layout_keys, tpa_globals, tpa_layer
from .report import LayerError, ToTPAReport
from .target import check_ranks, check_supported, empty_model, heads, source_biases, tpa_config_from

#: the calibration windows (tokens) of ``convert_model_to_tpa(calib_ids=...)``
CALIB_WINDOW = 512


@torch.no_grad()
def convert_model_to_tpa(
    model,
    k_rank: int | None = None,
    v_rank: int | None = None,
    calib_ids: torch.Tensor | None = None,
    calibrate: bool = True,
    calib_grams: list[torch.Tensor] | None = None,
    group_of=None,
    progress: bool = True,
) -> tuple[TPAForCausalLM, ToTPAReport]:
    """In-memory conversion of a loaded ``...ForCausalLM`` of a family the TPA family can express
    (Llama, Mistral without sliding windows, Qwen2, Qwen3) into a :class:`TPAForCausalLM` (same dtype).
    The source is read through the family's adapter, like a checkpoint.

    With ``calib_ids`` (and a reduced rank) the attention inputs on that text are collected: the
    head-mode reduction is fitted to them when ``calibrate`` (else it is the plain weight SVD) and
    the per-layer activation errors are reported either way. ``calib_grams`` (from
    :func:`attention_input_grams`) can be passed instead of ``calib_ids`` to reuse them (or to measure on
    windows other than :data:`CALIB_WINDOW` tokens). ``group_of(i)``
    overrides the head grouping (a deliberately wrong grouping is the negative control of the tests)."""
    t0 = time.time()
    check_supported(model)
    cfg = model.config
    source = DictSource(model.state_dict())
    adapter = Adapter.from_config(cfg, source.keys())
    heads(adapter)
    k_rank, v_rank = check_ranks(adapter, k_rank, v_rank)
    n_kv = adapter.layout.n_kv_heads
    reduced = k_rank < n_kv or v_rank < n_kv
    global_keys, per_layer = layout_keys(adapter, source.keys())
    flags = source_biases(adapter.read_layer(0, source.get(per_layer[0])))
    tcfg = tpa_config_from(cfg, k_rank, v_rank, **flags)
    report = ToTPAReport.start(
        str(getattr(cfg, "_name_or_path", "")),
        adapter,
        tcfg,
        k_rank,
        v_rank,
        exact=not reduced and group_of is None,
        calibrated=(calib_ids is not None or calib_grams is not None) and calibrate and reduced,
        calib_tokens=0 if calib_ids is None else int(calib_ids.numel()),
    )
    grams = calib_grams
    if grams is None and calib_ids is not None and reduced:
        grams = attention_input_grams(model, calib_ids, window=CALIB_WINDOW, progress=progress)

    dtype = next(model.parameters()).dtype
    sd = tpa_globals(adapter, source.get(global_keys), tcfg.tie_word_embeddings)
    fit = LayerFit(k_rank, v_rank, flags, calibrate, group_of)
    for i in tqdm(range(adapter.n_layers), desc="to-tpa", disable=not progress, leave=False):
        canon = adapter.read_layer(i, source.get(per_layer[i]))  # one float64 layer at a time
        new, errs = tpa_layer(canon, adapter.layout, fit, None if grams is None else grams[i])
        sd.update({TPA_LAYER_PREFIX.format(i) + k: v.to(dtype) for k, v in new.items()})
        report.layers.append(LayerError(i, *errs))
    tpa = empty_model(tcfg).to(dtype)
    target = tpa.state_dict()
    missing = set(target) - set(sd)
    if tcfg.tie_word_embeddings:
        missing.discard(f"{TPA_GLOBAL_MODULES['lm_head']}.weight")
    unexpected = set(sd) - set(target)
    if missing or unexpected:
        raise RuntimeError(
            f"to-tpa weight mapping mismatch: missing={sorted(missing)[:5]} unexpected={sorted(unexpected)[:5]}"
        )
    tpa.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    if tcfg.tie_word_embeddings:
        tpa.tie_weights()
    tpa.generation_config = copy.deepcopy(model.generation_config)
    tpa.eval()
    report.seconds = time.time() - t0
    return tpa, report
