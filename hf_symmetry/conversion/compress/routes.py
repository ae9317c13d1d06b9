"""One compress conversion as one object (:class:`CompressRun`), and the routes an output folder takes
(:class:`Route`): the compressed family (:mod:`.pipeline`), SliceGPT as the source's stock family
(:mod:`.stock`), LayerNorm decoders through the RMS-decoder family (:mod:`.layernorm_decoders`). A route
refuses what it cannot do before any work (:meth:`Route.check`), then writes its weights into the run's sink
and its config into the run's folder (:meth:`Route.write`)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from ...calibration import CalibrationEngine, CalibrationText
from ...checkpoint_io import CheckpointReader, ShardedWriter
from ...devices import Placement, linalg_device
from ...flags import Flag, nested
from ..stream import TensorSource
from .options import CompressOptions
from .report import CompressReport

#: compress's calibration: its first 16384 tokens in sequences of 512 (the text is ``--calib``'s; a run handed
#: token ids reads only the sizes)
CALIBRATION = CalibrationText("britannica-calib", tokens=16384, seq_len=512)


@dataclass(frozen=True)
class CompressRun:
    """One compress conversion: everything its steps read. ``source`` (a checkpoint reader or any tensor
    source) with its ``config`` dict (``hf_config``: its config object, where there is one), the validated
    ``options``, the calibration token ids ``calib_ids`` of the ``calibration`` text (``None`` where the
    method needs none), where calibration runs (``placement``; ``None``: CPU float32), the output ``dtype``,
    the ``sink`` receiving tensors as they are made and the temporary output ``folder`` (``None``: in
    memory). A caller may hand in the ``plan``, the calibration ``stats`` and the starting ``rotations``."""

    source: TensorSource
    config: dict
    options: CompressOptions = CompressOptions()
    calib_ids: torch.Tensor | None = None
    placement: Placement | None = None
    progress: bool = True
    dtype: torch.dtype = torch.float32
    sink: object = None
    folder: Path | None = None
    hf_config: object = None
    plan: object = None
    stats: object = None
    rotations: list | None = None
    calibration: CalibrationText = nested(
        CalibrationText,
        CALIBRATION,
        text=Flag(
            "calibration text: a UTF-8 file or an embedded name such as britannica-calib "
            "(needed for stages f and w and for slice)",
            name="--calib",
            metavar="TEXT",
            unset=None,
        ),
        tokens=Flag(
            f"calibration tokens (default: {CALIBRATION.tokens})",
            name="--calib-tokens",
            type=int,
            unset=CALIBRATION.tokens,
        ),
        seq_len=Flag(
            f"tokens per calibration batch (default: {CALIBRATION.seq_len})",
            name="--calib-seq-len",
            type=int,
            unset=CALIBRATION.seq_len,
        ),
    )

    def engine(self) -> CalibrationEngine:
        """The calibration engine over the source, on the run's placement."""
        return CalibrationEngine(self.source, self.config, placement=self.placement, progress=self.progress)

    @property
    def device(self) -> torch.device:
        """Where the solvers' float64 linear algebra runs (CPU for MPS)."""
        return linalg_device(self.placement)

    def require_calibration(self) -> None:
        """Fail, with the reason, where the run has fewer than two calibration tokens."""
        if self.calib_ids is None or self.calib_ids.numel() < 2:
            what = "sequential calibration" if self.options.sequential else "this compression"
            raise ValueError(f"{what} needs calibration text (--calib) with at least two tokens")

    @property
    def ids(self) -> torch.Tensor:
        """The first ``calibration.tokens`` token ids (refused without two)."""
        self.require_calibration()
        return self.calib_ids[: self.calibration.tokens]

    @property
    def seq_len(self) -> int:
        return self.calibration.seq_len


def check_calibration(calibration: CalibrationText | None) -> None:
    """Refuse calibration sizes below two tokens (``None``: no text given)."""
    if calibration is None:
        return
    for name, value in (("calib_tokens", calibration.tokens), ("calib_seq_len", calibration.seq_len)):
        if value < 2:
            raise ValueError(f"{name} must be a positive integer, got {value}")


class CountingSink:
    """Every route's sink: each module's tensors go straight to the shard writer, their parameters counted
    (not the rotary buffers a stock family carries)."""

    row_blocks = True  # takes RowBlocks, which the shard writer streams (:meth:`.assemble.Assembler.put`)

    def __init__(self, writer: ShardedWriter):
        self.writer = writer
        self.counted = 0

    def add(self, tensors: dict) -> None:
        self.counted += sum(t.numel() for k, t in tensors.items() if not k.endswith("rotary_emb.inv_freq"))
        self.writer.add(tensors)


class Route(ABC):
    """One way a compress folder is written. ``stock_refusal``: why a SliceGPT output is not the source's
    stock family (``None``: not asked, or it is)."""

    def __init__(self, stock_refusal: str | None = None):
        self.stock_refusal = stock_refusal

    def check(self, reader: CheckpointReader, options: CompressOptions) -> None:
        """Refuse, before any work, what this route cannot do (an unreachable ratio, a bad width)."""

    @abstractmethod
    def write(self, run: CompressRun) -> CompressReport:
        """Write the weights into ``run.sink`` and the config (and any remote code) into ``run.folder``."""

    def output_lines(self, report: CompressReport, config: dict) -> list[str]:
        """The size report's lines on the output family: for SliceGPT, why it stays in the remote-code
        family (and, for a tied head, what untying would cost)."""
        if self.stock_refusal is None:
            return []
        reason = self.stock_refusal
        lines = [f"  output: compressed family (trust_remote_code=True): {reason}"]
        acc = report.accounting
        if acc.head_mix_params and "--untie" in reason:
            width = math.isqrt(acc.head_mix_params)  # the mix is width × width
            lines.append(
                f"  tied head: head mix {acc.head_mix_params:,} parameters; --untie would cost vocab × width "
                f"= {int(config['vocab_size']) * width:,} at this width (the ratio then picks a narrower one)"
            )
        return lines
