"""Size figures of a saved model folder, the same in every card and report: parameters stored
(:func:`count_stored_parameters`), bytes on disk, and the KV cache per token; and a converted folder's speed
and bytes against its source (:func:`speed_card_entry`, :func:`speed_sentence`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from safetensors import safe_open
from transformers import CONFIG_MAPPING

from ..assets import resolve_model
from ..evaluation.speed import SpeedComparison
from .values import fmt_number

_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _safetensors_files(folder: Path) -> list[Path]:
    # layer_map.safetensors (conversion.layer_map) holds the conversion's rotations, not parameters
    return sorted(p for p in folder.glob("*.safetensors") if p.name != "layer_map.safetensors")


_INDEX_DTYPES = ("I64", "I32", "I16", "I8", "U8", "BOOL")  # index buffers (BERT's position_ids), not parameters


def count_stored_parameters(folder: str | os.PathLike) -> int:
    """The parameter count every report and card uses: floating-point tensors stored in the
    folder's safetensors, each counted once (a tied LM head is not stored)."""
    return _parameter_count(Path(folder))[0]


def _parameter_count(folder: Path) -> tuple[int, str | None]:
    """Parameters stored in the folder's safetensors (floating-point tensors, each stored tensor
    counted once) and the dtype most of them have."""
    total, by_dtype = 0, {}
    for f in _safetensors_files(folder):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                if sl.get_dtype() in _INDEX_DTYPES:
                    continue
                n = math.prod(sl.get_shape())
                total += n
                by_dtype[sl.get_dtype()] = by_dtype.get(sl.get_dtype(), 0) + n
    main = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return total, main


def kv_cache_elements_per_token(config: dict) -> int | None:
    """Elements the KV cache holds per token, all layers, for decoders whose cache layout is
    known: stock K/V (``2 n_kv d_h`` per layer); hf_symmetry's own families state theirs in their
    config class (``kv_cache_elements_per_token``: FaRR's per-layer head dims, TPA's factor cache)."""
    arch = " ".join(config.get("architectures") or [])
    model_type = str(config.get("model_type", ""))
    if not ("CausalLM" in arch or "LMHead" in arch):
        return None
    layers = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    if not (layers and heads and hidden):
        return None
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads

    cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if cls is not None and hasattr(cls, "kv_cache_elements_per_token"):  # hf_symmetry's own families say it
        return cls.from_dict(dict(config)).kv_cache_elements_per_token(per_layer=False)
    if cls is None or cls.__module__.startswith("hf_symmetry."):
        return None  # a family whose cache is not stated (or not known here): its conversion reports it
    return 2 * layers * kv_heads * head_dim


def kv_cache_bytes_per_token(config: dict, dtype_bytes: int) -> int | None:
    elements = kv_cache_elements_per_token(config)
    return None if elements is None else elements * dtype_bytes


def measure_folder(folder: str | os.PathLike) -> dict:
    """Size figures of a saved model folder: parameters, bytes on disk (weights), and the
    KV-cache bytes per token for stock decoders."""
    folder = Path(folder)
    params, dtype = _parameter_count(folder)
    size = {
        "parameters": params,
        "bytes": sum(f.stat().st_size for f in _safetensors_files(folder)),
        "dtype": {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype),
    }
    cfg_path = folder / "config.json"
    if cfg_path.is_file() and dtype in _DTYPE_BYTES:
        kv = kv_cache_bytes_per_token(json.loads(cfg_path.read_text()), _DTYPE_BYTES[dtype])
        if kv is not None:
            size["kv_cache_bytes_per_token"] = kv
    return size


def speed_card_entry(speed: SpeedComparison, original: str | os.PathLike, out: str | os.PathLike) -> dict:
    """The card's speed entry: the verification's timing of ``out`` against ``original``
    (:class:`~hf_symmetry.evaluation.speed.SpeedComparison`) and the weight bytes of both folders
    (:func:`measure_folder`), with ``bytes_ratio`` = out / original."""
    source, converted = measure_folder(resolve_model(original))["bytes"], measure_folder(out)["bytes"]
    return {**speed.as_dict(), "bytes": {"source": source, "converted": converted}, "bytes_ratio": converted / source}


def speed_sentence(speed: dict) -> str:
    """The one sentence cards and commands print for a speed entry (:func:`speed_card_entry`)."""
    threads = speed.get("threads")
    where = speed["device"] + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
    decode = f", decode {speed['decode_speedup']:.2f}x" if speed.get("decode_speedup") else ""
    return (
        f"speed against the source on this machine ({where}, {speed['dtype']}): prefill {speed['prefill_speedup']:.2f}x"
        f"{decode}; weights {speed['bytes_ratio']:.2f}x the bytes ({fmt_number(speed['bytes']['converted'])} of "
        f"{fmt_number(speed['bytes']['source'])})"
    )
