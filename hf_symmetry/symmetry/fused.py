"""Moved to :mod:`hf_symmetry.solvers.fused` (issue 40). This re-export is kept only for
``hf_symmetry/commands/spectra.py``, which another piece of work is editing now; remove it (and its
entry in tests/test_layers.py's UPWARD_IMPORTS) once that file imports ``..solvers.fused``."""

from ..solvers.fused import check_tau

__all__ = ["check_tau"]
