"""Sparse top-k decode, the engine's side: block summaries kept beside the KV cache, and per step
the plan of which decodes attend how many blocks (kernels/sparse_plan.py carries it to the
attention backend).

Summaries are [2 (min, max), Hkv, num_blocks, D] float32 per layer. They are updated after every
step from the KV the step stored (a block's first token resets its summary, later tokens widen it;
tokens of one block arrive in order), and rebuilt whole for blocks written back from a KV tier.
The newest block of a sequence is always attended, so a summary is read only once its block is
full and final.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.engine.batch_buffers import BatchBuffers
from tierserve.engine.config import SparseConfig
from tierserve.kernels.base import BatchLayout
from tierserve.kernels.sparse import kv_summary_rebuild_, kv_summary_update
from tierserve.kernels.sparse_plan import SparseStep


@dataclass
class SparseStats:
    """Counters since start-up (exported as tierserve:sparse_* metrics)."""

    steps: int = 0
    """Steps with at least one sparse decode."""
    blocks_attended: float = 0.0
    """Blocks attended by sparse decodes, summed over KV heads and sparse layers."""
    blocks_total: int = 0
    """The blocks dense attention would have read for the same decodes."""
    selection_seconds: float = 0.0
    """Time spent scoring and choosing blocks (summed over the kernels' threads)."""


class SparseDecoder:
    def __init__(self, config: SparseConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 block_size: int, device: torch.device, ops=None):
        self.config = config
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.device = device
        self.ops = ops
        """The native extension (kv_summary_update_), or None for the torch path."""
        self.summaries: list[torch.Tensor] = []
        self.stats = SparseStats()
        self._acc = torch.zeros(2, dtype=torch.float64, device=device)
        """The kernels' accumulator: blocks attended, selection nanoseconds."""

    def allocate(self, num_blocks: int) -> None:
        self.summaries = []
        self.summaries = [torch.zeros(2, self.num_kv_heads, num_blocks, self.head_dim,
                                      dtype=torch.float32, device=self.device)
                          for _ in range(self.num_layers)]

    @property
    def accumulator(self) -> torch.Tensor:
        """The kernels' [2] float64 counter (blocks attended, selection ns), at a fixed address
        (CUDA graphs add to it)."""
        return self._acc

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.summaries)

    def plan(self, requests: list, layout: BatchLayout, buffers: BatchBuffers) -> SparseStep | None:
        """The step's sparse plan, or None when every decode attends densely. `requests` are the
        step's requests in layout order."""
        b = layout.num_decodes
        if not b or not self.config.enabled or self.config.dense_layers >= self.num_layers:
            return None
        topk = buffers.topk[:b]
        k = topk.numpy()
        bs, dense_blocks, widest = self.block_size, 0, 0
        for i in range(b):
            ctx = layout.context_lens[i]
            on = requests[i].hints.sparse_attention
            k[i] = 0 if on is False else self.config.topk(ctx, bs)
            n = -(-ctx // bs)
            if k[i]:
                dense_blocks += n
            widest = max(widest, min(n, int(k[i])) if k[i] else n)
        if not dense_blocks:
            return None
        self.stats.steps += 1
        self.stats.blocks_total += (dense_blocks * self.num_kv_heads
                                    * (self.num_layers - self.config.dense_layers))
        return SparseStep(self.summaries, self.config.dense_layers,
                          topk.to(self.device, non_blocking=True),
                          buffers.selected_view(b, int(k.max())), self._acc, widest)

    def collect(self) -> None:
        """Move the kernels' accumulator into the stats (once per step that was sparse)."""
        attended, ns = self._acc.tolist()
        self.stats.blocks_attended += attended
        self.stats.selection_seconds += ns * 1e-9
        self._acc.zero_()

    @torch.inference_mode()
    def update(self, kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Fold the K this step stored (at slot_mapping) into the summaries."""
        if not self.summaries or not slot_mapping.numel():
            return
        slots = slot_mapping.to(self.device, non_blocking=True)
        update = self.ops.kv_summary_update_ if self.ops is not None else kv_summary_update
        update(kv_caches, self.summaries, slots, self.block_size)

    @torch.inference_mode()
    def rebuild(self, kv_caches: list[torch.Tensor], block_ids: list[int]) -> None:
        """Recompute whole blocks' summaries (blocks written back from a KV tier)."""
        if not self.summaries or not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for cache, summary in zip(kv_caches, self.summaries):
            kv_summary_rebuild_(cache, summary, idx, self.block_size)
