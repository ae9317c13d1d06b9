"""The merge pass of ``merge`` (every method but Fisher): each decoder layer is read, matched and
merged one group of tensors at a time, RegMean's statistics are measured as the pass reaches each
layer, and the vocabulary-sized globals are merged a block of rows at a time.

Host memory (docs/calibration.md, "What each conversion keeps"):

* **Layers** come in groups (the norms; q, k, v; o; gate, up; down): without matching, each group
  is read from every input and merged before the next is read. The linear layers of one group read
  one input, so RegMean sums and factors one Gram for them (:func:`~.tensor_rules.regmean_group`),
  taking the inputs one at a time and consuming each input's Gram. With matching, the whole layer
  is read (the match is solved on it) and its tensors are handed out group by group.
* **RegMean's Grams** (:class:`LayerGrams`): one calibration run per input, advanced one decoder
  layer at a time. Once an input's layer has run, its Grams wait in files in the hidden output
  folder (:class:`LayerGramSet`) until the merge takes them, so host memory holds the Grams of one
  input's calibration layer while it runs, and one Gram while a group is merged, not every input's
  (the down projection's Gram alone is ``intermediate²`` float64, 134 MB at width 4096).
* **Globals**: for rules that merge each row of the embeddings and the LM head on its own
  (average, task arithmetic, RegMean; without residual matching), a block of rows of every input
  at a time; TIES trims whole tensors and residual matching rotates the globals as a whole, so those
  read them whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ...architectures import Adapter
from ...calibration import CalibrationEngine, StatsRequest
from ...calibration.memory import release_free_memory, return_large_blocks_at_once
from ...devices import default_placement, linalg_device
from ..layer_parts import read_part, stand_ins
from ..match.residual import with_lm_head
from ..stream import TensorSource, partition_keys
from .statistics import statistics_dtype
from .tensor_rules import regmean_group

Tensors = dict[str, torch.Tensor]

# Canonical linear weight -> the Gram of its input (RegMean).
GRAM_OF = {
    "q.weight": "attn_in",
    "k.weight": "attn_in",
    "v.weight": "attn_in",
    "o.weight": "o_in",
    "gate.weight": "ffn_in",
    "up.weight": "ffn_in",
    "down.weight": "down_in",
}
GRAM_SITES = ("attn_in", "o_in", "ffn_in", "down_in")
# A layer's canonical modules in the groups merged together; the largest Gram (down_proj's) last,
# when the others are already released.
LAYER_GROUPS = (("attn_norm", "ffn_norm", "q_norm", "k_norm"), ("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
_BIG_GLOBALS = ("embed.weight", "lm_head.weight")  # canonical vocabulary-sized globals
BLOCK_ELEMENTS = 1 << 20  # rows per block of the globals: ~8 MB in float64


# --------------------------------------------------------------------------- RegMean statistics


class StoredGram:
    """A Gram matrix waiting in a raw float64 file, read a block of rows at a time by
    :func:`~.tensor_rules.regmean_group` (so host memory never holds it whole)."""

    def __init__(self, path: Path, shape: tuple):
        self.path, self.shape = Path(path), tuple(shape)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        width = self.shape[1]
        data = np.fromfile(self.path, dtype=np.float64, count=(stop - start) * width, offset=start * width * 8)
        return torch.from_numpy(data).reshape(stop - start, width)


class LayerGramSet:
    """One input's Gram matrices of one layer (keys ``layers.{i}.{site}``), each handed out once by
    :meth:`take`, carried into the anchor's frame by the input's match solution as it is taken.
    With ``folder`` they wait in raw float64 files there (not in host memory) until taken; taken
    without a match, a file is handed out as a :class:`StoredGram` (removed by :meth:`close`)."""

    def __init__(self, grams: Tensors, folder: Path | None, tag: str, matcher=None, adapter: Adapter | None = None):
        self.matcher, self.adapter = matcher, adapter
        self._memory: Tensors = {}
        self._files: dict[str, tuple[Path, tuple, torch.device]] = {}
        self._handed: list[Path] = []  # files handed out as StoredGram, removed by close()
        for key in list(grams):
            G = grams.pop(key)
            if folder is None:
                self._memory[key] = G
                continue
            path = Path(folder) / f"{tag}-{key}.f64"
            G.detach().cpu().contiguous().numpy().tofile(path)
            self._files[key] = (path, tuple(G.shape), G.device)
            del G

    def __iter__(self):
        return iter([*self._memory, *self._files])

    def take(self, key: str) -> torch.Tensor:
        if key in self._memory:
            G = self._memory.pop(key)
        elif self.matcher is None:  # read by the solver a block at a time (from the CPU)
            path, shape, _ = self._files.pop(key)
            self._handed.append(path)
            return StoredGram(path, shape)
        else:
            path, shape, device = self._files.pop(key)
            G = torch.from_numpy(np.fromfile(path, dtype=np.float64)).reshape(shape).to(device)
            path.unlink()
        if self.matcher is None:
            return G
        # the match solution lives on the CPU; the rule moves the carried Gram to its device
        return self.matcher.solution.transform_grams({key: G.cpu()}, self.adapter.layout)[key]

    def close(self) -> None:
        self._memory.clear()
        for path in [*(p for p, _, _ in self._files.values()), *self._handed]:
            path.unlink(missing_ok=True)
        self._files.clear()
        self._handed.clear()


class LayerGrams:
    """RegMean's statistics inside the merge pass: one layer-wise calibration run
    (:mod:`hf_symmetry.calibration`) per merged input, on the input as given, advanced one decoder
    layer at a time as the merge reaches it. :meth:`layer` returns, per input, layer ``i``'s Gram
    matrices ``Σ xᵀx`` of every linear input (``layers.{i}.{attn_in,o_in,ffn_in,down_in}``) as a
    :class:`LayerGramSet`, carried into the anchor's frame by its match solution; :meth:`final` the
    LM head's (``head_in``) after the last layer. Memory: each input's calibration activations, one
    calibration layer at a time, and the Grams of the input whose layer runs (once measured, every
    input's wait in files in ``spill``, a folder, when given); whatever the depth.

    ``placement``: device and calibration dtype of the runs (default: CPU, float64 for float64
    weights, else float32); the Grams accumulate in float64 on its linear-algebra device.
    ``batches`` run one sequence at a time (the recipe's ``batch_size`` groups Fisher's passes)."""

    def __init__(
        self,
        sources: list[TensorSource],
        configs: list[dict],
        batches: list[torch.Tensor],
        placement=None,
        progress: bool = True,
        spill: Path | None = None,
    ):
        return_large_blocks_at_once()  # freed per-batch temporaries leave at once (calibration.memory)
        # one sequence per forward: the Grams are sums over tokens (the same for any grouping, to
        # rounding), and a layer's per-forward temporaries (its activations, the statistics' float64
        # copies) are then one sequence's, not a batch's (measured: ~60 MB less peak at width 1536)
        batches = [seq[None] for batch in batches for seq in batch]
        self.device = linalg_device(placement)
        self.spill = None if spill is None else Path(spill)
        if self.spill is not None:
            self.spill.mkdir(parents=True, exist_ok=True)
        self.runs, self.steps, self.heads = [], [], []
        for source, config in zip(sources, configs):
            engine = CalibrationEngine(
                source,
                config,
                placement=placement or default_placement(statistics_dtype(source)),
                progress=False,
                stats_device=self.device,
            )
            self.heads.append(
                engine.adapter.spec.lm_head is not None and engine.skeleton().get_output_embeddings() is not None
            )
            run = engine.start(batches)
            self.runs.append(run)
            self.steps.append(run.layers(StatsRequest(grams=GRAM_SITES)))

    def layer(self, i: int, matchers: list | None = None) -> list[LayerGramSet]:
        """Layer ``i``'s Grams of every input; with ``spill`` they wait in files (the last input's
        too: kept in memory, its down projection's Gram would sit beside every Gram merged before it)."""
        out = []
        for j, steps in enumerate(self.steps):
            step = next(steps)
            if step.index != i:
                raise RuntimeError(f"RegMean statistics out of step: layer {step.index} measured for layer {i}")
            grams = {f"layers.{i}.{site}": step.stats.grams.pop(site) for site in GRAM_SITES}
            step.release()  # the calibration layer is done with: free it before the next input's runs
            del step
            out.append(
                LayerGramSet(
                    grams, self.spill, f"input{j}", matchers[j] if matchers else None, self.runs[j].engine.adapter
                )
            )
            release_free_memory()  # the run's freed temporaries (see hf_symmetry.calibration.memory)
        return out

    def final(self, matchers: list | None = None, head: bool = True) -> list[Tensors]:
        out = []
        for j, (run, steps) in enumerate(zip(self.runs, self.steps)):
            for _ in steps:  # hand the last layer's outputs on (no layer is left to measure)
                raise RuntimeError("RegMean statistics: layers left after the last merged layer")
            if head and self.heads[j]:
                key = "head_in"
                gram = LayerGramSet(
                    {key: run.final(StatsRequest(grams=(key,))).grams[key]},
                    None,
                    "",
                    matchers[j] if matchers else None,
                    run.engine.adapter,
                )
                out.append({key: gram.take(key)})
            else:
                out.append({})
        self.runs = self.steps = []  # drop the calibration activations
        return out


# --------------------------------------------------------------------------- the pass


def _rows(source: TensorSource, key: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a 2-D tensor, reading only those where the source can."""
    if hasattr(source, "get_rows"):
        return source.get_rows(key, torch.arange(start, stop))
    return source.get([key])[key][start:stop]


class _LayerReader:
    """Hands out layer ``i`` of every participant one group of canonical tensors at a time: read
    from the sources group by group (``matched`` None), or from the matched whole layers."""

    def __init__(
        self,
        sources: list[TensorSource],
        adapter: Adapter,
        parts: list,
        shapes: dict,
        i: int,
        like: int,
        matched: list[Tensors] | None = None,
        dtypes: dict | None = None,
    ):
        self.sources, self.adapter, self.i, self.like = sources, adapter, i, like
        self.keys = [set(p[1][i]) for p in parts]
        self.matched = matched
        self.dtypes = dict(dtypes or {})  # checkpoint key -> dtype of the output (``like``'s)
        modeled = adapter.modeled_layer_keys(i) & self.keys[like]
        if matched is None:
            covered = set().union(*(adapter.layer_keys_of(i, set(g)) for g in LAYER_GROUPS))
            if modeled - covered:
                raise RuntimeError(f"layer {i}: tensors {sorted(modeled - covered)[:3]} belong to no merge group")
            self.stand = stand_ins(sorted(modeled), shapes)  # the tensors not read (meta)

    def take(self, j: int, modules: tuple[str, ...]) -> Tensors:
        if self.matched is not None:
            layer = self.matched[j]
            return {k: layer.pop(k) for k in list(layer) if k.split(".")[0] in modules}
        keys = sorted(self.adapter.layer_keys_of(self.i, set(modules)) & self.keys[j])
        if not keys:
            return {}
        raw = self.sources[j].get(keys)
        if j == self.like:
            self.dtypes.update({k: v.dtype for k, v in raw.items()})
        canonical = read_part(self.adapter, self.i, self.stand, raw, torch.float64)
        return {k: v for k, v in canonical.items() if k.split(".")[0] in modules}

    def leftover(self) -> list[str]:
        return sorted({k for layer in self.matched or [] for k in layer})


def _merge_group(
    rule, reader: _LayerReader, modules: tuple[str, ...], grams: list[LayerGramSet] | None, n_inputs: int, label: str
) -> Tensors:
    """One group of layer tensors of every participant merged (canonical, float64)."""
    n = len(rule.entries)
    weight_keys = [f"{m}.weight" for m in modules if f"{m}.weight" in GRAM_OF]
    if not rule.method.uses_grams or not weight_keys:
        parts = [reader.take(j, modules) for j in range(n_inputs)]
        return {key: rule.combine([p[key] for p in parts]) for key in parts[0]}
    site = GRAM_OF[weight_keys[0]]
    present: list[str] = []
    others: dict[str, list[torch.Tensor]] = {}

    def linears(j: int):  # participant j's linear weights of the group, read one at a time
        for module in modules:
            t = reader.take(j, (module,))
            if j == 0 and f"{module}.weight" in t:
                present.append(f"{module}.weight")
            W = t.pop(f"{module}.weight", None)
            for k, v in t.items():  # biases: averaged
                others.setdefault(k, []).append(v)
            del t
            if W is not None:
                yield W
            del W

    def models():  # one participant at a time; the base (when any) only for the tensors that are averaged
        for j in range(n_inputs):
            if j < n:
                yield grams[j].take(f"layers.{reader.i}.{site}"), linears(j)
            else:
                for _ in linears(j):
                    pass

    gen = models()
    try:
        solved = regmean_group(gen, rule.weights, rule.params["alpha"], rule.device)
    except ValueError as exc:
        raise ValueError(f"{label}.{site}: {exc}") from None
    for _ in gen:
        raise RuntimeError("RegMean: more participants with statistics than merged models")
    out = {k: W.cpu() for k, W in zip(present, solved)}
    del solved
    out.update({k: rule.combine(ts) for k, ts in others.items()})
    return out


@dataclass
class MergeInputs:
    """The participants of a streamed merge: their tensor sources (read through ``adapter``), the one whose
    dtypes and layout the output takes (``anchor``), the matchers that map each onto the anchor (None: no
    match), and whether the output ties its LM head to the embedding. ``parts`` (keys by role, per source) and
    ``shapes`` (of every key) are filled in by :func:`stream_merge`."""

    sources: list[TensorSource]
    adapter: Adapter
    anchor: int
    matchers: list | None
    tied_output: bool
    parts: list = field(default_factory=list)
    shapes: dict = field(default_factory=dict)


def merge_layer(i: int, inputs: MergeInputs, rule, sink, layer_grams: LayerGrams | None) -> None:
    sources, adapter, anchor, matchers = inputs.sources, inputs.adapter, inputs.anchor, inputs.matchers
    parts, shapes = inputs.parts, inputs.shapes
    n_inputs = len(sources)
    modeled = adapter.modeled_layer_keys(i)
    rest_keys = [k for k in parts[anchor][1][i] if k not in modeled]
    # the statistics first, so the calibration layers are gone before the merge reads this layer
    # (they wait in files while the layer is read, matched and merged)
    grams = layer_grams.layer(i, matchers) if layer_grams is not None else None
    if matchers:  # the match is solved on whole layers (read one input at a time)
        canonical, dtypes = [], {}
        for j, (s, p) in enumerate(zip(sources, parts)):
            raw = s.get(p[1][i])
            if j == anchor:
                dtypes = {k: v.dtype for k, v in raw.items()}
            canonical.append(adapter.read_layer(i, {k: v for k, v in raw.items() if k in modeled}))
            del raw
        rest = {k: [s.get([k])[k] for s in sources] for k in rest_keys}
        matched = [m.match_layer(i, canonical[anchor], c) for m, c in zip(matchers, canonical)]
        del canonical
        reader = _LayerReader(sources, adapter, parts, shapes, i, anchor, matched, dtypes)
    else:
        reader = _LayerReader(sources, adapter, parts, shapes, i, anchor)
        rest = {k: [s.get([k])[k] for s in sources] for k in rest_keys}
    try:
        pending: Tensors = {}
        for modules in LAYER_GROUPS:
            release_free_memory()  # the previous group's freed temporaries (measured: ~0.1-0.2 GB kept otherwise)
            merged = _merge_group(rule, reader, modules, grams, n_inputs, f"layers.{i}")
            if adapter.spec.attention.qkv:  # a fused qkv tensor is written from all three parts at once
                pending.update(merged)
            elif merged:
                sink.add(adapter.write_layer(i, merged, reader.dtypes))
            del merged
        if pending:
            sink.add(adapter.write_layer(i, pending, reader.dtypes))
        if reader.leftover():
            raise RuntimeError(f"layer {i}: canonical tensors {reader.leftover()[:3]} belong to no merge group")
    finally:
        for g in grams or []:
            g.close()
    for k, ts in rest.items():
        sink.add({k: rule.rest(k, ts)})


def merge_globals(inputs: MergeInputs, rule, sink, matched=None) -> None:
    """The globals of every participant matched and merged; vocabulary-sized ones a block of rows at
    a time where the rule and the match treat rows independently. ``matched()`` runs once the first
    block is matched (RegMean's LM-head Grams: their transform needs the match of the final norm)."""
    sources, adapter, anchor, matchers = inputs.sources, inputs.adapter, inputs.anchor, inputs.matchers
    parts, shapes, tied_output = inputs.parts, inputs.shapes, inputs.tied_output
    keys = [list(p[0]) for p in parts]
    union = sorted(set().union(*keys))
    canon = {k: next(iter(adapter.read_globals({k: torch.empty(shapes[k], device="meta")}))) for k in union}
    big = {k for k in union if canon[k] in _BIG_GLOBALS}
    rows = {shapes[k][0] for k in big}
    residual = bool(matchers) and matchers[0].plan.residual
    blockwise = rule.row_separable and not residual and len(rows) == 1
    n_rows = rows.pop() if blockwise else 1
    width = max((shapes[k][1] for k in big), default=1) if blockwise else 1
    step = max(1, BLOCK_ELEMENTS // width) if blockwise else 1
    out: Tensors = {}
    for start in range(0, n_rows, step):
        stop = min(n_rows, start + step)
        raws = []
        for s, ks in zip(sources, keys):
            wanted = [k for k in ks if start == 0 or k in big]
            if blockwise:
                raw = s.get([k for k in wanted if k not in big])
                raw.update({k: _rows(s, k, start, stop) for k in wanted if k in big})
            else:
                raw = s.get(wanted)
            raws.append(raw)
        like = {k: v.dtype for k, v in raws[anchor].items()}
        gs = [adapter.read_globals(r) for r in raws]
        del raws
        if matchers:
            gs = [m.match_globals(gs[anchor], g) for m, g in zip(matchers, gs)]
        if start == 0 and matched is not None:
            matched()
        gs = [
            {k: v for k, v in g.items() if k != "lm_head.weight"} if tied_output else with_lm_head(g, adapter)
            for g in gs
        ]
        merged = rule.globals(gs)
        del gs
        for vocabulary in (False, True):
            part = {k: v for k, v in merged.items() if (k in _BIG_GLOBALS) == vocabulary}
            new = adapter.write_globals(part, like) if part else {}
            del part
            for k in list(new):
                t = new.pop(k)
                if vocabulary and n_rows > step:  # assembled block by block in the output dtype
                    if k not in out:
                        out[k] = torch.empty((n_rows, *t.shape[1:]), dtype=t.dtype)
                    out[k][start:stop] = t
                else:
                    sink.add({k: t})
                del t
        del merged
    for k in list(out):
        sink.add({k: out.pop(k)})


def stream_merge(
    inputs: MergeInputs,
    rule,
    sink,
    progress: bool = True,
    desc: str = "merge",
    layer_grams: LayerGrams | None = None,
) -> None:
    """Every participant merged by ``rule`` into ``sink`` (written in the dtypes of
    ``sources[anchor]``), layer by layer, matched by ``inputs.matchers`` when given. With ``layer_grams``
    (RegMean) each layer's statistics are measured as the layer comes and the globals merged last
    (the LM head's Gram exists only after the last layer)."""
    sources, adapter, anchor, matchers = inputs.sources, inputs.adapter, inputs.anchor, inputs.matchers
    parts = [partition_keys(adapter, s.keys()) for s in sources]
    shapes = sources[anchor].shapes()
    for s in sources:
        for k, shape in s.shapes().items():
            shapes.setdefault(k, shape)
    inputs.parts, inputs.shapes = parts, shapes
    if layer_grams is None:
        merge_globals(inputs, rule, sink)
    for i in tqdm(range(adapter.n_layers), desc=desc, disable=not progress, unit="layer"):
        merge_layer(i, inputs, rule, sink, layer_grams)
    if layer_grams is not None:
        release_free_memory()
        merge_globals(
            inputs,
            rule,
            sink,
            matched=lambda: rule.set_grams(layer_grams.final(matchers, head=not inputs.tied_output)),
        )
        rule.set_grams(None)
    for k in parts[anchor][2]:
        sink.add({k: rule.rest(k, [s.get([k])[k] for s in sources])})
