"""The math: group elements (:mod:`.groups`), head layouts (:mod:`.layout`) and the group
actions on canonical weights (:mod:`.actions`)."""

from .actions import NotASymmetry
from .layout import HeadLayout

__all__ = ["HeadLayout", "NotASymmetry"]
