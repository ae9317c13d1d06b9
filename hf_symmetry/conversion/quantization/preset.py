"""``rotate --for-quantization`` over a checkpoint: the layer step with its quantizer (a quantizer of
:mod:`hf_symmetry.evaluation.weight_quant`, or llama-quantize's mixture with an importance matrix), what was
actually applied, the options in force, the importance matrix of the written model, and the learned
residual rotation. :mod:`hf_symmetry.conversion.rotate` calls these."""

from __future__ import annotations

import torch

from ...evaluation.weight_quant import roundtrip
from .imatrix import ROLES, gguf_name
from .llamacpp import layer_quantizers
from .rotation import LayerSteps, QuantBalance, ScaleSearch, balanced, layer_matrices, learn_rotation, transform_layer

#: the exact scalings, by the site :func:`.scales.apply_scales` reports them under (o: V → O; down: up → down)
SCALINGS = {
    "o": "vo_scaling",
    "down": "ffn_scaling",
    "attn_norm": "attn_norm_scaling",
    "ffn_norm": "ffn_norm_scaling",
}
#: the calibration site each scaling divides the input second moment of
SITE_OF = {"o": "o_in", "down": "down_in", "attn_norm": "attn_in", "ffn_norm": "ffn_in"}
#: what ``rotate --for-quantization`` may print as applied, in this order
ORDER = (
    "residual_permutation",
    "residual_rotation",
    "learned_residual_rotation",
    "vo_rotation",
    "vo_scaling",
    "ffn_scaling",
    "attn_norm_scaling",
    "ffn_norm_scaling",
)
TARGETS = ("weights", "gguf", "gguf-imatrix")


def layer_quantizer(options, layer: dict, i: int, adapter):
    """What the scale search of layer ``i`` measures its error under: the named quantizer of
    :mod:`hf_symmetry.evaluation.weight_quant`, or (``target="gguf"``, ``"gguf-imatrix"``) per site the types
    llama-quantize's ``options.scales`` mixture gives its readers, without an importance matrix or with the
    importance matrix of the scaled layer."""
    if not options.scales:
        return None
    if options.target in ("gguf", "gguf-imatrix"):
        L = adapter.layout
        gqa = L.n_heads // L.n_kv_heads
        return layer_quantizers(options.scales, layer, i, adapter.n_layers, gqa, options.target == "gguf-imatrix")

    return lambda A: roundtrip(A, options.scales)


def quant_layer(i: int, layer: dict, adapter, options, Q, stats, record: dict | None = None) -> dict:
    """Layer ``i`` of a ``--for-quantization`` checkpoint (:func:`.rotation.transform_layer`); ``record[i]``
    gets its log (which scalings changed weights, the search's report, the site statistics)."""
    log: dict = {}
    steps = LayerSteps(
        options.seed, options.vo_hadamard, QuantBalance(alpha=options.balance_alpha), options.scales_pow2
    )
    search = ScaleSearch(stats[i], layer_quantizer(options, layer, i, adapter)) if stats is not None else None
    out = transform_layer(i, layer, adapter.layout, Q, steps, search, scale_log=log)
    if record is not None:
        record[i] = log
    return out


def applied_transforms(options, rotated: bool, record: dict) -> list[str]:
    """The transforms that really changed weights: the residual permutation and rotation (learned or not), the
    per-head V/O Hadamards, and each exact scaling whose factors differ from 1 in at least one layer (the search
    keeps ``α = 0``, no scaling, where scaling would not lower the error)."""
    done = set()
    if options.sort_channels:
        done.add("residual_permutation")
    if rotated:
        done.add("learned_residual_rotation" if options.learn else "residual_rotation")
    if options.vo_hadamard:
        done.add("vo_rotation")
    for log in record.values():
        for site, name in SCALINGS.items():
            if log.get(site, {}).get("changed"):
                done.add(name)
        if options.balance_alpha != 0:
            done.update(SCALINGS[site] for site in log.get("balanced", ()))
    return [name for name in ORDER if name in done]


def options_in_force(options) -> dict:
    """The options that shaped the output, by name (the card's parameters): what a preset ignores is left out."""
    if not options.for_quantization:
        return {"residual": options.residual, "heads": options.heads, "ffn": options.ffn, "scaling": options.scaling}
    out = {"for_quantization": True, "residual": options.residual, "vo_hadamard": options.vo_hadamard}
    if options.residual != "none":
        if options.hold_out:
            out["hold_out"] = list(options.hold_out)
        if options.learn:
            out.update(learn=options.learn, learn_iterations=options.learn_iterations)
    if options.scales:
        out.update(target=options.target or "weights", scales=options.scales)
        out.update(calibration_text=options.calibration_text, calibration_tokens=options.calibration_tokens)
        if options.scales_pow2:
            out["scales_pow2"] = True
        if options.sort_channels:
            out["sort_channels"] = True
    else:
        out["balance_alpha"] = options.balance_alpha
    return out


def written_imatrix(record: dict, n_layers: int, tokens: int) -> dict:
    """``{gguf name: (in_sum2, count)}`` of the written model: each site's input second moment in the layer's
    basis, divided by the square of the scale the search chose (what ``llama-imatrix`` collects on the converted
    model over the same calibration tokens)."""
    out = {}
    for i in range(n_layers):
        log = record[i]
        if "basis_diag" not in log:
            raise ValueError("an importance matrix needs the activation-aware scales (--scales)")
        diag = {SITE_OF[site]: log["basis_diag"][SITE_OF[site]] * log[site]["inv_s2"] for site in SCALINGS}
        for lin, (_, site) in ROLES.items():
            out[gguf_name(i, lin)] = ((diag[site] * tokens).to(torch.float32).numpy(), int(tokens))
    return out


def learn_checkpoint_rotation(source, per_layer, adapter, options, Q0, progress: bool = False) -> torch.Tensor:
    """The residual rotation of ``rotate --for-quantization --learn QTYPE``:
    :func:`.rotation.learn_rotation` over every decoder layer's readers and writers, from the randomised
    Hadamard ``Q0``, against the named quantizer (:mod:`hf_symmetry.evaluation.weight_quant`) with the
    checkpoint's column balancing; ``per_layer``: each layer's keys of ``source`` (the caller's partition).
    Holds every layer's linears in float32 (about 4 bytes per parameter)."""
    readers, writers = [], []
    for i in range(adapter.n_layers):
        r, w = layer_matrices(adapter.read_layer(i, source.get(per_layer[i])), adapter.layout, options.seed, i)
        readers += r
        writers += w
    quantize = balanced(lambda A: roundtrip(A, options.learn), options.balance_alpha)
    log = print if progress else None
    Q, _ = learn_rotation(
        readers,
        writers,
        quantize,
        [Q0.dense() if hasattr(Q0, "dense") else Q0],
        iterations=options.learn_iterations,
        log=log,
    )
    return Q
