"""Caches of Tensor Product Attention factors: dynamic, static (preallocated, for ``torch.compile``) and
quantized. Every one holds the factors ``A_K, B_K (pre-rotated), A_V, B_V`` of the cached tokens, never the
composed K/V: ``(R_K + R_V)(h + d_h)`` elements per token and layer, or ``(R_K + R_V) d_h`` with
non-contextual A (A is then a model parameter, stored once and not per token).

``generate`` builds transformers' generic caches (``DynamicCache``, ``StaticCache``, ``QuantizedCache``). A TPA
model turns an empty one into its factor counterpart *in place* on its first forward
(:func:`as_factor_cache`): the object ``generate`` (or the user) holds stays the same, its layers become
:class:`TPACacheLayer`, :class:`TPAStaticLayer` or :class:`TPAQuantizedLayer`. So
``generate(cache_implementation="static")`` preallocates factors, and ``cache_implementation="quantized"``
quantizes factors (with the ``nbits``, ``q_group_size`` and ``residual_length`` of its ``cache_config``).

This file is copied next to saved checkpoints with ``modeling_tpa.py`` (``trust_remote_code`` loading): it
imports only torch and transformers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticCache, StaticLayer

from transformers.utils import is_torchdynamo_compiling


def _factor_dims(config) -> dict:
    """Ranks, head count, head dim and whether A is contextual, from a TPA config (or its text config)."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return dict(
        k_rank=c.k_rank,
        v_rank=c.v_rank,
        num_heads=c.num_attention_heads,
        head_dim=c.head_dim,
        contextual=c.contextual_a,
    )


def factor_elements_per_token(k_rank: int, v_rank: int, num_heads: int, head_dim: int, contextual: bool) -> int:
    """Cached elements per token and layer: ``(R_K + R_V)(h + d_h)``, or ``(R_K + R_V) d_h`` (non-contextual A)."""
    return (k_rank + v_rank) * (head_dim + (num_heads if contextual else 0))


# ----------------------------------------------------------------------------------------------
# Dynamic
# ----------------------------------------------------------------------------------------------
class TPACacheLayer(DynamicLayer):
    """One layer of a dynamic (growing) factor cache.

    Factor-major tensors, as transformers lays out K/V heads (the sequence on dim 2, the factors where the heads
    would be; a converted GQA model's factors are its K/V heads):

    * ``keys``    – pre-rotated ``B_K``: ``[batch, R_K, seq, d_h]``
    * ``values``  – ``B_V``: ``[batch, R_V, seq, d_h]``
    * ``key_a``   – ``A_K``: ``[batch, R_K, seq, h]`` (contextual) or ``[R_K, h]`` stored once
    * ``value_a`` – ``A_V``: ``[batch, R_V, seq, h]`` (contextual) or ``[R_V, h]`` stored once
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.key_a: torch.Tensor | None = None
        self.value_a: torch.Tensor | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _per_token_names(self) -> list[str]:
        names = ["keys", "values"]
        for name in ("key_a", "value_a"):
            t = getattr(self, name)
            if t is not None and t.dim() == 4:
                names.append(name)
        return names

    def per_token_tensors(self) -> list[torch.Tensor]:
        """The tensors that grow with the sequence (for memory accounting)."""
        if not self.is_initialized or self.keys is None:
            return []
        return [getattr(self, n) for n in self._per_token_names()]

    def constant_tensors(self) -> list[torch.Tensor]:
        """Tensors stored once per layer (non-contextual A factors)."""
        return [t for t in (self.key_a, self.value_a) if t is not None and t.dim() == 2]

    def _apply(self, fn) -> None:
        if self.get_seq_length() > 0:
            for name in self._per_token_names():
                setattr(self, name, fn(getattr(self, name)))

    # -- CacheLayerMixin API -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.values = None
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        key_a: torch.Tensor | None = None,
        value_a: torch.Tensor | None = None,
        **kwargs,
    ):
        """Append the new tokens' factors. ``key_states``/``value_states`` are ``B_K`` (rotated) and ``B_V``
        ``[B, R, T, d_h]``; ``key_a``/``value_a`` are per-token ``[B, R, T, h]`` or constant ``[R, h]``.
        Returns the full ``(B_K, B_V)``; the A factors are in ``key_a``/``value_a``. The first tokens are copied
        (the model hands over views of its projections)."""
        if key_a is None or value_a is None:
            raise ValueError("TPACacheLayer.update needs the A factors (key_a=..., value_a=...)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.keys is None
        self.keys = key_states.contiguous() if first else torch.cat([self.keys, key_states], dim=2)
        self.values = value_states.contiguous() if first else torch.cat([self.values, value_states], dim=2)
        for name, new in (("key_a", key_a), ("value_a", value_a)):
            if new.dim() == 2:  # non-contextual: stored once
                setattr(self, name, new)
            else:
                old = getattr(self, name)
                setattr(self, name, new.contiguous() if first or old is None else torch.cat([old, new], dim=2))
        return self.keys, self.values

    def update_factors(self, a_k, b_k, a_v, b_v) -> tuple[torch.Tensor, ...]:
        """Append the new tokens' factors; return ``(A_K, B_K, A_V, B_V)`` of the whole cached sequence."""
        self.update(b_k, b_v, key_a=a_k, value_a=a_v)
        return self.factors()

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A_K, B_K, A_V, B_V)`` for the whole cached sequence."""
        return self.key_a, self.keys, self.value_a, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name before transformers 5.24
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.key_a = self.value_a = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.get_seq_length() == 0:
            return
        n = abs(tokens_to_remove)
        self._apply(lambda t: t[:, :, :-n])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self):
        if self.get_seq_length() > 0:
            self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.get_seq_length() > 0 and self.keys.device != self.device:
            self._apply(lambda t: t.to(self.device, non_blocking=True))


# ----------------------------------------------------------------------------------------------
# Static
# ----------------------------------------------------------------------------------------------
class TPAStaticLayer(StaticLayer):
    """One layer of a preallocated factor cache (``torch.compile``-able): ``keys`` ``[batch, R_K, max_cache_len,
    d_h]``, ``values`` ``[batch, R_V, max_cache_len, d_h]`` and, with contextual A, ``key_a``/``value_a``
    ``[batch, R, max_cache_len, h]``; written in place at the cache positions. Non-contextual A is the model's
    parameter, referenced, not copied. Attention runs over all ``max_cache_len`` slots; the causal mask
    (``get_mask_sizes``) hides the ones not written yet."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(
        self,
        max_cache_len: int,
        k_rank: int,
        v_rank: int,
        num_heads: int,
        head_dim: int,
        contextual: bool,
        **kwargs,
    ):
        super().__init__(max_cache_len=max_cache_len)
        self.k_rank, self.v_rank, self.heads, self.head_dim = k_rank, v_rank, num_heads, head_dim
        self.contextual = contextual
        self.key_a: torch.Tensor | None = None
        self.value_a: torch.Tensor | None = None
        # a 0-d tensor: the position where the next tokens go, updated in place (no recompilation)
        self.cumulative_length = torch.tensor(0, dtype=torch.long)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        """Allocate the buffers. Only the batch size, dtype and device of ``key_states`` are used (the factor
        shapes come from the config), so ``Cache.early_initialization`` works too."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.max_batch_size = self.batch_size = key_states.shape[0]
        n, L = self.max_batch_size, self.max_cache_len
        zeros = lambda *shape: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        self.keys = zeros(n, self.k_rank, L, self.head_dim)
        self.values = zeros(n, self.v_rank, L, self.head_dim)
        if self.contextual:
            self.key_a = zeros(n, self.k_rank, L, self.heads)
            self.value_a = zeros(n, self.v_rank, L, self.heads)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            for t in (self.keys, self.values, self.key_a, self.value_a, self.cumulative_length):
                if t is not None:
                    torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update_factors(self, a_k, b_k, a_v, b_v) -> tuple[torch.Tensor, ...]:
        """Write the new tokens' factors at the next positions; return the whole buffers
        ``(A_K, B_K, A_V, B_V)`` (``max_cache_len`` slots; A stays ``[R, h]`` when non-contextual)."""
        if not self.is_initialized:
            self.lazy_initialization(b_k, b_v)
        T = b_k.shape[2]
        positions = torch.arange(T, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(T)
        self.keys.index_copy_(2, positions, b_k)
        self.values.index_copy_(2, positions, b_v)
        if self.contextual:
            self.key_a.index_copy_(2, positions, a_k)
            self.value_a.index_copy_(2, positions, a_v)
            return self.key_a, self.keys, self.value_a, self.values
        if self.key_a is None:  # non-contextual: the model's [R, h] parameters, referenced (for accounting)
            self.key_a, self.value_a = a_k, a_v
        return a_k, self.keys, a_v, self.values

    def update(self, key_states, value_states, *args, key_a=None, value_a=None, **kwargs):
        if key_a is None or value_a is None:
            raise ValueError("TPAStaticLayer.update needs the A factors (key_a=..., value_a=...)")
        _, keys, _, values = self.update_factors(key_a, key_states, value_a, value_states)
        return keys, values

    def factors(self) -> tuple:
        return self.key_a, self.keys, self.value_a, self.values

    def per_token_tensors(self) -> list[torch.Tensor]:
        """The preallocated buffers (``max_cache_len`` slots each)."""
        return [t for t in (self.keys, self.values, self.key_a, self.value_a) if t is not None and t.dim() == 4]

    def constant_tensors(self) -> list[torch.Tensor]:
        """Non-contextual A: the model's parameters, referenced."""
        return [t for t in (self.key_a, self.value_a) if t is not None and t.dim() == 2]

    def get_max_cache_shape(self) -> int:  # the name before transformers 5.24
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.per_token_tensors():
                t.zero_()
        self.cumulative_length.zero_()

    def _select(self, fn) -> None:
        """Apply ``fn`` along the batch and copy back in place (the buffers keep their addresses)."""
        if self.is_initialized:
            for t in self.per_token_tensors():
                t.copy_(fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))


# ----------------------------------------------------------------------------------------------
# Quantized
# ----------------------------------------------------------------------------------------------
def _group_size(n: int, group: int) -> int:
    """Elements per quantization group of a row of ``n``: ``group`` if it divides ``n``, else the whole row."""
    return group if 0 < group <= n and n % group == 0 else n


def quantize_rows(x: torch.Tensor, nbits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` ``[..., n]`` in groups of ``group`` consecutive elements of the
    last dim (``group`` must divide ``n``). Returns ``(codes, scale, low)``: ``codes`` uint8 ``[..., ⌈n · nbits /
    8⌉]`` (``8 / nbits`` codes per byte, lowest bits first, the last byte zero-padded), ``scale`` and ``low``
    float16 ``[..., n / group]`` (the dequantized value is ``low + code * scale``, :func:`dequantize_rows`)."""
    if nbits not in (2, 4, 8):
        raise ValueError(f"nbits must be 2, 4 or 8, got {nbits}")
    n = x.shape[-1]
    g = x.reshape(*x.shape[:-1], n // group, group).float()
    low = g.amin(-1, keepdim=True).half()
    high = g.amax(-1, keepdim=True)
    qmax = (1 << nbits) - 1
    scale = ((high - low.float()) / qmax).clamp_min(torch.finfo(torch.float16).tiny).half()
    codes = ((g - low.float()) / scale.float()).round_().clamp_(0, qmax).to(torch.uint8).reshape(x.shape)
    per = 8 // nbits
    if per > 1:
        if n % per:
            codes = torch.nn.functional.pad(codes, (0, per - n % per))
        codes = codes.reshape(*x.shape[:-1], -1, per)
        shifts = torch.arange(0, 8, nbits, device=x.device, dtype=torch.uint8)
        codes = (codes << shifts).sum(-1, dtype=torch.uint8)
    return codes, scale.squeeze(-1), low.squeeze(-1)


def dequantize_rows(
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    nbits: int,
    dtype: torch.dtype,
    n: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` (up to the rounding): rows of ``n`` elements, ``[..., n]`` in ``dtype``,
    written into ``out`` when given (a ``[..., n]`` view, e.g. the head of a longer buffer). One shift-and-mask
    per code position (broadcasting the shifts over a new dimension of uint8 codes measured twice as slow on a
    CPU), then scale and low applied in float32."""
    per = 8 // nbits
    if per > 1:
        mask = (1 << nbits) - 1
        parts = [(codes >> shift) & mask if shift else codes & mask for shift in range(0, 8, nbits)]
        codes = torch.stack(parts, -1).reshape(*codes.shape[:-1], -1)[..., :n]
    groups = scale.shape[-1]
    codes = codes.reshape(*codes.shape[:-1], groups, n // groups)
    if out is None:
        out = torch.empty(codes.shape[:-2] + (n,), dtype=dtype, device=codes.device)
    view = out.view(*codes.shape)
    torch.mul(codes, scale.float().unsqueeze(-1), out=view)
    view.add_(low.float().unsqueeze(-1))
    return out


def quantized_row_bytes(n: int, nbits: int, group: int) -> int:
    """Bytes of one quantized row of ``n`` elements: the codes plus a float16 scale and low per group."""
    return -(-n * nbits // 8) + 4 * (n // _group_size(n, group))


class _QuantizedFactor:
    """One growing factor ``[batch, R, seq, n]`` stored quantized (row-wise groups along ``n``)."""

    def __init__(self):
        self.codes = self.scale = self.low = None
        self.n = 0

    def append(self, x: torch.Tensor, nbits: int, group: int) -> None:
        self.n = x.shape[-1]
        parts = quantize_rows(x, nbits, _group_size(self.n, group))
        if self.codes is None:
            self.codes, self.scale, self.low = parts
        else:
            self.codes, self.scale, self.low = (
                torch.cat([old, new], dim=2) for old, new in zip((self.codes, self.scale, self.low), parts)
            )

    def dequantize(self, nbits: int, dtype: torch.dtype, tail: torch.Tensor | None = None) -> torch.Tensor | None:
        """The stored rows, dequantized, followed by ``tail`` (full-precision rows of the same shape but length),
        in one new buffer."""
        if self.codes is None:
            return tail
        B, R, S = self.codes.shape[:3]
        extra = 0 if tail is None else tail.shape[2]
        out = torch.empty(B, R, S + extra, self.n, dtype=dtype, device=self.codes.device)
        dequantize_rows(self.codes, self.scale, self.low, nbits, dtype, self.n, out=out[:, :, :S])
        if extra:
            out[:, :, S:].copy_(tail)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.codes is None else [self.codes, self.scale, self.low]

    def apply(self, fn) -> None:
        if self.codes is not None:
            self.codes, self.scale, self.low = fn(self.codes), fn(self.scale), fn(self.low)

    def length(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]


class TPAQuantizedLayer(TPACacheLayer):
    """One layer of a quantized factor cache (in the spirit of transformers' ``QuantizedLayer``, KIVI).

    The per-token factors (``B_K``, ``B_V`` and contextual ``A_K``, ``A_V``) are stored in ``nbits`` (2, 4 or 8)
    with a float16 scale and low per group of ``q_group_size`` consecutive elements of each factor row (the
    whole row when the group does not divide it). The most recent tokens are kept in full precision (the
    residual, ``keys``/``values``/``key_a``/``value_a``) until ``residual_length`` of them have gathered; the
    residual is then quantized and appended (a prefill longer than that is quantized at once). Tokens are
    quantized once: each row on its own, nothing is requantized. Attention sees the dequantized factors,
    rebuilt for each forward one layer at a time (not kept).

    Bytes per token and layer in the quantized part (:meth:`bytes_per_token`): ``Σ_rows n·nbits/8 + 4·n/g``
    over the ``R_K + R_V`` B rows (``n = d_h``) and, with contextual A, the ``R_K + R_V`` A rows (``n = h``)."""

    is_croppable = False

    def __init__(self, nbits: int = 4, q_group_size: int = 64, residual_length: int = 128, **kwargs):
        super().__init__()
        if nbits not in (2, 4, 8):
            raise ValueError(f"TPAQuantizedLayer: nbits must be 2, 4 or 8, got {nbits}")
        if residual_length < 0:
            raise ValueError(f"TPAQuantizedLayer: residual_length must be >= 0, got {residual_length}")
        self.nbits, self.q_group_size, self.residual_length = nbits, q_group_size, residual_length
        self._q = {name: _QuantizedFactor() for name in ("keys", "values", "key_a", "value_a")}

    @staticmethod
    def bytes_per_token(
        k_rank: int, v_rank: int, num_heads: int, head_dim: int, contextual: bool, nbits: int, q_group_size: int = 64
    ) -> int:
        """Bytes per token and layer of the quantized part (the formula the tests check against)."""
        rows = k_rank + v_rank
        per = rows * quantized_row_bytes(head_dim, nbits, q_group_size)
        return per + (rows * quantized_row_bytes(num_heads, nbits, q_group_size) if contextual else 0)

    def quantized_length(self) -> int:
        return self._q["keys"].length()

    def get_seq_length(self) -> int:
        return self.quantized_length() + super().get_seq_length()

    def update_factors(self, a_k, b_k, a_v, b_v) -> tuple[torch.Tensor, ...]:
        """Append the new tokens (to the residual, flushed into the quantized store when it is full); return the
        whole sequence's ``(A_K, B_K, A_V, B_V)``, the quantized part dequantized (one buffer per factor, the
        residual copied after it)."""
        self.update(b_k, b_v, key_a=a_k, value_a=a_v)  # the residual, in full precision
        full = self.factors()
        if self.keys.shape[2] >= self.residual_length:  # flush the residual into the quantized store
            for name in self._per_token_names():
                self._q[name].append(getattr(self, name), self.nbits, self.q_group_size)
            self.keys = self.values = None
            self.key_a = self.key_a if self.key_a is not None and self.key_a.dim() == 2 else None
            self.value_a = self.value_a if self.value_a is not None and self.value_a.dim() == 2 else None
        return full

    def factors(self) -> tuple:
        """The whole sequence's factors, the quantized part dequantized (built on each call, not kept)."""
        residual = dict(zip(("key_a", "keys", "value_a", "values"), TPACacheLayer.factors(self)))
        out = []
        for name in ("key_a", "keys", "value_a", "values"):
            r = residual[name]
            out.append(r if r is not None and r.dim() == 2 else self._q[name].dequantize(self.nbits, self.dtype, r))
        return tuple(out)

    def per_token_tensors(self) -> list[torch.Tensor]:
        residual = super().per_token_tensors() if self.keys is not None else []
        return residual + [t for q in self._q.values() for t in q.tensors()]

    def constant_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key_a, self.value_a) if t is not None and t.dim() == 2]

    def _apply(self, fn) -> None:
        if self.keys is not None:
            super()._apply(fn)
        for q in self._q.values():
            q.apply(fn)

    def reset(self) -> None:
        super().reset()
        self._q = {name: _QuantizedFactor() for name in self._q}


# ----------------------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------------------
def _cached_bytes(cache: Cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in layer.per_token_tensors() + layer.constant_tensors()
    )


def _cached_elements(cache: Cache) -> dict[str, int]:
    per_token = sum(t.numel() for layer in cache.layers for t in layer.per_token_tensors())
    constant = sum(t.numel() for layer in cache.layers for t in layer.constant_tensors())
    return {"per_token": per_token, "constant": constant}


class TPACache(Cache):
    """A dynamic cache of TPA factors (one :class:`TPACacheLayer` per decoder layer)."""

    def __init__(self, config=None, num_layers: int | None = None, **kwargs):
        if config is not None:
            num_layers = config.get_text_config(decoder=True).num_hidden_layers
        if num_layers is not None:
            super().__init__(layers=[TPACacheLayer() for _ in range(num_layers)], **kwargs)
            self._tpa_factor_cache = True
        else:  # layers made on demand (a model's forward makes all of them: as_factor_cache)
            super().__init__(layer_class_to_replicate=TPACacheLayer, **kwargs)

    def update_factors(self, layer_idx: int, a_k, b_k, a_v, b_v):
        """Append new factors for ``layer_idx`` and return the cached ``(A_K, B_K, A_V, B_V)``."""
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        return self.layers[layer_idx].update_factors(a_k, b_k, a_v, b_v)

    def cached_elements(self) -> dict[str, int]:
        """Element counts actually held: ``per_token`` (tensors that grow with the sequence, all
        layers and batch rows) and ``constant`` (non-contextual A factors, stored once per layer)."""
        return _cached_elements(self)

    def cached_bytes(self) -> int:
        return _cached_bytes(self)


class TPAStaticCache(StaticCache):
    """A preallocated factor cache for ``torch.compile``: one :class:`TPAStaticLayer` per decoder layer, each
    holding ``max_cache_len`` token slots of factors. ``generate(cache_implementation="static")`` gives a TPA
    model this cache (the generic ``StaticCache`` it builds is converted in place on the first forward)."""

    def __init__(self, config, max_cache_len: int, **kwargs):
        dims = _factor_dims(config)
        n = config.get_text_config(decoder=True).num_hidden_layers
        Cache.__init__(self, layers=[TPAStaticLayer(max_cache_len, **dims) for _ in range(n)])
        self._tpa_factor_cache = True

    def update_factors(self, layer_idx: int, a_k, b_k, a_v, b_v):
        return self.layers[layer_idx].update_factors(a_k, b_k, a_v, b_v)

    def cached_bytes(self) -> int:
        return _cached_bytes(self)


class TPAQuantizedCache(Cache):
    """A factor cache stored in ``nbits`` (2, 4 or 8; :class:`TPAQuantizedLayer`), with the newest up to
    ``residual_length`` tokens in full precision. Pass it to ``generate(past_key_values=...)`` (``cache=`` from
    transformers 5.24), or ask ``generate(cache_implementation="quantized", cache_config={"backend": "hqq",
    "nbits": 4, "q_group_size": 64, "residual_length": 128})``: the generic ``QuantizedCache`` is converted in
    place on the first forward and its ``nbits``/``q_group_size``/``residual_length`` kept (the backend is not
    used: the factors are quantized in plain PyTorch)."""

    def __init__(self, config, nbits: int = 4, q_group_size: int = 64, residual_length: int = 128, **kwargs):
        n = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[TPAQuantizedLayer(nbits, q_group_size, residual_length) for _ in range(n)])
        self._tpa_factor_cache = True

    def update_factors(self, layer_idx: int, a_k, b_k, a_v, b_v):
        return self.layers[layer_idx].update_factors(a_k, b_k, a_v, b_v)

    def cached_elements(self) -> dict[str, int]:
        return _cached_elements(self)

    def cached_bytes(self) -> int:
        return _cached_bytes(self)


def _quantized_settings(layer) -> dict | None:
    """``nbits``/``q_group_size``/``residual_length`` of one of transformers' group-wise quantized cache layers."""
    names = ("nbits", "q_group_size", "residual_length")
    if all(hasattr(layer, n) for n in names) and hasattr(layer, "_quantize"):
        return {n: getattr(layer, n) for n in names}
    return None


def as_factor_cache(cache, config):
    """``cache`` ready to hold TPA factors, the same object where possible.

    A factor cache passes through. An *empty* generic cache (what ``generate`` builds: ``DynamicCache``,
    ``StaticCache``, a group-wise ``QuantizedCache``) has its layers replaced in place by their factor
    counterparts (:class:`TPACacheLayer`, :class:`TPAStaticLayer` with the same ``max_cache_len``,
    :class:`TPAQuantizedLayer` with the same ``nbits``/``q_group_size``/``residual_length``), so that the object
    the caller holds is the cache that fills. Anything else (a filled K/V cache, an unknown layer type) is
    refused."""
    if cache is None or getattr(cache, "_tpa_factor_cache", False):
        return cache
    if not isinstance(cache, Cache):
        raise ValueError(f"TPA models need a Cache (of TPA factors), got {type(cache).__name__}")
    n = config.num_hidden_layers
    dims = _factor_dims(config)
    filled = any(getattr(layer, "is_initialized", False) and layer.get_seq_length() != 0 for layer in cache.layers)
    layers = list(cache.layers) + [None] * (n - len(cache.layers))
    replacement = []
    for layer in layers[:n]:
        if isinstance(layer, (TPACacheLayer, TPAStaticLayer)):
            replacement.append(layer)
        elif filled:
            break
        elif layer is None:
            if cache.layer_class_to_replicate not in (None, DynamicLayer, TPACacheLayer):
                break
            replacement.append(TPACacheLayer())
        elif type(layer) is StaticLayer:
            replacement.append(TPAStaticLayer(layer.max_cache_len, **dims))
        elif type(layer) is DynamicLayer:
            replacement.append(TPACacheLayer())
        elif (q := _quantized_settings(layer)) is not None:
            replacement.append(TPAQuantizedLayer(**q))
        else:
            break
    if len(replacement) != n:
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise ValueError(
            f"TPA models need a cache of TPA factors; got a {type(cache).__name__} with {kinds} layers"
            + (" that already holds K/V" if filled else "")
            + ". Pass an empty DynamicCache/StaticCache/QuantizedCache (or a TPACache, TPAStaticCache, "
            "TPAQuantizedCache)."
        )
    cache.layers = replacement
    cache.layer_class_to_replicate = None
    cache._tpa_factor_cache = True
    return cache


__all__ = [
    "TPACache",
    "TPACacheLayer",
    "TPAQuantizedCache",
    "TPAQuantizedLayer",
    "TPAStaticCache",
    "TPAStaticLayer",
    "as_factor_cache",
    "dequantize_rows",
    "factor_elements_per_token",
    "quantize_rows",
]
