"""The one collector of calibration statistics: what a conversion asks for, and how it is
accumulated from the activations of one decoder layer.

A *site* is a place in a decoder layer whose activations a statistic is taken of, named in the
canonical vocabulary of :mod:`hf_symmetry.architectures.adapter` (the adapter resolves it to the
family's module path):

=============  ==============================================================================
``layer_in``   the layer's input: the residual stream before it
``layer_out``  the layer's output: the residual stream after it
``attn_in``    the input of the query projection (fused ``qkv`` where the family fuses them);
               for pre-LN families the attention norm's output (γ included)
``v_in``       the input of the value projection (the same tensor as ``attn_in`` in every
               family supported today; FaRR's value path reads this one)
``o_in``       the input of the attention output projection (all heads' outputs, concatenated)
``ffn_norm_in`` the input of the FFN's norm (pre-LN: the residual stream between attention and FFN)
``ffn_in``     the input of the FFN's up (and gate) projection
``down_in``    the input of the FFN's down projection
``q_out`` ``k_out`` ``v_out``  the outputs of the separate q/k/v projections (per-head blocks of
               ``head_dim`` columns)
=============  ==============================================================================

Two more sites exist after the last layer (:meth:`hf_symmetry.calibration.run.CalibrationRun.final`):
``final_in`` (the residual stream after the last layer) and ``head_in`` (the final norm's output,
what the LM head reads).

Any site may be prefixed ``normed:`` for RMSNorm without γ of its activations, ``x / rms(x)``
with the model's epsilon (the input of norm-folded readers, e.g. ``normed:layer_in``).

Statistics (:class:`StatsRequest`), all sums over calibration tokens, float64 (the per-batch
products are float64 too, so statistics of a float64 model are exact to rounding):

* ``grams``: ``Σ xᵀx`` (second moments; divide by :attr:`LayerStats.tokens` for ``E[xxᵀ]``);
* ``sums``: ``Σ x`` (first moments);
* ``joint``: ``Σ x_aᵀ x_b`` of two sites of the same run;
* ``cross``: ``Σ x̂_aᵀ x_b``, ``x̂`` from the converted stream (sequential mode: the model whose
  earlier layers are converted) and ``x`` from the original model's stream at site ``b``
  (needs ``carry_original``). ``cross`` of ``(a, a)`` is the classic cross moment against the
  original model; ``(a, b)`` with a stream site gives drift terms, e.g. ``Σ x̂ᵀ(h − ĥ)`` is
  ``cross[(a, "layer_in")] − joint[(a, "layer_in")]``;
* ``drift``: ``Σ x̂_aᵀ (x_b − x̂_c)`` for a triple ``(a, b, c)``: ``x_b`` from the original stream, ``x̂_c``
  from the converted one (needs ``carry_original``), e.g. ``(writer, after, before)`` for what a writer
  must add to the converted stream to give the original stream after it. It equals
  ``cross[(a, b)] − joint[(a, c)]`` and is accumulated as one ``[width_a, width_b]`` sum instead of two.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

Tensors = dict[str, torch.Tensor]

LAYER_SITES = (
    "layer_in",
    "layer_out",
    "attn_in",
    "v_in",
    "o_in",
    "ffn_norm_in",
    "ffn_in",
    "down_in",
    "q_out",
    "k_out",
    "v_out",
)
FINAL_SITES = ("final_in", "head_in")
NORMED = "normed:"


def base_site(site: str) -> str:
    return site.removeprefix(NORMED)


@dataclass(frozen=True)
class StatsRequest:
    """What a conversion needs from each layer (see the module docstring for sites and kinds)."""

    grams: tuple[str, ...] = ()
    sums: tuple[str, ...] = ()
    joint: tuple[tuple[str, str], ...] = ()
    cross: tuple[tuple[str, str], ...] = ()
    drift: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self):
        for name in ("grams", "sums"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("joint", "cross", "drift"):
            object.__setattr__(self, name, tuple(tuple(p) for p in getattr(self, name)))
        if any(len(t) != 3 for t in self.drift):
            raise ValueError(f"drift statistics are (a, b, c) triples, got {self.drift}")
        for site in self.sites() | self.original_sites():
            if base_site(site) not in LAYER_SITES + FINAL_SITES:
                raise ValueError(f"unknown calibration site {site!r}; sites: {', '.join(LAYER_SITES + FINAL_SITES)}")

    def sites(self) -> set[str]:
        """Sites whose activations of the (converted) run are needed."""
        return {
            *self.grams,
            *self.sums,
            *(a for a, _ in self.joint),
            *(b for _, b in self.joint),
            *(a for a, _ in self.cross),
            *(a for a, _, _ in self.drift),
            *(c for _, _, c in self.drift),
        }

    def original_sites(self) -> set[str]:
        """Sites whose activations on the original model's stream are needed (``cross``, ``drift``)."""
        return {b for _, b in self.cross} | {b for _, b, _ in self.drift}

    @property
    def empty(self) -> bool:
        return not (self.grams or self.sums or self.joint or self.cross or self.drift)

    def __or__(self, other: "StatsRequest") -> "StatsRequest":
        merge = lambda a, b: tuple(dict.fromkeys(a + b))  # noqa: E731  (ordered union)
        return StatsRequest(
            merge(self.grams, other.grams),
            merge(self.sums, other.sums),
            merge(self.joint, other.joint),
            merge(self.cross, other.cross),
            merge(self.drift, other.drift),
        )


@dataclass
class LayerStats:
    """Sums over the calibration tokens of one layer's sites (``layer`` is ``None`` after the last
    layer). Tensors are float64 on the engine's statistics device (the CPU unless asked)."""

    layer: int | None
    tokens: int = 0
    grams: Tensors = field(default_factory=dict)
    sums: Tensors = field(default_factory=dict)
    joint: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    cross: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    drift: dict[tuple[str, str, str], torch.Tensor] = field(default_factory=dict)

    def second_moment(self, site: str) -> torch.Tensor:
        """``E[x xᵀ]`` of ``site``."""
        return self.grams[site] / max(self.tokens, 1)

    def mean(self, site: str) -> torch.Tensor:
        """``E[x]`` of ``site``."""
        return self.sums[site] / max(self.tokens, 1)

    def augmented_gram(self, site: str) -> torch.Tensor:
        """``X̃ᵀX̃`` with ``X̃ = [X, 1]`` (bias column last), from the gram, sum and token count."""
        G, s = self.grams[site], self.sums[site]
        n = torch.tensor([[float(self.tokens)]], dtype=G.dtype, device=G.device)
        return torch.cat([torch.cat([G, s[:, None]], 1), torch.cat([s[None, :], n], 1)], 0)

    def to(self, device) -> "LayerStats":
        mv = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
        return LayerStats(
            self.layer, self.tokens, mv(self.grams), mv(self.sums), mv(self.joint), mv(self.cross), mv(self.drift)
        )


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without γ (float32 at least)."""
    x = x if x.dtype == torch.float64 else x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Accumulator:
    """Adds one batch's site activations to a :class:`LayerStats` (the one accumulation rule:
    float64 products, float64 sums, on ``device``)."""

    def __init__(self, request: StatsRequest, stats: LayerStats, eps: float, device: torch.device | None = None):
        self.request, self.stats, self.eps = request, stats, eps
        self.device = device
        r = request  # how often each site's float64 copy is read per batch (converted / original stream)
        self._uses = Counter(
            [
                *r.grams,
                *r.sums,
                *(site for pair in r.joint for site in pair),
                *(a for a, _ in r.cross),
                *(site for a, _, c in r.drift for site in (a, c)),
            ]
        )
        self._original_uses = Counter([*(b for _, b in r.cross), *(b for _, b, _ in r.drift)])

    def _view(self, acts: Tensors, site: str, cache: Tensors, left: Counter) -> torch.Tensor:
        """``site``'s activations as float64 ``[tokens, width]`` on ``device``, made once per batch and
        dropped from ``cache`` at their last use (``left``: the uses still to come), so one site's
        copy is alive at a time where each statistic reads one site (4096 wide: 16 MB per 512 tokens)."""
        if site not in cache:
            x = acts[base_site(site)]
            x = x.reshape(-1, x.shape[-1])
            if site.startswith(NORMED):
                x = rms_normalised(x, self.eps)
            x = x.to(torch.float64)
            cache[site] = x if self.device is None else x.to(self.device)
        left[site] -= 1
        return cache.pop(site) if left[site] <= 0 else cache[site]

    def add(self, acts: Tensors, original: Tensors | None = None) -> None:
        """``acts``: site -> activations ``[..., width]`` of this batch; ``original``: the same sites
        on the original model's stream (for ``cross``)."""
        r, s = self.request, self.stats
        cache: Tensors = {}
        ocache: Tensors = {}
        left, oleft = Counter(self._uses), Counter(self._original_uses)
        tokens = None
        if (r.cross or r.drift) and original is None:
            raise ValueError(
                "cross and drift moments need the original stream: run the engine with carry_original=True"
            )
        for site in r.grams:
            x = self._view(acts, site, cache, left)
            tokens = x.shape[0]
            if site in s.grams:  # in place: no Gram-sized temporary per batch (4096² float64 is 134 MB)
                s.grams[site].addmm_(x.T, x)
            else:
                s.grams[site] = x.T @ x
            del x  # before the next site's copy is made
        for site in r.sums:
            x = self._view(acts, site, cache, left)
            tokens = x.shape[0]
            _add(s.sums, site, x.sum(0))
            del x
        for a, b in r.joint:
            xa, xb = self._view(acts, a, cache, left), self._view(acts, b, cache, left)
            tokens = xa.shape[0]
            _add_product(s.joint, (a, b), xa, xb)
            del xa, xb
        for a, b in r.cross:
            xa, xb = self._view(acts, a, cache, left), self._view(original, b, ocache, oleft)
            tokens = xa.shape[0]
            _add_product(s.cross, (a, b), xa, xb)
            del xa, xb
        for a, b, c in r.drift:
            xa = self._view(acts, a, cache, left)
            # a new tensor: the views may be the activations themselves (a float64 run)
            xb = self._view(original, b, ocache, oleft).sub(self._view(acts, c, cache, left))
            tokens = xa.shape[0]
            _add_product(s.drift, (a, b, c), xa, xb)
            del xa, xb
        if tokens is None:
            first = next(iter(acts.values()), None)
            tokens = 0 if first is None else first.reshape(-1, first.shape[-1]).shape[0]
        s.tokens += tokens


def _add(store: dict, key, value: torch.Tensor) -> None:
    if key in store:
        store[key] += value
    else:
        store[key] = value


def _add_product(store: dict, key, xa: torch.Tensor, xb: torch.Tensor) -> None:
    """``store[key] += xaᵀ xb`` in place (no product-sized temporary per batch: the FFN's
    ``[4d, 4d]`` cross moment is 134 MB in float64 at 4d = 4096)."""
    if key in store:
        store[key].addmm_(xa.T, xb)
    else:
        store[key] = xa.T @ xb


@contextlib.contextmanager
def capture_sites(layer: torch.nn.Module, site_modules: dict[str, tuple[str, str]], sites: set[str]):
    """Forward hooks on ``layer`` that store the activations of ``sites`` (base names; ``layer_in``
    and ``layer_out`` are the caller's) in the yielded dict during each forward; ``site_modules``
    maps a site to ``(module path inside the layer, "in" | "out")`` (from the adapter)."""
    store: Tensors = {}
    handles = []

    def pre(site):
        def hook(_module, args):
            store[site] = args[0].detach()

        return hook

    def post(site):
        def hook(_module, _args, output):
            store[site] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    try:
        for site in sorted(sites - {"layer_in", "layer_out"}):
            path, where = site_modules[site]
            module = layer.get_submodule(path)
            handles.append(
                module.register_forward_pre_hook(pre(site))
                if where == "in"
                else module.register_forward_hook(post(site))
            )
        yield store
    finally:
        for h in handles:
            h.remove()
