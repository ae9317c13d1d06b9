"""Tiny models of every family heal supports (stock Llama teacher; TPA, compressed with every
structure kind, FaRR and stock Llama students), on a given vocabulary, saved with a tokenizer."""

from __future__ import annotations

import torch

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
STRUCT = {
    "q_proj": {"type": "kron", "rank": 2, "a_shape": [4, 4]},
    "k_proj": {"type": "lowrank", "rank": 6},
    "v_proj": {"type": "dense"},
    "o_proj": {"type": "gs", "rank": 2, "blocks": [2, 2]},
    "gate_proj": {"type": "lowrank", "rank": 8},
    "up_proj": {"type": "kron", "rank": 3, "a_shape": [8, 4]},
    "down_proj": {"type": "gs", "rank": 3, "blocks": [4, 2]},
}
FAMILIES = ("llama", "tpa", "compressed", "farr")


def tiny(family: str, vocab: int, seed: int = 0, tokenizer=None, init_std: float = 0.02):
    import transformers as T

    import hf_symmetry

    special = {"initializer_range": init_std}
    if tokenizer is not None:
        special.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    torch.manual_seed(seed)
    if family == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=vocab, **COMMON, **special))
    elif family == "tpa":
        cfg = hf_symmetry.TPAConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            head_dim=8,
            q_rank=4,
            k_rank=2,
            v_rank=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            **special,
        )
        m = hf_symmetry.TPAForCausalLM(cfg)
    elif family == "compressed":
        from hf_symmetry.modeling.configuration_compressed_llama import CompressedLlamaConfig
        from hf_symmetry.modeling.modeling_compressed_llama import CompressedLlamaForCausalLM

        cfg = CompressedLlamaConfig(
            vocab_size=vocab,
            **{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"},
            layer_structures=[STRUCT, STRUCT],
            skip_connections="orthogonal",
            **special,
        )
        m = CompressedLlamaForCausalLM(cfg)
        with torch.no_grad():  # non-trivial skips
            for layer in m.model.layers:
                layer.attn_skip.skip_k.normal_(0, 0.05)
                layer.mlp_skip.skip_k.normal_(0, 0.05)
    elif family == "farr":
        from hf_symmetry.modeling.configuration_farr import FarrLlamaConfig
        from hf_symmetry.modeling.modeling_farr import FarrLlamaForCausalLM

        m = FarrLlamaForCausalLM(FarrLlamaConfig(vocab_size=vocab, v_head_dims=[6, 4], **COMMON, **special))
    else:
        raise ValueError(family)
    return m.eval()


def save_tiny(family: str, folder, tokenizer, seed: int = 0, init_std: float = 0.02, teacher=None):
    m = tiny(family, len(tokenizer), seed, tokenizer, init_std)
    if teacher is not None:
        share_embeddings(m, teacher)
    m.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def byte_tokenizer():
    """A real, tiny tokenizer: byte-level BPE with no merges (one token per byte, 256 tokens) plus
    ``<|endoftext|>`` as BOS/EOS: vocabulary 257, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token=None
    )


def share_embeddings(student, teacher) -> None:
    """Give ``student`` the teacher's token embeddings (as a conversion would): a student that
    starts near the teacher's output scale, as converted models do."""
    src = teacher.get_input_embeddings().weight
    emb = student.get_input_embeddings()
    dst = emb.matrix.weight if hasattr(emb, "matrix") else emb.weight
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))
