"""The symmetry maths: group elements (:mod:`.groups`), head layouts (:mod:`.layout`), the group
actions on canonical weights (:mod:`.actions`) and the closed-form solvers that find a group element
matching one model to another (:mod:`.procrustes`). The compression and FaRR solvers are
:mod:`hf_symmetry.solvers`."""

from .actions import NotASymmetry
from .layout import HeadLayout

__all__ = ["HeadLayout", "NotASymmetry"]
