"""Configuration of ProcrustesGPT-compressed Llama-family models (``hf_symmetry compress``).

This file is copied next to saved checkpoints (``trust_remote_code`` loading), so it imports only
``transformers`` (and ``huggingface_hub``, which transformers depends on) and its sibling ``structured_linear``
(the structure types a config entry may name).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .structured_linear import check_entry

LAYER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SKIP_KINDS = ("none", "orthogonal", "dense")
LM_HEAD_KINDS = ("tied", "tied_mixed", "separate")


def _check_entry(where: str, entry) -> None:
    check_entry(f"CompressedLlamaConfig: {where}", entry)


@strict
class CompressedLlamaConfig(PreTrainedConfig):
    r"""A Llama-family decoder whose linear layers are structured matrices (ProcrustesGPT, Grishina et al.):
    sums of Kronecker products, GS (block-diagonal · shuffle · block-diagonal) or low-rank products, each
    with a factorised forward pass.

    The residual stream lives in rotated bases: ``skip_connections="orthogonal"`` gives every residual
    segment its own basis, so each skip connection multiplies by ``Q_prevᵀ Q_next`` (stored as a Cayley
    parameter, ``d(d+1)/2`` numbers, turned into the matrix once and cached); ``"dense"`` stores the skip
    matrix as is (SliceGPT, where it is not orthogonal after slicing); ``"none"``: one basis for all.
    RMSNorms carry no weight (folded into the next linear layers) and divide ``Σ x²`` by
    ``hidden_size`` (the original width) even when the stream is sliced to ``residual_size``.

    Args:
        residual_size: width of the residual stream (``hidden_size`` unless sliced); with
            ``residual_sizes``, the largest of them.
        residual_sizes: optional, one width per residual segment (``2 num_hidden_layers + 1``: the input
            of layer i's attention is segment ``2i``, of its MLP ``2i + 1``, the final norm's ``2L``) when
            they differ (SliceGPT with one global rotation and per-segment widths). Every basis is then a
            prefix of the same one, so a skip connection from width ``a`` to width ``b`` keeps the first
            ``b`` coordinates or pads with zeros; needs ``skip_connections="none"``. ``None``: every
            segment is ``residual_size`` wide.
        layer_structures: one dict per layer mapping each of ``q_proj k_proj v_proj o_proj gate_proj up_proj
            down_proj`` to a structure: ``{"type": "dense"}``, ``{"type": "lowrank", "rank": r}``,
            ``{"type": "kron", "rank": r, "a_shape": [m1, n1]}`` (``Σ A_s ⊗ B_s`` with ``A_s [m1, n1]``) or
            ``{"type": "gs", "blocks": [kl, kr], "rank": b}``; optional ``"bias": true``.
        embed_structure: the structure of the ``[vocab, residual_size]`` embedding matrix.
        lm_head: ``"tied"`` (logits from the embedding matrix), ``"tied_mixed"`` (tied, after a dense
            ``residual_size²`` map that carries the final norm's folded γ and the change of basis) or
            ``"separate"`` (its own matrix, ``lm_head_structure``).
        qk_norm: a per-head RMSNorm with learned γ on queries and keys before RoPE (Qwen3's QK-norm;
            residual rotations and slicing act on the other side of q/k and leave it untouched).
        compression: a summary of how the model was made (informational).
    """

    model_type = "hf_symmetry_compressed_llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 4096
    residual_size: int | None = None
    residual_sizes: list[int] | None = None
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_dropout: int | float = 0.0
    qk_norm: bool = False
    skip_connections: str = "none"
    lm_head: str = "tied"
    layer_structures: list | None = None
    embed_structure: dict | None = None
    lm_head_structure: dict | None = None
    compression: dict | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.residual_sizes is not None:
            self.residual_sizes = [int(w) for w in self.residual_sizes]
            if self.residual_size is None and self.residual_sizes:
                self.residual_size = max(self.residual_sizes)
        if self.residual_size is None:
            self.residual_size = self.hidden_size
        if self.layer_structures is None:
            self.layer_structures = [
                {m: {"type": "dense"} for m in LAYER_MODULES} for _ in range(self.num_hidden_layers)
            ]
        if self.embed_structure is None:
            self.embed_structure = {"type": "dense"}
        if self.lm_head == "separate" and self.lm_head_structure is None:
            self.lm_head_structure = {"type": "dense"}
        self.tie_word_embeddings = False  # tying is this family's own business (lm_head="tied")
        super().__post_init__(**kwargs)
        self._validate_compression()

    def _validate_compression(self) -> None:
        if not 0 < self.residual_size <= self.hidden_size:
            raise ValueError(
                f"CompressedLlamaConfig: residual_size must be in (0, hidden_size={self.hidden_size}], "
                f"got {self.residual_size}"
            )
        if self.skip_connections not in SKIP_KINDS:
            raise ValueError(
                f"CompressedLlamaConfig: skip_connections must be one of {SKIP_KINDS}, got {self.skip_connections!r}"
            )
        if self.lm_head not in LM_HEAD_KINDS:
            raise ValueError(f"CompressedLlamaConfig: lm_head must be one of {LM_HEAD_KINDS}, got {self.lm_head!r}")
        if self.skip_connections == "orthogonal" and self.residual_size != self.hidden_size:
            raise ValueError("CompressedLlamaConfig: orthogonal skip connections need an unsliced residual stream")
        if self.residual_sizes is not None:
            n_seg = 2 * self.num_hidden_layers + 1
            if len(self.residual_sizes) != n_seg or not all(0 < w <= self.hidden_size for w in self.residual_sizes):
                raise ValueError(
                    f"CompressedLlamaConfig: residual_sizes must be {n_seg} widths in (0, hidden_size="
                    f"{self.hidden_size}], got {self.residual_sizes}"
                )
            if max(self.residual_sizes) != self.residual_size:
                raise ValueError(
                    f"CompressedLlamaConfig: residual_size ({self.residual_size}) must be the largest "
                    f"of residual_sizes ({max(self.residual_sizes)})"
                )
            if self.skip_connections != "none":
                raise ValueError(
                    "CompressedLlamaConfig: per-segment residual widths need one basis for all "
                    "segments (skip_connections='none')"
                )
            if self.lm_head == "tied" and self.residual_sizes[0] != self.residual_sizes[-1]:
                raise ValueError(
                    "CompressedLlamaConfig: a tied head without head_mix needs the first and last residual widths equal"
                )
        if len(self.layer_structures) != self.num_hidden_layers:
            raise ValueError(
                f"CompressedLlamaConfig: layer_structures has {len(self.layer_structures)} entries "
                f"for {self.num_hidden_layers} layers"
            )
        for i, layer in enumerate(self.layer_structures):
            if not isinstance(layer, dict) or set(layer) != set(LAYER_MODULES):
                raise ValueError(f"CompressedLlamaConfig: layer_structures[{i}] must map exactly {LAYER_MODULES}")
            for name, entry in layer.items():
                _check_entry(f"layer_structures[{i}][{name!r}]", entry)
        _check_entry("embed_structure", self.embed_structure)
        if self.lm_head == "separate":
            _check_entry("lm_head_structure", self.lm_head_structure)

    def segment_width(self, k: int) -> int:
        """Width of residual segment ``k`` (``0 .. 2 num_hidden_layers``)."""
        return self.residual_size if self.residual_sizes is None else self.residual_sizes[k]

    def kv_cache_elements_per_token(self, per_layer: bool = True) -> int:
        """Cached elements per token (one layer if ``per_layer`` else all): stock K/V, ``2 n_kv d_h``."""
        per = (
            2
            * (self.num_key_value_heads or self.num_attention_heads)
            * (self.head_dim or self.hidden_size // self.num_attention_heads)
        )
        return per if per_layer else per * self.num_hidden_layers

    def validate_architecture(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"CompressedLlamaConfig: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )


CompressedLlamaConfig.register_for_auto_class()

__all__ = ["CompressedLlamaConfig"]
