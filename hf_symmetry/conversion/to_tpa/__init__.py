"""Convert a stock Llama-family checkpoint (MHA or GQA; Llama, Mistral without sliding windows, Qwen2, Qwen3,
Phi-3 — whatever :mod:`hf_symmetry.architectures.capabilities` allows for ``to_tpa``) into a Tensor Product
Attention model. The source is read one layer at a time through the family's adapter (fused projections split,
no module path spelled here); the TPA family's tensor names come from ``modeling_tpa``.

Qwen3's per-head QK-norm goes along (the TPA family normalises each query head and each key factor):
exact at full key rank, where every key head is one factor. A reduced key rank mixes key heads, which does
not commute with the norm, and is refused (``to_tpa_key_rank``); the value rank may be reduced.

Full rank (``k_rank = v_rank = num_key_value_heads``, the default) is exact: GQA is non-contextual TPA
with ``R = G`` and ``a_j = G·mask_j`` (docs/math.md §4). Queries keep an ordinary projection (the
TPA-KV-only variant); K/V become non-contextual TPA whose B projections are the original K/V
heads, so the cache holds ``(R_K + R_V) d_h`` elements per token and layer.

Below full rank the KV-head mode is reduced by a head-mode SVD. For each layer let ``M`` be the
``h × (d_h (d+1))`` matrix whose row ``i`` is query head ``i``'s effective key map ``[W_K, b_K]`` of its
KV group. The best rank-R approximation ``M ≈ U_R U_R^T M`` (``U_R`` the top-R left singular
vectors, i.e. eigenvectors of ``M C M^T``) gives ``a[u, i] = R √g U[i, u]`` and
``[W_b, b_b]_u = Σ_i U[i, u] M_i / √g`` (g = query heads per KV head). With ``C = I`` that is the plain
weight-space SVD; with calibration (``C = Xᵀ X`` of the layer's attention inputs, augmented by a
ones column for the bias) it is the exact least-squares optimum of ``Σ_i ‖X (W_i - Ŵ_i)ᵀ‖²`` over both
factors, i.e. the reduction that best preserves the K (and V) activations on the calibration text.
RoPE acts on the ``d_h`` mode only, so it commutes with any head-mode mixing.

The pieces, one module each:

- :mod:`.target` — the TPA family as a target: the refusals made before any work, the ranks, the
  :class:`TPAConfig` of a source, the config and remote code written with the weights;
- :mod:`.factor` — the head-mode factorisation of one K or V projection (exact, or reduced in a Gram's
  metric);
- :mod:`.layer` — source tensors to TPA tensors: the keys sorted, one layer converted, the tensors a
  streamed layer passes through, the globals;
- :mod:`.grams` — the attention-input Grams the reduction is fitted to, from the calibration engine;
- :mod:`.report` — :class:`LayerError`, :class:`ToTPAReport` and the model card;
- :mod:`.in_memory` — :func:`convert_model_to_tpa` on a loaded model; :mod:`.on_disk` —
  :func:`convert_checkpoint_to_tpa`, streaming a checkpoint folder into a TPA folder.
"""

from __future__ import annotations

from .on_disk import ToTPAOptions, convert_checkpoint_to_tpa
from .factor import group_masks
from .grams import attention_input_grams
from .in_memory import convert_model_to_tpa
from .report import LayerError, ToTPAReport, tpa_card_data
from .target import check_supported, tpa_config_from

__all__ = [
    "LayerError",
    "ToTPAOptions",
    "ToTPAReport",
    "attention_input_grams",
    "check_supported",
    "convert_checkpoint_to_tpa",
    "convert_model_to_tpa",
    "group_masks",
    "tpa_card_data",
    "tpa_config_from",
]
