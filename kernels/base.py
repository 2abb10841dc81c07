"""The attention backend interface.

KV cache layout, per layer: a tensor [2, num_kv_heads, num_slots, head_dim] (K then V), where
slot = block_id * block_size + offset. Head-major slots make a gather of any token list one
contiguous index_select per head group, and a block's bytes for a head one contiguous run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run; the router filters on these and explains every mismatch."""

    device_types: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    kv_dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None = None
    """None: any head dim."""
    gqa_groups: tuple[int, ...] | None = None
    """None: any query-heads-per-KV-head ratio."""
    page_sizes: tuple[int, ...] | None = None
    phases: tuple[str, ...] = ("prefill", "decode")
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    sparse: bool = False
    requires: tuple[str, ...] = ()
    """Python packages that must import."""


@dataclass(frozen=True)
class BatchLayout:
    """The flat token batch of one step, as attention sees it. Sequences are ordered with all
    decodes (one query token) first. Host tensors; views of fixed-capacity buffers."""

    num_decodes: int
    """Leading sequences with exactly one query token."""
    query_lens: list[int]
    """Query tokens of each sequence this step."""
    context_lens: list[int]
    """Tokens in each sequence's KV after this step (cached + new)."""
    query_start: list[int]
    """Offset of each sequence's first query token in the flat batch (len num_seqs + 1)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int64 view; rows padded with 0 past each sequence's blocks."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: the cache slot each new token's K and V are written to."""
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """Per-step metadata shared by every layer (built once per step)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of this step's tokens, already written to kv_cache.
        Returns [T, H * D]."""

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kv_cache[0].index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
        kv_cache[1].index_copy_(1, slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))
