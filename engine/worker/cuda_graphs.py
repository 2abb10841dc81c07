"""Decode steps replayed from CUDA graphs captured at start-up (`--cuda-graphs`).

A decode-only step of b sequences whose block tables are w blocks wide replays the graph of
(bucket, width): the smallest captured batch bucket >= b and the smallest captured width >= w.
Everything else (prefill chunks, mixed steps, a batch or width past the largest captured) runs
eagerly. All graphs are captured once, after the KV cache has its final size, so no capture or
compilation happens while requests are served.

    buckets  1, 2, 4, 8, ... up to max_num_seqs (max_num_seqs itself when not a power of two)
    widths   the block-table widths engine.batch_buffers can produce: powers of two from 8 up to
             the capacity (capacity itself when not a power of two); at most MAX_WIDTHS of them,
             spread evenly in log scale, the narrowest and the capacity always kept

Each graph reads static device inputs, which a step refills with one non-blocking copy from a
pinned host staging buffer laid out like the device one (int64):

    [0, M)        token ids          M = the largest bucket
    [M, 2M)       positions
    [2M, 3M)      KV slots
    [3M, 4M)      context lengths    (cast to int32 inside the graph, for the kernel)
    [4M, 5M)      sparse top-k       staged 0 (the kernels' dense encoding); the real rows of a
                                     sparse step get the plan's top-k on the device (upload)
    [5M, ...)     block tables, the [bucket, width] view being the first bucket * width entries

Rows past the batch (padding up to the bucket) are a one-token sequence at position 0 in the
scratch block: token 0, slot scratch * block_size, context length 1, table row [scratch, PAD...].
They write their K/V only into the scratch block and read only it, so no real block is touched;
the engine keeps that block (the cache's last) out of the block pool (RESERVED_BLOCKS), and
capture() refuses a pool that could hand it out. Table entries past a real row's blocks hold
PAD_BLOCK, which the kernels never read (they stop at each row's context length).

Only backends whose decode metadata can be built from static device tensors can be captured: the
class attribute `cuda_graphs` and a `static_decode_metadata(tables, lens, page_size)` method
(kernels/triton_attn.py). Others and a CPU device run eagerly, with a warning.

Sparse top-k decode (a backend with sparse support: triton) is captured too: scoring, choice and
attention run on the device, so a graph takes each row's top-k from the section above (padded
rows and dense rows 0), and the layers' summaries and the blocks-attended counter at their fixed
addresses (engine/worker/sparse.py: static_step); it does not record the chosen blocks, which nothing
reads. With sparse decode configured every replayed step runs the sparse kernels (a dense row
costs the scoring of its blocks more than eager).

All graphs share one memory pool, so a replay's output is valid until the next replay: the
runner computes the step's logits from it before the next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from tierserve.engine.worker.batch_buffers import (PAD_BLOCK, BatchBuffers, StepInputs, active_width,
                                            next_power_of_two, upload_event)
from tierserve.engine.worker.sparse import DecodeSparsity, DenseDecodes
from tierserve.kernels import AttentionBackend, BatchLayout, ForwardContext, forward_context
from tierserve.kernels.composite import PhaseSplit, SplitMeta
from tierserve.kernels.sparse_plan import SparseStep

if TYPE_CHECKING:
    from tierserve.engine.config import EngineConfig

log = logging.getLogger(__name__)

MAX_WIDTHS = 8
"""Most block-table widths captured. 8 covers every width up to 1024 blocks (16K tokens of
16-token blocks); longer models share wider graphs, whose triton splits are sized for the wider
context (kernels/triton_attn.py: static_decode_metadata)."""
RESERVED_BLOCKS = 1
"""KV blocks the engine keeps out of the pool when graphs are captured: the scratch block that
padded rows write to."""


# ---- which graphs: pure functions ----------------------------------------------------------------

def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs: every decode batch has a bucket."""
    out = [1 << k for k in range(max_num_seqs.bit_length()) if 1 << k < max_num_seqs]
    return (*out, max_num_seqs)


def graph_widths(capacity: int, alignment: int = 8, limit: int = MAX_WIDTHS) -> tuple[int, ...]:
    """The block-table widths to capture: what batch_buffers.active_width yields for this capacity,
    thinned to `limit` evenly in log scale when there are more (narrowest and capacity kept)."""
    widths = sorted({active_width(1 << k, capacity, alignment)
                     for k in range(next_power_of_two(capacity).bit_length())})
    if len(widths) <= limit:
        return tuple(widths)
    if limit < 2:
        return (widths[-1],)
    picks = sorted({round(i * (len(widths) - 1) / (limit - 1)) for i in range(limit)})
    return tuple(widths[i] for i in picks)


def smallest_at_least(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of the ascending `sizes` >= n, or None when n is past them all."""
    return next((s for s in sizes if s >= n), None)


def graphs_refusal(device_type: str, backend: AttentionBackend) -> str | None:
    """Why decode graphs cannot run here, or None when they can."""
    if device_type != "cuda":
        return f"the device is {device_type}, not cuda"
    inner = backend.decode if isinstance(backend, PhaseSplit) else backend
    if not getattr(inner, "cuda_graphs", False):
        return (f"the decode backend {inner.name} builds its metadata on the host each step "
                "(graph-capable: triton; --attention-backend decode=triton)")
    return None


def wants_graphs(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """True when config.cuda_graphs asks for graphs and they can run here; when they were asked
    for and cannot, a start-up warning says why and steps run eagerly."""
    if not config.cuda_graphs:
        return False
    why = graphs_refusal(device.type, backend)
    if why is not None:
        log.warning("--cuda-graphs: not capturing decode CUDA graphs, %s; every step runs "
                    "eagerly", why)
    return why is None


def static_metadata(backend: AttentionBackend, tables: torch.Tensor, lens: torch.Tensor,
                    page_size: int):
    """The backend's decode-only metadata over static device tensors (a PhaseSplit's decode part
    wrapped as its own metadata)."""
    if isinstance(backend, PhaseSplit):
        inner = backend.decode.static_decode_metadata(tables, lens, page_size)
        return SplitMeta(tables.shape[0], inner, None)
    return backend.static_decode_metadata(tables, lens, page_size)


# ---- staging: one flat int64 buffer --------------------------------------------------------------

@dataclass(frozen=True)
class Staging:
    """Offsets into the flat input buffer (host staging and its device twin) for buckets <= M."""

    max_bucket: int
    """M: rows of the token, position, slot and length sections."""
    max_width: int
    """Widest captured block table."""

    @property
    def numel(self) -> int:
        return 5 * self.max_bucket + self.max_bucket * self.max_width

    def views(self, flat, bucket: int, width: int):
        """(tokens, positions, slots, lens, tables [bucket, width]) views of `flat` (a tensor or
        a numpy array) for one graph."""
        m = self.max_bucket
        tables = flat[5 * m:5 * m + bucket * width]
        return (flat[:bucket], flat[m:m + bucket], flat[2 * m:2 * m + bucket],
                flat[3 * m:3 * m + bucket], tables.reshape(bucket, width))

    def topk(self, flat, bucket: int):
        """The sparse top-k section's view for one graph (the kernels' encoding)."""
        return flat[4 * self.max_bucket:4 * self.max_bucket + bucket]

    def used(self, bucket: int, width: int) -> int:
        """Leading elements a step of this graph copies to the device."""
        return 5 * self.max_bucket + bucket * width


def stage_decode(flat: np.ndarray, lay: Staging, bucket: int, width: int, tokens: np.ndarray,
                 positions: np.ndarray, slots: np.ndarray, lens: np.ndarray, tables: np.ndarray,
                 scratch_block: int, block_size: int) -> None:
    """Write a decode batch of len(tokens) rows into `flat`, padded to `bucket` rows and `width`
    table columns: real rows as given (tables [rows, w <= width] padded with PAD_BLOCK), padded
    rows a one-token sequence in the scratch block (see the module docstring); every row's sparse
    top-k dense (a sparse step's real rows are written on the device)."""
    b, w = tables.shape
    tok, pos, slot, ctx, tab = lay.views(flat, bucket, width)
    tok[:b], pos[:b], slot[:b], ctx[:b] = tokens, positions, slots, lens
    tok[b:], pos[b:], slot[b:], ctx[b:] = 0, 0, scratch_block * block_size, 1
    lay.topk(flat, bucket)[:] = 0
    tab.fill(PAD_BLOCK)
    tab[:b, :w] = tables
    tab[b:, 0] = scratch_block


# ---- capture and replay -------------------------------------------------------------------------

@dataclass
class _Entry:
    run: Callable[[], torch.Tensor]
    """Replays the graph (or, uncaptured, runs the forward) and returns its hidden [bucket, H]."""


class DecodeGraphs:
    """Static device inputs, and one captured decode forward per (bucket, width)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 max_num_seqs: int, capacity: int, block_size: int, alignment: int = 8,
                 max_widths: int = MAX_WIDTHS, sparse: DecodeSparsity = DenseDecodes()):
        self.model, self.backend, self.device = model, backend, torch.device(device)
        self.block_size = block_size
        self.sparse = sparse
        """Sparse top-k decode inside the graphs (its summaries and counter are captured by
        address: they must not be reallocated after capture); DenseDecodes: dense graphs."""
        self.buckets = batch_buckets(max_num_seqs)
        self.widths = graph_widths(capacity, alignment, max_widths)
        self.layout = Staging(self.buckets[-1], self.widths[-1])
        on_gpu = self.device.type == "cuda"
        self._host = torch.zeros(self.layout.numel, dtype=torch.long, pin_memory=on_gpu)
        self._dev = torch.zeros(self.layout.numel, dtype=torch.long, device=self.device)
        self._lens32 = torch.zeros(self.layout.max_bucket, dtype=torch.int32, device=self.device)
        self._copied = upload_event(self.device)
        """Recorded after each copy out of the host staging buffer; waited on before refilling."""
        self._entries: dict[tuple[int, int], _Entry] = {}
        self.scratch_block: int | None = None
        self.replays = 0
        """Steps replayed so far (bench/gpu_check.py reports it)."""

    @property
    def num_graphs(self) -> int:
        return len(self._entries)

    def capture(self, kv_caches: list[torch.Tensor], scratch_block: int, pool_blocks: int,
                graphs: bool = True) -> None:
        """Capture every (bucket, width), widest and largest first so the narrower ones reuse the
        shared pool's memory. The block pool must hand out only ids below scratch_block.
        graphs=False keeps each forward uncaptured (run again at every replay): the same inputs,
        metadata and padding without a GPU, for tests."""
        if pool_blocks > scratch_block:
            raise ValueError(f"scratch block {scratch_block} is inside the block pool (ids 0.."
                             f"{pool_blocks - 1}): the engine must keep {RESERVED_BLOCKS} block "
                             "out of the pool for decode CUDA graphs")
        self.scratch_block = scratch_block
        pool = torch.cuda.graph_pool_handle() if graphs else None
        with torch.inference_mode():
            for w in reversed(self.widths):
                for b in reversed(self.buckets):
                    self._entries[(b, w)] = self._capture_one(kv_caches, b, w, pool, graphs)
        if graphs:
            torch.cuda.synchronize(self.device)

    def _capture_one(self, kv_caches, bucket: int, width: int, pool, graphs: bool) -> _Entry:
        tok, pos, slots, lens, tables = self.layout.views(self._dev, bucket, width)
        lens32 = self._lens32[:bucket]
        meta = static_metadata(self.backend, tables, lens32, self.block_size)
        step = self.sparse.static_step(self.layout.topk(self._dev, bucket))
        ctx = ForwardContext(self.backend, meta, slots, kv_caches, step)

        def forward() -> torch.Tensor:
            lens32.copy_(lens)
            with forward_context(ctx):
                return self.model(tok, pos)

        # Every row padding: the warm-up (triton compiles, cuBLAS picks kernels) and the capture
        # write K/V only into the scratch block.
        empty = np.zeros((0, 1), dtype=np.int64)
        stage_decode(self._host.numpy(), self.layout, bucket, width, empty[:, 0], empty[:, 0],
                     empty[:, 0], empty[:, 0], empty, self.scratch_block, self.block_size)
        self._dev.copy_(self._host)
        if not graphs:
            return _Entry(forward)
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this (the engine loop's) thread is held to capture rules. Under the
        # default ("global") a CUDA call another thread makes meanwhile (a tier writer's copy,
        # a grammar compile, the server's threads) breaks the capture; those threads do not
        # touch the graph's stream, so the capture does not need to watch them.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return _Entry(replay)

    def graph_for(self, layout: BatchLayout) -> tuple[int, int] | None:
        """(bucket, width) of the graph this step replays, or None: it runs eagerly (not
        decode-only, or past the largest bucket or width)."""
        if not self._entries or layout.num_decodes != layout.num_seqs:
            return None
        b = smallest_at_least(layout.num_seqs, self.buckets)
        w = smallest_at_least(layout.block_tables.shape[1], self.widths)
        return None if b is None or w is None else (b, w)

    def can_replay(self, layout: BatchLayout) -> bool:
        return self.graph_for(layout) is not None

    def upload(self, layout: BatchLayout, buffers: BatchBuffers,
               plan: SparseStep | None = None) -> StepInputs:
        """Copy the step's inputs into its graph's: StepInputs whose run() replays it (hidden
        [num_seqs, H], valid until the next replay). plan: the step's sparse decode plan, whose
        device top-k the real rows take (None: every row dense)."""
        bucket, width = self.graph_for(layout)
        b = layout.num_seqs
        self._copied.synchronize()  # the last step's copy has left the staging buffer
        stage_decode(self._host.numpy(), self.layout, bucket, width, buffers.tokens.numpy()[:b],
                     buffers.positions.numpy()[:b], buffers.slot_mapping.numpy()[:b],
                     buffers.context_lens.numpy()[:b], layout.block_tables.numpy(),
                     self.scratch_block, self.block_size)
        n = self.layout.used(bucket, width)
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self._copied.record()
        if plan is not None:  # after the staged zeros, on the same stream
            self.layout.topk(self._dev, bucket)[:b].copy_(plan.topk, non_blocking=True)
        _, _, slots, _, _ = self.layout.views(self._dev, bucket, width)
        entry = self._entries[(bucket, width)]

        def run() -> torch.Tensor:
            self.replays += 1
            return entry.run()[:b]
        return StepInputs(run, slots[:b], n * self._host.element_size())
