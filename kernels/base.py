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

from tierserve.kernels.kv_dtype import dequantize, is_fp8, quantize


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
    """Sparse (top-k block) attention."""
    sliding_window: bool = False
    """Per-layer sliding-window attention (forward's `window`): models with windowed layers
    (Gemma 3) run only on backends that say so."""
    requires: tuple[str, ...] = ()
    """Python packages that must import."""
    min_capability_for: tuple[tuple[str, tuple[int, int]], ...] = ()
    """(dtype or KV dtype name, lowest CUDA compute capability that runs it), e.g. fp8 on 8.9."""


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

    def decode_part(self) -> BatchLayout:
        """The leading decodes alone (their tokens are the first num_decodes of the batch)."""
        b = self.num_decodes
        return BatchLayout(b, self.query_lens[:b], self.context_lens[:b], self.query_start[:b + 1],
                           self.block_tables[:b], self.slot_mapping[:b], self.block_size)

    def prefill_part(self) -> BatchLayout:
        """The prefill chunks alone, token offsets rebased to the first prefill token."""
        b = self.num_decodes
        t0 = self.query_start[b]
        return BatchLayout(0, self.query_lens[b:], self.context_lens[b:],
                           [s - t0 for s in self.query_start[b:]], self.block_tables[b:],
                           self.slot_mapping[t0:], self.block_size)


class AttentionBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    cuda_graphs: ClassVar[bool] = False
    """Decode metadata can be built from static device tensors (engine/worker/cuda_graphs.py)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_scale: float = 1.0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_scale = kv_scale
        """fp8 KV caches store x / kv_scale; other dtypes ignore it."""
        self.device = torch.device(device)
        """Where the KV cache lives; metadata is built there."""
        self.dtype = dtype
        """Compute dtype of q, k, v."""
        self.kv_dtype = kv_dtype or dtype
        """Storage dtype of the KV cache."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """Per-step metadata shared by every layer (built once per step)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, window: int | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of this step's tokens, already written to kv_cache.
        Returns [T, H * D]. `window`: this layer's sliding window, a query at position p
        attending keys at (p - window, p] only (only where capabilities.sliding_window; the
        router sends windowed models nowhere else); None: the whole causal context."""

    def forward_sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, meta: Any, sparse: Any, layer: int) -> torch.Tensor:
        """forward() with the step's decodes attending only their top-k blocks
        (kernels/sparse_plan.SparseStep). Backends whose capabilities say sparse=False never get a
        sparse plan (the runner checks), so the default attends densely."""
        return self.forward(q, k, v, kv_cache, meta)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's K and V at their slots, quantizing for an fp8 cache."""
        k = quantize(k, kv_cache.dtype, self.kv_scale).transpose(0, 1)
        v = quantize(v, kv_cache.dtype, self.kv_scale).transpose(0, 1)
        slot_mapping = slot_mapping.to(kv_cache.device, non_blocking=True)
        if is_fp8(kv_cache.dtype):  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        kv_cache[0].index_copy_(1, slot_mapping, k)
        kv_cache[1].index_copy_(1, slot_mapping, v)

    def plain_kv_store(self, kv_cache: torch.Tensor) -> bool:
        """True when write_kv is a plain copy into the [2, Hkv, slots, D] layout (no quantization):
        a fused model op may then store K/V itself."""
        return type(self).write_kv is AttentionBackend.write_kv and kv_cache.dtype == self.dtype

    def read_kv(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache values gathered by a torch backend, in compute dtype (fp8 dequantized)."""
        return dequantize(x, dtype, self.kv_scale)
