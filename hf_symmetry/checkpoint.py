"""Renamed :mod:`hf_symmetry.checkpoint_io` (issue 40: ``checkpoint.py`` in a conversion package is that
conversion's entry point on checkpoint folders; this one was the safetensors I/O). This re-export is kept
only for the modules another piece of work is editing now (``conversion/rotate.py``,
``conversion/gguf_export.py``, ``conversion/to_tpa/checkpoint.py``, ``commands/spectra.py``); remove it,
and its entry in tests/test_layers.py's LAYERS, once they import ``checkpoint_io``."""

from .checkpoint_io import (
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_output_dir,
    copy_side_files,
    parse_size,
    write_config,
)

__all__ = [
    "CheckpointReader",
    "ShardedWriter",
    "atomic_output_dir",
    "check_output_dir",
    "copy_side_files",
    "parse_size",
    "write_config",
]
