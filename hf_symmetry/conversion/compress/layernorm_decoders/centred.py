"""The centred model as a tensor source: a LayerNorm decoder with every writer mean-centred and every
LayerNorm folded into its readers is exactly an RMS-decoder model at full width (weightless RMSNorms, biases
everywhere, untied head with a bias). :class:`CentredSource` presents it under the RMS-decoder family's
checkpoint names, one layer at a time, so the compressed family's steps run on it unchanged."""

from __future__ import annotations

import torch

from ....architectures import Adapter
from ...rms_decoder import centre_globals, centre_layer, rms_decoder_config
from ...stream import partition_keys
from ....symmetry import actions

Tensors = dict[str, torch.Tensor]
_F64 = {"": torch.float64}  # write in float64 (the adapter's default dtype for keys it has not seen)


class CentredSource:
    """The centred model's tensors (float64), read layer by layer from ``source`` (the last layer is kept,
    so its tensors asked for one by one are centred once); ``source`` and ``config`` passed by the package's
    ``check``; ``self.config``: the centred model's RMS-decoder config dict."""

    def __init__(self, source, config: dict):
        keys = source.keys()
        self.source, self.adapter = source, Adapter.from_config(config, keys)
        self.global_keys, self.per_layer, _ = partition_keys(self.adapter, keys)
        self._cache: tuple[int, Tensors] | None = None
        canon0 = self._canonical(0)
        shapes, prefix = source.shapes(), self.adapter.prefix  # the position table's rows (0: none)
        self.position_rows = sum(shapes[f"{prefix}{n}.weight"][0] for n in self.adapter.spec.pos_embed)
        self.config = rms_decoder_config(self.adapter, config, canon0["up.weight"].shape[0], self.position_rows)
        self.config.pop("dtype", None)
        self.writer = Adapter.from_config(self.config)
        self._layer_suffixes = [k[len(self.writer.layer_prefix(0)) :] for k in self.writer.write_layer(0, canon0, _F64)]
        dummy = {"embed.weight": torch.empty(0), "lm_head.weight": torch.empty(0), "lm_head.bias": torch.empty(0)}
        if self.position_rows:
            dummy["pos0.weight"] = torch.empty(0)
        self._global_names = list(self.writer.write_globals(dummy, _F64))

    def keys(self) -> list[str]:
        per_layer = [
            self.writer.layer_prefix(i) + s for i in range(self.adapter.n_layers) for s in self._layer_suffixes
        ]
        return self._global_names + per_layer

    def _canonical(self, i: int) -> Tensors:
        """Layer ``i`` centred and folded, canonical (float64)."""
        canon = centre_layer(self.adapter.read_layer(i, self.source.get(self.per_layer[i])))
        if self.adapter.layout.rope_layout == "interleaved":  # GPT-J: the family pairs rotate-half
            canon = actions.interleaved_to_half(canon, self.adapter.layout)
        return canon

    def _layer(self, i: int) -> Tensors:
        if self._cache is None or self._cache[0] != i:
            self._cache = (i, self.writer.write_layer(i, self._canonical(i), _F64))
        return self._cache[1]

    def globals(self) -> Tensors:
        """The centred globals, canonical (``embed``, ``pos0``, ``lm_head`` weight and bias), float64."""
        return centre_globals(self.adapter.read_globals(self.source.get(self.global_keys)))

    def get(self, names: list[str]) -> Tensors:
        out: Tensors = {}
        wanted_globals = [n for n in names if n in self._global_names]
        if wanted_globals:
            g = self.writer.write_globals(self.globals(), _F64)
            out.update({n: g[n] for n in wanted_globals})
        for n in names:
            if n in out:
                continue
            i = self.writer.layer_of(n)
            if i is None:
                raise KeyError(n)
            out[n] = self._layer(i)[n]
        return out
