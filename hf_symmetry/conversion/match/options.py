"""What ``match`` is asked to match (:class:`MatchOptions`) and what that resolves to on one family
(:class:`MatchPlan`): the symmetries matched, each refused where the family lacks it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from ...architectures import Adapter
from ...architectures.capabilities import allows
from ...flags import flag


@dataclass(frozen=True)
class MatchOptions:
    """What to match. ``heads='auto'`` matches QK and VO where the family has them as symmetries
    (VO only under QK-norm); naming ``qk`` or ``both`` on a QK-norm family is refused."""

    heads: Literal["auto", "both", "qk", "vo", "none"] = flag(
        "auto",
        "per-KV-group head rotations to match (default auto: QK and VO, VO only under QK-norm)",
        choices=["auto", "both", "qk", "vo", "none"],
    )
    ffn: bool = flag(
        True, "match FFN neurons by linear assignment (default: on)", action=argparse.BooleanOptionalAction
    )
    scaling: bool = flag(False, "also match per-group QK and VO scalings (quartic)", action="store_true")
    residual: bool = flag(
        False,
        "also match the residual stream by Procrustes after norm fusion (RMSNorm families; "
        "norm weights become 1 and tied embeddings are untied)",
        action="store_true",
    )
    residual_iters: int = flag(
        0,
        "refinement passes for the residual rotation over every weight (default 0: embeddings and LM head only)",
        type=int,
    )

    def plan(self, adapter: Adapter) -> "MatchPlan":
        if self.heads not in ("auto", "both", "qk", "vo", "none"):
            raise ValueError(f"heads must be one of auto, both, qk, vo, none; got {self.heads!r}")
        if self.residual_iters < 0:
            raise ValueError("residual_iters must be >= 0")
        if self.residual_iters and not self.residual:
            raise ValueError("residual_iters refines the residual-stream rotation: it needs residual matching")
        qk = self.heads in ("both", "qk") or (self.heads == "auto" and allows(adapter, "qk_rotation"))
        vo = self.heads in ("auto", "both", "vo")
        plan = MatchPlan(
            qk=qk,
            vo=vo,
            qk_scale=self.scaling and qk,
            vo_scale=self.scaling and vo,
            ffn=self.ffn,
            residual=self.residual,
            residual_iters=self.residual_iters,
        )
        for symmetry in plan.symmetries():
            adapter.check_supports(symmetry)
        return plan


@dataclass(frozen=True)
class MatchPlan:
    """Options resolved against one family (see :meth:`MatchOptions.plan`)."""

    qk: bool = False
    vo: bool = False
    qk_scale: bool = False
    vo_scale: bool = False
    ffn: bool = False
    residual: bool = False
    residual_iters: int = 0

    def symmetries(self) -> list[str]:
        names = [
            ("residual_rotation", self.residual),
            ("qk_rotation", self.qk),
            ("vo_rotation", self.vo),
            ("qk_scaling", self.qk_scale),
            ("vo_scaling", self.vo_scale),
            ("ffn_permutation", self.ffn),
        ]
        return [n for n, on in names if on]
