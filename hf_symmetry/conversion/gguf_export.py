"""``export-gguf``: a stock Hugging Face folder (rotated, matched, merged, stock-sliced) as one GGUF file.

GGUF is what llama.cpp and its many front ends run; transformers reads it back
(``from_pretrained(folder, gguf_file=...)``), so a round trip checks the file with the project's own
evaluation. Written with the ``gguf`` package's writer, in llama.cpp's conventions
(``convert_hf_to_gguf.py`` is the reference):

- tensor names from ``gguf``'s tensor-name map of the architecture (``blk.{i}.attn_q`` …);
- Llama's q and k rows reordered from the Hugging Face rotate-half RoPE layout to GGML's interleaved
  one (per head, rows ``(j, j + d_h/2)`` become ``(2j, 2j + 1)``; transformers' loader undoes it);
- the hyperparameters, with ``attention.key_length`` / ``value_length`` and ``rope.dimension_count``
  the head size, which a sliced model's hidden size no longer fixes;
- one-dimensional tensors (norms, biases) in float32, matrices in ``--type``; a matrix whose rows do
  not fill whole blocks of that type falls back to float16 (as llama.cpp's converter does);
- a byte-level BPE tokenizer (SmolLM2, Qwen, Llama 3: ``tokenizer.ggml.model = gpt2``) with its merges,
  special tokens and chat template, and the pre-tokenizer name llama.cpp splits text by
  (``tokenizer.ggml.pre``: ``smollm``, ``qwen2``, ``llama-bpe`` …, found by llama.cpp's check-text hash,
  :mod:`hf_symmetry.gguf_pretokenizer`; an unknown tokenizer gets ``default`` and a warning); other tokenizers are
  left out (the report says so).

Architectures: ``LlamaForCausalLM`` and ``MistralForCausalLM`` (GGUF ``llama``; what stock SliceGPT writes
for a Llama whose width is not a multiple of its heads), ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``.
A ``MistralForCausalLM`` is GGUF ``llama`` (as llama.cpp's converter writes it); where its hidden size
is not a multiple of its heads, transformers cannot build its model from the file alone
(``LlamaConfig`` refuses that width), and :func:`load_gguf` fills the folder's class through
transformers' own GGUF reader instead. transformers reads a ``qwen2`` GGUF's head size from its hidden
size, so a sliced Qwen2 file is for llama.cpp only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType, quants
from gguf.vocab import BpeVocab
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from ..architectures.spec import LLAMA, SPECS, find_spec
from ..checkpoint_io import CheckpointReader, atomic_output_file
from ..gguf_pretokenizer import PreTokenizer, gguf_tokenizer_kind, split_as_llamacpp

#: --type -> GGML tensor type name (float types and the block types gguf's Python code can quantize)
TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
#: model_type -> (GGUF architecture, q/k rows permuted to GGML's RoPE layout), from the specs
#: (``ArchSpec.gguf_arch``, ``ArchSpec.gguf_permute_qk``)
ARCHS = {t: (s.gguf_arch, s.gguf_permute_qk) for s in SPECS if s.gguf_arch for t in s.model_types}


@dataclass
class GGUFReport:
    source: str
    output: str
    architecture: str
    type: str
    tensors: int
    bytes: int
    tensor_types: dict = field(default_factory=dict)  # GGML type -> count
    tokenizer: str = ""
    pre_tokenizer: str = ""  # tokenizer.ggml.pre ("" without a tokenizer)
    warnings: list = field(default_factory=list)  # what llama.cpp may do differently (an unknown pre-tokenizer)
    seconds: float = 0.0


def _file_type(name: str) -> int:
    return {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "bf16": LlamaFileType.MOSTLY_BF16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
        "q5_1": LlamaFileType.MOSTLY_Q5_1,
        "q5_0": LlamaFileType.MOSTLY_Q5_0,
        "q4_1": LlamaFileType.MOSTLY_Q4_1,
        "q4_0": LlamaFileType.MOSTLY_Q4_0,
    }[name]


def _qtype(name: str):
    return {
        "f32": T.F32,
        "f16": T.F16,
        "bf16": T.BF16,
        "q8_0": T.Q8_0,
        "q5_1": T.Q5_1,
        "q5_0": T.Q5_0,
        "q4_1": T.Q4_1,
        "q4_0": T.Q4_0,
    }[name]


def check_config(config: dict) -> tuple[str, bool]:
    """``(GGUF architecture, permute q/k)`` of a stock folder's config, or a ValueError naming what
    this exporter does not write."""
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise ValueError(
            f"export-gguf writes {', '.join(sorted(ARCHS))} folders, not {model_type!r} (a "
            "remote-code family has no GGUF architecture: write a stock output, e.g. compress "
            "--structure slice --untie)"
        )
    rope = config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope.get('rope_type')!r} is not written by export-gguf (default RoPE only)")
    spec = find_spec(model_type)
    if any(config.get(k) for k in spec.bias_attrs):
        raise ValueError(f"GGUF {spec.gguf_arch} has no attention or MLP biases")
    if spec.window_attr and config.get(spec.window_attr):
        raise ValueError(f"sliding-window attention is not written by export-gguf ({spec.window_attr} must be null)")
    return ARCHS[model_type]


def permute_rope_rows(W: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k rows (or a bias) from the HF rotate-half layout to GGML's interleaved pairs, per head:
    within each head, row ``j`` and ``j + d_h/2`` become rows ``2j`` and ``2j + 1``."""
    shape = W.shape
    return W.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _tokenizer(writer, folder: Path, vocab_size: int) -> tuple[str, PreTokenizer | None]:
    """Writes a byte-level BPE tokenizer (``tokenizer.json``) into ``writer``; returns what was written
    (or why nothing was) and its pre-tokenizer."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return "none (no tokenizer.json)", None
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") != "BPE" or (tok.get("pre_tokenizer") or {}).get("type") not in ("ByteLevel", "Sequence"):
        return f"none (a {model.get('type')} tokenizer: only byte-level BPE is written)", None
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    by_id = {i: s for s, i in model["vocab"].items()}
    by_id.update({i: t["content"] for i, t in added.items()})
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(
                (gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
                if i in added
                else gguf.TokenType.NORMAL
            )
    writer.add_tokenizer_model(BpeVocab.tokenizer_model)  # GGUF's name of byte-level BPE
    pre = PreTokenizer.of_folder(folder)
    writer.add_tokenizer_pre(pre.name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    flags = special_token_flags(folder, tok, writer.arch, vocab_size)
    special.add_special_token.update(flags)
    special.add_to_gguf(writer, quiet=True)
    adds = ", ".join(f"add_{k}_token {str(v).lower()}" for k, v in flags.items())
    return f"byte-level BPE, {vocab_size} tokens, {adds}, {pre.describe()}", pre


def _config_token(config: dict, name: str) -> str | None:
    entry = config.get(f"{name}_token")
    return entry.get("content") if isinstance(entry, dict) else entry


def special_token_flags(folder: Path, tok: dict, arch: str, vocab_size: int) -> dict[str, bool]:
    """``{"bos": add_bos_token, "eos": add_eos_token}`` as llama.cpp's converter (0c1e57098) decides them for
    a byte-level BPE tokenizer: gguf-py's ``SpecialVocab`` reads ``tokenizer.json``'s post-processor
    (``ByteLevel``: neither; ``RobertaProcessing``: both; ``TemplateProcessing`` of more than the sequence: a
    leading special token that is the BOS or CLS token (or either is unset), and a trailing special token),
    then ``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` for what the post-processor leaves
    open; ``convert_hf_to_gguf.py``'s LlamaModel then sets ``add_bos_token`` false for a 49152-token vocabulary
    (SmolLM, Granite). What none of these decides is written as transformers' tokenizer behaves (a BOS put
    first, an EOS put last when it encodes a text), rather than left to llama.cpp's per-pre-tokenizer
    default."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    bos, cls, eos = (_config_token(config, n) for n in ("bos", "cls", "eos"))
    flags: dict[str, bool] = {}
    post = tok.get("post_processor") or {}
    for processor in post.get("processors", [post]) if post else []:
        processor_type = processor.get("type")
        if processor_type == "ByteLevel":
            flags.setdefault("bos", False)
            flags.setdefault("eos", False)
        elif processor_type == "RobertaProcessing":
            flags.update(bos=True, eos=True)
        elif processor_type == "TemplateProcessing":
            single = processor.get("single", [])
            if len(single) > 1:
                if first := single[0].get("SpecialToken", {}).get("id"):
                    flags["bos"] = not config or first in (bos, cls) or not bos or not cls
                if single[-1].get("SpecialToken", {}).get("id"):
                    flags["eos"] = True
    for name in ("bos", "eos"):
        if isinstance(config.get(f"add_{name}_token"), bool):
            flags.setdefault(name, config[f"add_{name}_token"])
    if arch == LLAMA.gguf_arch and vocab_size == 49152:  # convert_hf_to_gguf.py LlamaModel's rule
        flags["bos"] = False
    if len(flags) < 2:
        flags = {**_observed_flags(folder), **flags}
    return {name: flags[name] for name in ("bos", "eos")}


def _observed_flags(folder: Path) -> dict[str, bool]:
    """Whether transformers' tokenizer of ``folder`` puts its BOS first and its EOS last (False where it
    cannot be loaded)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        plain = tokenizer.encode("a", add_special_tokens=False)
        full = tokenizer.encode("a", add_special_tokens=True)
    except Exception:  # a tokenizer.json transformers cannot load
        return {"bos": False, "eos": False}
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {
        "bos": bos is not None and len(full) > len(plain) and full[0] == bos,
        "eos": eos is not None and len(full) > len(plain) and full[-1] == eos,
    }


def _get(config: dict, *names, default=None):
    for n in names:
        if config.get(n) is not None:
            return config[n]
    return default


def _write_hyperparameters(writer, config: dict, name: str, type: str) -> None:
    """The model's metadata: name, sizes, RoPE base, norm epsilon, file type."""
    hidden, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_kv = int(_get(config, "num_key_value_heads", default=n_heads))
    head_dim = int(_get(config, "head_dim", default=hidden // n_heads))
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(int(_get(config, "max_position_embeddings", default=2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(_file_type(type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _stored(data: np.ndarray, qtype) -> tuple[np.ndarray, "gguf.GGMLQuantizationType"]:
    """One tensor as written, and its GGML type: vectors in F32; matrices in ``qtype``, or F16 where a row is
    not a whole number of ``qtype``'s blocks."""
    if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        ggml_type = gguf.GGMLQuantizationType.F32
    else:
        ggml_type = qtype
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if data.shape[-1] % block:
            ggml_type = gguf.GGMLQuantizationType.F16
    if ggml_type == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16), ggml_type
    if ggml_type == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32), ggml_type
    return quants.quantize(data, ggml_type), ggml_type


def export_gguf(
    src: str | Path,
    out: str | Path,
    type: str = "f16",
    overwrite: bool = False,
    name: str | None = None,
    progress: bool = True,
) -> GGUFReport:
    """Write the stock folder ``src`` as the GGUF file ``out`` (tensors in ``type``, see :data:`TYPES`)."""
    start = time.perf_counter()
    if type not in TYPES:
        raise ValueError(f"unknown GGUF type {type!r}; choose one of {', '.join(TYPES)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise ValueError(f"the output is one file ending in .gguf, got {out}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (use --overwrite)")
    reader = CheckpointReader(src)
    config = reader.config
    arch, permute = check_config(config)
    n_layers, n_heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    n_kv = int(_get(config, "num_key_value_heads", default=n_heads))
    tied = bool(config.get("tie_word_embeddings", False))

    with atomic_output_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        _write_hyperparameters(writer, config, name or Path(reader.path).name, type)
        tokenizer, pre = _tokenizer(writer, Path(reader.path), int(config["vocab_size"]))

        names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
        qtype = _qtype(type)
        counts: dict[str, int] = {}
        keys = [k for k in reader.keys() if not k.endswith("rotary_emb.inv_freq")]
        if tied:
            keys = [k for k in keys if k != "lm_head.weight"]
        for key in tqdm(keys, desc="gguf", unit="tensor", disable=not progress):
            base, suffix = key.rsplit(".", 1)
            gname = names.get_name(base)
            if gname is None:
                raise ValueError(f"{key}: no GGUF name in the {arch} tensor map")
            t = reader.get([key])[key].to(torch.float32)
            if permute and base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
                t = permute_rope_rows(t, n_heads if base.endswith("q_proj") else n_kv)
            stored, ggml_type = _stored(t.numpy(), qtype)
            writer.add_tensor(
                f"{gname}.{suffix}",
                stored,
                raw_dtype=ggml_type
                if ggml_type not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)
                else None,
            )
            counts[ggml_type.name] = counts.get(ggml_type.name, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    return GGUFReport(
        source=str(src),
        output=str(out),
        architecture=arch,
        type=type,
        tensors=sum(counts.values()),
        bytes=out.stat().st_size,
        tensor_types=counts,
        tokenizer=tokenizer,
        pre_tokenizer=pre.name if pre else "",
        warnings=[w for w in [pre and pre.warning()] if w],
        seconds=time.perf_counter() - start,
    )


def load_gguf(out: str | Path, folder: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """``(model, how)``: the GGUF file read back through transformers (tensors dequantised, Llama's q/k
    rows de-permuted). ``from_pretrained(..., gguf_file=...)`` where transformers can build the model
    from the file's metadata alone. It cannot for a ``MistralForCausalLM`` folder whose hidden size is
    not a multiple of its heads (GGUF ``llama``: ``LlamaConfig`` refuses the width, and gguf-py has no
    ``mistral`` architecture for transformers' name map): then the folder's class is filled by
    transformers' own ``load_gguf_checkpoint``, after checking that the file's hyperparameters are the
    folder's."""
    out = Path(out)
    try:
        model = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=dtype)
        return model.eval(), "from_pretrained(gguf_file=...)"
    except Exception:  # transformers' config validation (a huggingface_hub error), or an unknown name
        if folder is None:
            raise
    config = AutoConfig.from_pretrained(folder)
    arch, _ = check_config(config.to_dict())
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    own = model.config.model_type
    model.config.model_type = arch  # transformers' GGUF name map is keyed by the architecture
    try:
        got = load_gguf_checkpoint(str(out), return_tensors=True, model_to_load=model)
    finally:
        model.config.model_type = own
    meta = got["config"]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
    ):
        if key in meta and int(meta[key]) != int(getattr(config, key)):
            raise ValueError(f"{out.name}: {key} {meta[key]} in the file, {getattr(config, key)} in the folder")
    if abs(float(meta["rms_norm_eps"]) / config.rms_norm_eps - 1) > 1e-6:
        raise ValueError(
            f"{out.name}: rms_norm_eps {meta['rms_norm_eps']} in the file, {config.rms_norm_eps} in the folder"
        )
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in got["tensors"].items()}, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{out.name}: tensors missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval(), "load_gguf_checkpoint into the folder's class"


def round_trip(
    folder: str | Path,
    out: str | Path,
    prompt: str = "The capital of France is",
    new_tokens: int = 32,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """The folder's model against the GGUF file read back through transformers: greedy continuations of
    ``prompt`` (the folder's tokenizer; the file's own where it carries one, as a second check) and the
    logits over the prompt and continuation."""
    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    back, how = load_gguf(out, folder, dtype)
    ids = tok(prompt, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        b = back.generate(ids, **kw)
        la, lb = ref(a).logits, back(a).logits
    result = {
        "same_text": bool(torch.equal(a, b)),
        "new_tokens": int(a.shape[1] - ids.shape[1]),
        "text": tok.decode(a[0, ids.shape[1] :]),
        "text_gguf": tok.decode(b[0, ids.shape[1] :]),
        "tokens": int(a.shape[1]),
        "max_abs_dlogit": float((la - lb).abs().max()),
        "max_abs_logit": float(la.abs().max()),
        "class": type(back).__name__,
        "read_by": how,
    }
    result["same_tokenization"] = _same_tokenization(out, tok, prompt, result)
    return result


def _same_tokenization(out: Path, tok, prompt: str, result: dict) -> bool | None:
    """Whether the tokenizer the file carries (read by transformers' GGUF tokenizer converter, with the split
    llama.cpp uses for its ``tokenizer.ggml.pre``) tokenizes ``prompt`` as the folder's does; ``None`` for a
    file without one."""
    try:
        architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(out))
        if not tokenizer_dict:
            return None
        fast, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
        split_as_llamacpp(fast, *gguf_tokenizer_kind(out))  # the file's split, as llama.cpp reads it
    except Exception as e:  # no tokenizer, or one transformers cannot convert
        result["tokenizer_error"] = f"{type(e).__name__}: {e}"[:200]
        return None
    want = tok(prompt, add_special_tokens=False).input_ids
    return fast.encode(prompt, add_special_tokens=False).ids == want
