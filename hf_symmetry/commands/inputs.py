"""Every command's inputs checked before any byte is written, in one place.

:func:`check_inputs` runs on the parsed arguments of every command (:func:`hf_symmetry.cli.main` calls it before
the command's own ``run``): each model folder (:func:`check_model_folder`: a readable ``config.json`` that is a JSON
object, safetensors weights, shapes that agree with the config), each text (:func:`check_text`: not empty, not
binary, UTF-8) and each output file (:func:`check_output_file`: not a folder, in a folder that exists and can be
written). A bad input raises ``ValueError`` or ``FileNotFoundError`` with one line naming the input and what is
wrong: the command line prints it and exits with status 2. :func:`check_text_tokens` (called by the commands that
know their tokenizer and token counts) refuses a text too short for the tokens asked for."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch
from transformers import AutoConfig

from ..assets import MODEL_ALIASES, TEXT_NAMES, resolve_model, resolve_text
from ..evaluation.compare import auto_class, load_tokenizer
from ..modeling import register_auto_classes
from ..text import read_text, tokenize_text

#: per command, the argument names (``args.<dest>``) that name model folders read by it
MODEL_ARGS = {
    "rotate": ("model",),
    "verify": ("original", "converted"),
    "eval": ("model",),
    "to-tpa": ("model",),
    "match": ("anchor", "source"),
    "spectra": ("model",),
    "farr": ("model",),
    "compress": ("model",),
    "export-gguf": ("model",),
    "heal": ("model", "teacher"),
    "push": ("folder",),
}
#: argument names that name texts (a file or an embedded text name), with their flag
TEXT_ARGS = {
    "text": "--text",
    "train_text": "--text",  # (heal's: its training text)
    "calib": "--calib",
    "calibrate": "--calibrate",
    "calib_text": "--calib-text",
    "eval_text": "--eval-text",
}
#: argument names that name files a command writes besides OUT, with their flag
OUTPUT_FILE_ARGS = {"json_out": "--json", "write_imatrix": "--write-imatrix"}
#: the ``--calib-tokens`` default of each command that calibrates (what :func:`check_text_tokens` treats as "not asked
#: for"; tests/commands/test_bad_inputs.py checks these against the parsers)
CALIB_TOKENS_DEFAULT = {"to-tpa": 2048, "farr": 2048, "spectra": 2048, "compress": 16384}
#: weights formats hf_symmetry does not read (they are pickles: loading one runs its code)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_inputs(args) -> None:
    """Check every model folder, text and output file of one command's parsed ``args``, before any work."""
    command = getattr(args, "command", None)
    for dest, flag in OUTPUT_FILE_ARGS.items():
        if getattr(args, dest, None):
            flag = "--json-out" if (command, dest) == ("export-gguf", "json_out") else flag  # (its own name)
            check_output_file(getattr(args, dest), flag)
    for dest, flag in TEXT_ARGS.items():
        value = getattr(args, dest, None)
        for text in value if isinstance(value, list) else [value]:  # (heal's --text may be given several times)
            if isinstance(text, (str, os.PathLike)) and text:
                check_text(text, flag)
    trust = bool(getattr(args, "trust_remote_code", False))
    for dest in MODEL_ARGS.get(command, ()):
        value = getattr(args, dest, None)
        if value is not None or command in ("rotate", "eval", "to-tpa", "compress"):  # (None: the default model)
            check_model_folder(value, trust_remote_code=trust)
    if command == "verify":
        _check_same_vocabulary(args.original, args.converted)
    if command == "merge":
        _check_merge_inputs(args, trust)
    if command == "families" and getattr(args, "config", None):
        path = Path(args.config) / "config.json" if Path(args.config).is_dir() else Path(args.config)
        if path.is_file():
            config_json(path)


def _check_merge_inputs(args, trust: bool) -> None:
    """``merge``: its models are every INPUT but the last (OUT), or the recipe's (checked when it is read)."""
    inputs = list(getattr(args, "inputs", None) or [])
    if getattr(args, "method", None) and len(inputs) > 2:
        for model in inputs[:-1]:
            check_model_folder(model, trust_remote_code=trust)
    for dest in ("base", "anchor"):
        value = getattr(args, dest, None)
        if value and value != "auto" and not str(value).isdigit():  # (the anchor may be "auto" or an input's index)
            check_model_folder(value, trust_remote_code=trust)


def check_output_file(path: str | os.PathLike, flag: str = "--json") -> None:
    """A file the command will write besides OUT: not a folder, its folder exists and can be written."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path} cannot be written (permission denied)")


def check_text(name: str | os.PathLike, flag: str = "--text") -> Path:
    """A text argument (a file or an embedded name): the file exists, is not empty and is UTF-8 text. Returns
    its path. The embedded texts are known good."""
    path = resolve_text(name)
    if str(name) not in TEXT_NAMES:
        try:
            read_text(path)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return path


def check_text_tokens(name, tokenizer_from, needs: dict[str, tuple[int, int]]) -> None:
    """Refuse a text too short (in ``tokenizer_from``'s tokens, no special tokens) for what its flags ask:
    ``needs`` is ``{"--flag": (value, default)}``. A value given on the command line (not the default) asks for that
    many tokens; a flag left at its default takes what the text has (the card records the count), at least 2; a
    flag at 0 asks for nothing."""
    wanted = {flag: (value if value != default else min(value, 2)) for flag, (value, default) in needs.items()}
    wanted = {flag: n for flag, n in wanted.items() if n and n > 0}
    if not wanted:
        return
    flag, need = max(wanted.items(), key=lambda kv: kv[1])
    path = resolve_text(name)
    try:
        tokenizer = load_tokenizer(tokenizer_from)
    except Exception as exc:  # transformers raises many kinds (OSError, KeyError, ValueError) for a broken tokenizer
        raise ValueError(f"the tokenizer of {tokenizer_from} does not load: {_last_line(exc)}") from None
    have = tokenize_text(tokenizer, read_text(path), max_tokens=need).numel()
    if have < need and need == 2:
        raise ValueError(f"text {name} has {have} token: {flag} needs at least 2 (give a longer text)")
    if have < need:
        raise ValueError(
            f"text {name} has {have} tokens, fewer than the {need} that {flag} asks for: give a longer text or "
            f"lower {flag}"
        )


def is_causal_lm_folder(folder: Path) -> bool:
    """Whether the model in ``folder`` is a causal LM (its ``config.json`` names an LM class, or no class and its
    weights hold an ``lm_head``): what the verification measures perplexity on."""
    arch = " ".join(_config_dict(folder).get("architectures") or [])
    return "CausalLM" in arch or "LMHead" in arch or (not arch and "lm_head.weight" in _safetensors_shapes(folder))


def check_model_folder(name, trust_remote_code: bool = False) -> Path:
    """A model argument: an embedded alias, or a folder with a ``config.json`` holding a JSON object, safetensors
    weights (a folder of pickles only is refused, with what to do) and tensor shapes that agree with the config.
    Returns the folder."""
    if name is None or str(name) in MODEL_ALIASES:
        return resolve_model(name)
    if Path(name).is_file():
        raise ValueError(f"{name} is a file, not a model folder (a folder with config.json and *.safetensors)")
    folder = resolve_model(name)
    config = _config_dict(folder)
    shapes = _safetensors_shapes(folder)
    if config.get("model_type") is not None and not config.get("quantization_config"):  # (packed weights: no shapes)
        _check_shapes(folder, shapes, trust_remote_code)
    return folder


def _config_dict(folder: Path) -> dict:
    return config_json(folder / "config.json")


def config_json(path: Path) -> dict:
    """A ``config.json`` file as a dict; a file that is not UTF-8, not JSON (the error and where) or not a JSON
    object is refused naming the file."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object: not a model configuration")
    return config


def _safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` from the headers of the folder's weights files (nothing else is read)."""
    files = sorted(p for p in folder.glob("*.safetensors") if p.name != "layer_map.safetensors")
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
        if pickles:
            raise ValueError(
                f"{folder} holds only pickle weights ({', '.join(pickles[:3])}); hf-symmetry reads safetensors only: "
                "convert them once, in an environment you trust (loading a pickle runs its code), with "
                f"AutoModel.from_pretrained({str(folder)!r}).save_pretrained(NEW_FOLDER) (transformers writes "
                "safetensors)"
            )
        raise FileNotFoundError(f"{folder} holds no weights (no *.safetensors file)")
    shapes = {}
    for file in files:
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > os.path.getsize(file) - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(n))
            end = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if end > os.path.getsize(file):
                raise ValueError(f"the file is truncated ({os.path.getsize(file)} bytes, its header names {end})")
        except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"corrupt safetensors file {file}: {exc}") from None  # (CheckpointReader's words)
        shapes.update({k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)})
    return shapes


def _check_shapes(folder: Path, shapes: dict[str, list[int]], trust_remote_code: bool) -> None:
    """The weights' shapes against a model built from ``config.json`` on the meta device (no memory): a tensor whose
    shape differs is named with both shapes. A config transformers refuses is refused with its first line; a
    family transformers does not know here (remote code not trusted) is left to the command."""
    register_auto_classes()
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many kinds (ValueError, KeyError, its validation errors)
        if "trust_remote_code" in str(exc) or "does not recognize this architecture" in str(exc):
            return
        raise ValueError(f"{folder}/config.json is refused by transformers: {_last_line(exc)}") from None
    try:
        with torch.device("meta"):
            model = auto_class(config, has_lm_head="lm_head.weight" in shapes).from_config(
                config, trust_remote_code=trust_remote_code
            )
    except Exception as exc:  # a config that builds no model: say so in one line
        raise ValueError(f"{folder}/config.json builds no model: {_last_line(exc)}") from None
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    _check_layer_count(folder, shapes, getattr(config, "num_hidden_layers", None))
    prefix = getattr(model, "base_model_prefix", "") or ""
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is None and prefix:
            want = expected.get(f"{prefix}.{name}") or expected.get(name.removeprefix(f"{prefix}."))
        if want is not None and shape is not None and list(shape) != want:
            raise ValueError(
                f"{folder}: tensor {name} has shape {list(shape)} in the weights but config.json "
                f"(hidden_size {getattr(config, 'hidden_size', '?')}) gives {want}: the config does not match the "
                "weights"
            )


def _check_same_vocabulary(original, converted) -> None:
    """Two models compared token by token need one vocabulary (else the embedding lookup fails mid-run)."""
    sizes = [_config_dict(resolve_model(name)).get("vocab_size") for name in (original, converted)]
    if all(isinstance(n, int) for n in sizes) and sizes[0] != sizes[1]:
        raise ValueError(
            f"{original} has vocab_size {sizes[0]} but {converted} has {sizes[1]}: verify compares two models "
            "with the same vocabulary (a conversion and its source)"
        )


def _check_layer_count(folder: Path, shapes: dict, layers) -> None:
    """The decoder layers the weights hold against ``num_hidden_layers``: transformers would drop the extra ones or
    initialise the missing ones at random without a word."""
    found = {int(m.group(1)) for name in shapes if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name))}
    if isinstance(layers, int) and found and found != set(range(layers)):
        raise ValueError(
            f"{folder}: the weights hold {len(found)} decoder layers (indices {min(found)}..{max(found)}) but "
            f"config.json has num_hidden_layers {layers}: the config does not match the weights"
        )


def _last_line(exc: Exception) -> str:
    """The last line of an exception's message (transformers' validation errors put the reason last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
