"""Sparse top-k decode, the engine's side, behind the two hooks the runner calls each step:

    prepare(scheduled, layout, buffers)   before the forward: which decodes attend how many
                                          blocks (a SparseStep for the kernels), or None
    after_step(kv_caches, slots, plan)    after it: fold the stored keys into the block
                                          summaries, the kernels' counter into the stats

(and, off the step loop: allocate() beside each KV cache, rebuild() for blocks written back from a
KV tier, static_step() for the decode graphs). decode_sparsity() picks the implementation once: a
SparseDecoder, or DenseDecodes whose hooks do nothing, so the runner has no sparse branches.

Summaries are [2 (min, max), Hkv, num_blocks, D] float32 per layer. They are updated after every
step from the KV the step stored (a block's first token resets its summary, later tokens widen it;
tokens of one block arrive in order), and rebuilt whole for blocks written back from a KV tier.
The newest block of a sequence is always attended, so a summary is read only once its block is
full and final.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from tierserve.engine.worker.batch_buffers import BatchBuffers
from tierserve.engine.config import ModelConfig, SparseConfig
from tierserve.kernels.base import AttentionBackend, BatchLayout
from tierserve.kernels.sparse import kv_summary_rebuild_, kv_summary_update
from tierserve.kernels.sparse_plan import SparseStep, kernel_topk

if TYPE_CHECKING:
    from tierserve.engine.core.scheduler import ScheduledRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
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

    def plus(self, steps: int = 0, blocks_attended: float = 0.0, blocks_total: int = 0,
             selection_seconds: float = 0.0) -> SparseStats:
        return SparseStats(self.steps + steps, self.blocks_attended + blocks_attended,
                           self.blocks_total + blocks_total,
                           self.selection_seconds + selection_seconds)


class RowChoice(NamedTuple):
    """How each decode of a step attends (arrays over the step's decodes, in layout order)."""

    blocks: np.ndarray
    """int64: the row's KV blocks, all of which dense attention reads."""
    topk: np.ndarray
    """int64: blocks the row attends, the first and the newest included (`blocks` where dense)."""
    dense: np.ndarray
    """bool: the row attends every block by the kernels' dense path."""


def choose_rows(config: SparseConfig, context_lens: np.ndarray, opted_out: np.ndarray,
                block_size: int) -> RowChoice:
    """SparseConfig.topk over a batch at once (a test holds the two equal): dense where the
    request opted out, the context is under min_context or fits in two blocks."""
    blocks = (context_lens + (block_size - 1)) // block_size
    if config.topk_blocks is not None:  # it wins over topk_ratio
        k = np.minimum(blocks, max(2, config.topk_blocks))
    else:
        k = np.minimum(blocks, np.maximum(2, np.ceil(config.topk_ratio * blocks).astype(np.int64)))
    dense = opted_out | (context_lens < config.min_context) | (blocks <= 2)
    return RowChoice(blocks, np.where(dense, blocks, k), dense)


def step_bytes(plan: SparseStep | None) -> int:
    """Bytes of an eager step's sparse metadata views (none without a plan)."""
    return 0 if plan is None else BatchBuffers.nbytes(plan.topk, plan.selected)


class DecodeSparsity(Protocol):
    """What the runner and the decode graphs call (see the module docstring)."""

    stats: SparseStats
    nbytes: int

    def allocate(self, num_blocks: int) -> None: ...

    def prepare(self, scheduled: tuple[ScheduledRequest, ...], layout: BatchLayout,
                buffers: BatchBuffers) -> SparseStep | None: ...

    def after_step(self, kv_caches: list[torch.Tensor], slots: torch.Tensor,
                   plan: SparseStep | None) -> None: ...

    def rebuild(self, kv_caches: list[torch.Tensor], block_ids: list[int]) -> None: ...

    def static_step(self, topk: torch.Tensor) -> SparseStep | None: ...


class DenseDecodes:
    """Every decode attends densely: no summaries, no plan, no counters."""

    stats = SparseStats()
    nbytes = 0

    def allocate(self, num_blocks: int) -> None:
        pass

    def prepare(self, scheduled, layout, buffers) -> None:
        return None

    def after_step(self, kv_caches, slots, plan) -> None:
        pass

    def rebuild(self, kv_caches, block_ids) -> None:
        pass

    def static_step(self, topk: torch.Tensor) -> None:
        return None


def decode_sparsity(config: SparseConfig, backend: AttentionBackend, model_cfg: ModelConfig,
                    block_size: int, device: torch.device, ops=None) -> DecodeSparsity:
    """A SparseDecoder when sparse decode is configured, the decode backend can run it and some
    layer is sparse; else DenseDecodes (with a warning when the backend is why)."""
    if not config.enabled or config.dense_layers >= model_cfg.num_layers:
        return DenseDecodes()
    if not backend.capabilities.sparse:
        log.warning("sparse decode is on, but the decode backend %s cannot run it: decodes "
                    "attend densely (see `tierserve route`)", backend.name)
        return DenseDecodes()
    return SparseDecoder(config, model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                         block_size, device, ops)


class SparseDecoder:
    """Block summaries beside the KV cache, and each step's plan for its decodes."""

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
        self.summaries = []  # free the old ones first
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

    def prepare(self, scheduled: tuple[ScheduledRequest, ...], layout: BatchLayout,
                buffers: BatchBuffers) -> SparseStep | None:
        """The step's plan for its decodes (the layout's leading rows), or None when every one
        attends densely. Counts the step and the blocks its sparse rows would read densely."""
        b = layout.num_decodes
        if not b:
            return None
        opted_out = np.fromiter((s.request.hints.sparse_attention is False for s in scheduled[:b]),
                                dtype=bool, count=b)
        rows = choose_rows(self.config, buffers.context_lens.numpy()[:b], opted_out,
                           self.block_size)
        sparse = ~rows.dense
        if not sparse.any():
            return None
        topk = buffers.topk[:b]
        k = topk.numpy()
        kernel_topk(rows.topk, rows.dense, k)
        sparse_layers = self.num_layers - self.config.dense_layers
        self.stats = self.stats.plus(steps=1, blocks_total=int(rows.blocks @ sparse)
                                     * self.num_kv_heads * sparse_layers)
        # k.max(): the widest sparse row's choice (dense rows hold 0 there)
        return SparseStep(self.summaries, self.config.dense_layers,
                          topk.to(self.device, non_blocking=True),
                          buffers.selected_view(b, int(k.max())), self._acc, int(rows.topk.max()))

    @torch.inference_mode()
    def after_step(self, kv_caches: list[torch.Tensor], slots: torch.Tensor,
                   plan: SparseStep | None) -> None:
        """Fold the K this step stored (at `slots`, on the device) into the summaries, and after
        a step with a plan the kernels' counter into the stats (a device sync)."""
        if slots.numel():
            update = self.ops.kv_summary_update_ if self.ops is not None else kv_summary_update
            update(kv_caches, self.summaries, slots, self.block_size)
        if plan is not None:
            attended, ns = self._acc.tolist()
            self._acc.zero_()
            self.stats = self.stats.plus(blocks_attended=attended, selection_seconds=ns * 1e-9)

    @torch.inference_mode()
    def rebuild(self, kv_caches: list[torch.Tensor], block_ids: list[int]) -> None:
        """Recompute whole blocks' summaries (blocks written back from a KV tier)."""
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for cache, summary in zip(kv_caches, self.summaries):
            kv_summary_rebuild_(cache, summary, idx, self.block_size)

    def static_step(self, topk: torch.Tensor) -> SparseStep:
        """The plan a captured decode graph reads: each row's top-k from `topk` (the graph's
        static input), the summaries and the counter by address (so neither may be reallocated
        while the graphs live); the chosen blocks are not recorded."""
        return SparseStep(self.summaries, self.config.dense_layers, topk, None, self._acc)
