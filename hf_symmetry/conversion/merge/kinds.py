"""Renamed :mod:`hf_symmetry.conversion.merge.methods` (issue 40: the merge methods as classes). This
re-export is kept only for ``hf_symmetry/commands/merge.py``, which another piece of work is editing now;
remove it once that file imports ``..conversion.merge.methods``."""

from .methods import METHOD_ALIASES, METHODS

__all__ = ["METHOD_ALIASES", "METHODS"]
