"""One calibration pass, layer by layer (the engine's step 3 and its sequential mode): the activations
entering the next layer (:class:`Activations`), the loop that builds each layer, collects its
statistics and hands its outputs on (:class:`CalibrationRun`), and the step it yields per layer
(:class:`LayerStep`: ``replace``, ``collect``, ``release``). Started by
:meth:`hf_symmetry.calibration.engine.CalibrationEngine.start`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from tqdm.auto import tqdm

from .memory import release_free_memory
from .model import CalibrationModel, Tensors
from .statistics import FINAL_SITES, Accumulator, LayerStats, StatsRequest, base_site, capture_sites


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class Activations:
    """The hidden states of every calibration batch at one place of the model: per batch a
    ``[batch, seq, hidden]`` tensor on ``home`` (the device, or the CPU when they do not fit)."""

    batches: list[torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.batches)


@dataclass
class LayerStep:
    """One layer of a run, yielded once its statistics are collected (see
    :meth:`CalibrationRun.layers`)."""

    index: int
    module: torch.nn.Module  # the original layer, on the device
    stats: LayerStats | None
    run: "CalibrationRun" = field(repr=False)
    replacement: torch.nn.Module | None = None
    #: per batch, the original model's activations at the sites asked for with ``keep_original``
    #: (and ``layer_out``), from the pass that built this step: :meth:`collect` takes its ``cross``
    #: sites from them once the original layer is released
    original_acts: list[Tensors] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Drop the original layer now (its outputs are already computed and handed on): its weights
        are then freed before the caller's own work on this layer, not when the next layer is built;
        so is the original stream's input to it (one ``tokens × hidden`` copy), unless kept.
        :meth:`collect` still works for ``cross`` statistics at the sites kept with
        :meth:`CalibrationRun.layers`' ``keep_original`` (``layer_in`` among them where needed)."""
        self.module = None
        if self.run.original is not None:
            self.run.original = Activations([])  # handed on from this layer's outputs as before

    def replace(self, module: torch.nn.Module) -> None:
        """Hand on the outputs of ``module`` (the converted layer, called like the original with
        the same arguments) instead of the original layer's."""
        self.replacement = module

    def collect(self, request: StatsRequest, module: torch.nn.Module | None = None) -> LayerStats:
        """Statistics of ``module`` (default: the original layer) on this layer's inputs (the
        converted stream; the original stream's sites for ``cross`` come from the original layer, or
        from those kept with ``keep_original`` once it is released)."""
        if self.module is None and (module is None or (request.original_sites() and self.original_acts is None)):
            raise RuntimeError(
                f"layer {self.index} was released: collect needs a module to run, and cross "
                "statistics the original stream's sites kept with keep_original"
            )
        return self.run._collect(
            self.index,
            module or self.module,
            request,
            keep_outputs=False,
            original_module=self.module,
            original_acts=self.original_acts,
        )[0]

    def tensors(self) -> Tensors:
        """This layer's checkpoint tensors (original dtypes)."""
        return self.run.engine.layer_tensors(self.index)


class CalibrationRun:
    """The state of one pass: the activations entering the next layer (and, with
    ``carry_original``, the original model's), and each layer's recorded arguments."""

    def __init__(self, engine: CalibrationModel, batches, records: list[dict], acts: Activations, carry_original: bool):
        self.engine, self.records = engine, records
        self.tokens = int(sum(b.numel() for b in batches))
        self.stream = acts
        self.original = Activations(list(acts.batches)) if carry_original else None
        self.next_layer = 0

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.engine.device, non_blocking=True)

    def _home(self, like: Activations, t: torch.Tensor) -> torch.Tensor:
        return t if like.batches and like.batches[0].device == t.device else t.to(like.batches[0].device)

    def _new_stats(self, index, request) -> tuple[LayerStats, Accumulator]:
        stats = LayerStats(index)
        return stats, Accumulator(request, stats, self.engine.adapter.eps, self.engine.stats_device)

    def _collect(self, *args, **kwargs):
        with torch.no_grad(), self.engine.precision():
            return self._collect_batches(*args, **kwargs)

    def _collect_batches(
        self,
        i: int,
        module,
        request: StatsRequest,
        keep_outputs: bool,
        original_module=None,
        original_acts: list[Tensors] | None = None,
        keep_original: tuple[str, ...] = (),
        converted_outputs: bool = True,
    ):
        """Run batch by batch: statistics of ``request`` and (``keep_outputs``) the outputs of
        ``module`` on the converted stream and of ``original_module`` on the original stream (default
        ``module``; ``None`` where ``original_acts`` holds the original stream's sites instead).
        ``keep_original``: also return, per batch, the original stream's activations at these sites
        and its output (``layer_out``). ``converted_outputs=False``: ``module``'s outputs on the
        converted stream are not needed (the caller replaces the layer): it is not run there unless
        ``request`` reads a site inside it."""
        adapter = self.engine.adapter
        stats, acc = self._new_stats(i, request)
        sites = {base_site(s) for s in request.sites()}
        osites = {base_site(s) for s in request.original_sites()}
        if original_module is None and original_acts is None:
            original_module = module
        need_original = self.original is not None and (bool(osites) or keep_outputs)
        if need_original and original_module is None:
            missing = osites - set(original_acts[0]) - ({"layer_in"} if self.original.batches else set())
            if missing:
                raise RuntimeError(
                    f"layer {i} was released and the original stream's {sorted(missing)} were "
                    "not kept (CalibrationRun.layers' keep_original)"
                )
        outs, oouts, kept = [], [], []
        site_modules = adapter.site_modules()
        for b, x in enumerate(self.stream.batches):
            args, kwargs = self.records[b][i]
            x_dev = self._to_device(x)
            oacts = None
            if need_original:
                if original_module is None:
                    oacts = {s: self._to_device(t) for s, t in original_acts[b].items()}
                    if self.original.batches:  # (the input is dropped with the released layer)
                        oacts.setdefault("layer_in", self._to_device(self.original.batches[b]))
                else:
                    xo = self._to_device(self.original.batches[b])
                    with capture_sites(original_module, site_modules, osites | set(keep_original)) as got:
                        yo = _first(original_module(xo, *args, **kwargs))
                    oacts = dict(got, layer_in=xo, layer_out=yo)
                    if keep_outputs:
                        oouts.append(self._home(self.original, yo))
                    if keep_original:
                        kept.append(
                            {
                                s: oouts[-1]
                                if s == "layer_out" and keep_outputs
                                else self._home(self.original, oacts[s])
                                for s in (*keep_original, "layer_out")
                            }
                        )
            if not converted_outputs and sites <= {"layer_in"}:
                acc.add({"layer_in": x_dev}, oacts)
                del oacts
                continue
            with capture_sites(module, site_modules, sites) as got:
                y = _first(module(x_dev, *args, **kwargs))
            acc.add(dict(got, layer_in=x_dev, layer_out=y), oacts)
            if keep_outputs and converted_outputs:
                outs.append(self._home(self.stream, y))
            del got, oacts
        return stats, outs, oouts, kept

    def layers(
        self,
        request: StatsRequest,
        stop: int | None = None,
        only: set[int] | None = None,
        keep_original: tuple[str, ...] = (),
        replaced: bool = False,
    ) -> Iterator[LayerStep]:
        """Walk layers ``next_layer .. stop-1``: build each, collect ``request`` (on layers in
        ``only``, default all), yield the step, then hand the outputs on (the replacement's, if
        the caller set one). ``keep_original`` (with ``carry_original``): the original stream's
        activations at these sites are kept on the step (:attr:`LayerStep.original_acts`, one
        ``tokens × width`` tensor per site), so that it can release the original layer and still
        collect cross statistics against them. ``replaced``: the caller replaces every layer
        (:meth:`LayerStep.replace`), so the original layer is not run on the converted stream (its
        outputs there would be thrown away) unless ``request`` reads a site inside it."""
        engine = self.engine
        stop = engine.adapter.n_layers if stop is None else stop
        bar = tqdm(range(self.next_layer, stop), desc="calibration", unit="layer", disable=not engine.progress)
        for i in bar:
            release_free_memory()  # the previous layer's temporaries, before this layer is built
            module = engine.layer_module(i)
            want = request if (only is None or i in only) else StatsRequest()
            stats, outs, oouts, kept = self._collect(
                i,
                module,
                want,
                keep_outputs=True,
                original_module=module,
                keep_original=keep_original if self.original is not None else (),
                converted_outputs=not replaced,
            )
            step = LayerStep(
                i, module, stats if (only is None or i in only) else None, self, original_acts=kept or None
            )
            del module  # the step holds the layer: a caller that sets step.module = None frees it now
            yield step
            if replaced and step.replacement is None:
                raise RuntimeError(f"layer {i} was not replaced (CalibrationRun.layers(replaced=True))")
            if step.replacement is not None:
                with torch.no_grad(), engine.precision():  # a generator body is outside any decorator's no_grad
                    outs = [
                        self._home(
                            self.stream,
                            _first(
                                step.replacement(self._to_device(x), *self.records[b][i][0], **self.records[b][i][1])
                            ),
                        )
                        for b, x in enumerate(self.stream.batches)
                    ]
            self.stream = Activations(outs)
            if self.original is not None:
                self.original = Activations(oouts)
            self.next_layer = i + 1
            # the caller's loop variable still holds this step while the next layer is built: let
            # go of its layers, so one layer is in memory at a time
            step.module = step.replacement = step.original_acts = None
            del step, outs, oouts, kept

    def final(self, request: StatsRequest) -> LayerStats:
        with torch.no_grad(), self.engine.precision():
            return self._final(request)

    def _final(self, request: StatsRequest) -> LayerStats:
        """Statistics after the last layer: sites ``final_in`` (the stream) and ``head_in`` (the final
        norm's output; the stream itself for families without a final norm)."""
        engine = self.engine
        if self.next_layer != engine.adapter.n_layers:
            raise RuntimeError(
                f"final statistics need all {engine.adapter.n_layers} layers run (next layer: {self.next_layer})"
            )
        bad = {base_site(s) for s in request.sites() | request.original_sites()} - set(FINAL_SITES)
        if bad:
            raise ValueError(f"after the last layer only {FINAL_SITES} exist, not {sorted(bad)}")
        norm = engine.final_norm_module()
        stats, acc = self._new_stats(None, request)
        for b, x in enumerate(self.stream.batches):
            x = self._to_device(x)
            acts = {"final_in": x, "head_in": norm(x) if norm is not None else x}
            oacts = None
            if self.original is not None and (request.cross or request.drift):
                xo = self._to_device(self.original.batches[b])
                oacts = {"final_in": xo, "head_in": norm(xo) if norm is not None else xo}
            acc.add(acts, oacts)
        return stats
