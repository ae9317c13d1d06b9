"""Attention head layout: which rows belong to which head, KV group and RoPE pair."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class HeadLayout:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int = 0  # 0: no RoPE; < head_dim: partial rotary
    rope_layout: Literal["rotate_half", "interleaved", "none"] = "none"
    qk_norm: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads cannot be grouped over {self.n_kv_heads} KV heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_group(self, head: int) -> int:
        return head // self.group_size

    def heads_of_group(self, group: int) -> range:
        return range(group * self.group_size, (group + 1) * self.group_size)

    def rows(self, head: int) -> slice:
        return slice(head * self.head_dim, (head + 1) * self.head_dim)

    def rope_pairs(self) -> list[tuple[int, int]]:
        """Index pairs (within a head) that RoPE rotates together, in the checkpoint's layout.
        HF rotate_half applies to the first ``rotary_dim`` dims: pairs (i, i + rotary_dim/2)."""
        r = self.rotary_dim
        if r == 0 or self.rope_layout == "none":
            return []
        if self.rope_layout == "rotate_half":
            return [(i, i + r // 2) for i in range(r // 2)]
        if self.rope_layout == "interleaved":
            return [(2 * i, 2 * i + 1) for i in range(r // 2)]
        raise ValueError(f"unknown RoPE layout {self.rope_layout!r}")

    def nope_dims(self) -> torch.Tensor:
        """Head dims RoPE leaves alone (free for any orthogonal map)."""
        return torch.arange(self.rotary_dim if self.rope_layout != "none" else 0, self.head_dim)
