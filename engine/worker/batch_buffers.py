"""The step's input and metadata buffers: allocated once at capacity, viewed as wide as the batch.

Every per-step tensor the runner hands the model and the attention backends (token ids, positions,
KV slots, block tables, context lengths, the sparse decode's selected-block indices) is a view of
one of these buffers. Block-table views are as wide as the live batch needs, rounded so the width
only changes at powers of two:

    width = min(capacity, max(alignment, next_power_of_two(most blocks any sequence holds)))

A CUDA graph or a compiled kernel captured for a width stays valid until the width crosses a power
of two, and a batch of short requests moves 2-16x fewer metadata bytes than a capacity-wide table.
A view [rows, width] is the first rows * width elements of the flat buffer, so it is contiguous
(a backend needs no copy) and its row stride is `width`. Entries past a sequence's blocks hold
PAD_BLOCK, which no kernel can take for a block (block ids are >= 0).

On a GPU the host buffers are pinned, so the copies to the device are asynchronous: each step
records an upload_event() after its copies, and the next step waits for it before writing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np
import torch

from tierserve.kernels.base import BatchLayout

if TYPE_CHECKING:
    from tierserve.engine.core.scheduler import ScheduledRequest

PAD_BLOCK = -1
"""Block-table padding: never a block id."""


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def active_width(longest: int, capacity: int, alignment: int) -> int:
    """Block-table width for a batch whose longest sequence holds `longest` blocks."""
    return min(capacity, max(alignment, next_power_of_two(longest)))


class BatchBuffers:
    """Host buffers for one step's inputs, sized for the worst step the config admits."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, capacity_blocks: int,
                 num_kv_heads: int, alignment: int = 8, adaptive: bool = True,
                 pin_memory: bool = False, device: torch.device | None = None):
        self.max_num_seqs = max_num_seqs
        self.capacity = capacity_blocks
        """Most blocks one sequence can hold (ceil(max_model_len / block_size))."""
        self.alignment = alignment
        """Narrowest table width, in blocks."""
        self.adaptive = adaptive
        """False: every view is capacity wide (the worst case; for comparison in bench/sparse.py)."""
        self.num_kv_heads = num_kv_heads

        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin_memory)

        self.tokens = buf(max_num_tokens, torch.long)
        self.positions = buf(max_num_tokens, torch.long)
        self.slot_mapping = buf(max_num_tokens, torch.long)
        self.context_lens = buf(max_num_seqs, torch.long)
        self.tables = buf(max_num_seqs * capacity_blocks, torch.long)
        self.selected = torch.zeros(max_num_seqs * num_kv_heads * capacity_blocks,
                                    dtype=torch.int32, device=device)
        """Sparse decode: the blocks each (sequence, KV head) attends, written by the kernel.
        On `device` (where the kernels run), not pinned on the host: nothing in a step reads it
        back, and a host buffer made each sparse layer's write a blocking device-to-host copy."""
        self.topk = buf(max_num_seqs, torch.long)
        """Sparse decode: blocks each sequence may attend, in the kernels' encoding
        (kernels/sparse_plan.kernel_topk)."""

    def width(self, longest: int) -> int:
        return active_width(longest, self.capacity, self.alignment) if self.adaptive else self.capacity

    def table_view(self, block_ids: list[tuple[int, ...]]) -> torch.Tensor:
        """[len(block_ids), width] contiguous view holding each row's blocks, PAD_BLOCK after."""
        rows = len(block_ids)
        longest = max(len(b) for b in block_ids)
        if longest > self.capacity:
            raise ValueError(f"a sequence holds {longest} blocks; capacity is {self.capacity}")
        w = self.width(longest)
        view = self.tables[:rows * w].view(rows, w)
        rows_np = view.numpy()  # the same memory: filled without a torch allocation
        rows_np.fill(PAD_BLOCK)
        for i, ids in enumerate(block_ids):
            rows_np[i, :len(ids)] = ids
        return view

    def selected_view(self, rows: int, topk: int) -> torch.Tensor:
        """[rows, num_kv_heads, topk] contiguous int32 view for the sparse kernel's output."""
        k = min(topk, self.capacity)
        return self.selected[:rows * self.num_kv_heads * k].view(rows, self.num_kv_heads, k)

    def write_step(self, sched: tuple[ScheduledRequest, ...],
                   block_size: int) -> tuple[BatchLayout, list[int]]:
        """Write a step's tokens, positions, slots, block tables and context lengths into the
        buffers (through numpy views of their memory: no tensor is allocated): the step's layout
        and the rows that sample. A verified decode's 1 + k positions are 1 + k decode rows of
        the layout (query_rows), so the step stays a decode step for the attention kernels."""
        tokens, a = self.tokens.numpy(), 0
        for s in sched:
            n = s.num_request_tokens
            tokens[a:a + n] = s.request.token_slice(s.start, s.start + n)
            tokens[a + n:a + s.num_new_tokens] = s.spec_token_ids
            a += s.num_new_tokens
        rows = query_rows(sched)
        qlens = np.fromiter((q for _, _, q in rows), dtype=np.int64, count=len(rows))
        starts = np.fromiter((st for _, st, _ in rows), dtype=np.int64, count=len(rows))
        qstart = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qstart[1:])
        t = int(qstart[-1])
        tables = self.table_view([s.block_ids for s, _, _ in rows])
        seq = np.repeat(np.arange(len(rows)), qlens)
        pos = self.positions.numpy()[:t]
        np.add(np.arange(t) - qstart[:-1][seq], starts[seq], out=pos)
        slots = self.slot_mapping.numpy()[:t]
        np.add(tables.numpy()[seq, pos // block_size] * block_size, pos % block_size, out=slots)
        ctx_lens = starts + qlens
        self.context_lens.numpy()[:len(rows)] = ctx_lens
        num_decodes = next((i for i, q in enumerate(qlens.tolist()) if q != 1), len(rows))
        layout = BatchLayout(num_decodes, qlens.tolist(), ctx_lens.tolist(), qstart.tolist(),
                             tables, self.slot_mapping[:t], block_size)
        return layout, [i for i, s in enumerate(sched) if s.samples]

    @staticmethod
    def nbytes(*views: torch.Tensor) -> int:
        return sum(v.numel() * v.element_size() for v in views)


def query_rows(sched: tuple[ScheduledRequest, ...]) -> list[tuple[ScheduledRequest, int, int]]:
    """The layout's rows as (scheduled request, first position, query length): one per request,
    but a verified decode (its last token and k proposals) gives 1 + k one-token rows over the
    same blocks, context lengths one apart. Attention is the same either way (each position sees
    the positions up to its own); as decode rows it runs in the decode kernels and the one-call
    decode stack. The scheduler puts verified decodes after the plain ones, before prefills, so
    the leading rows are all one-token rows."""
    rows = []
    for s in sched:
        if s.spec_token_ids and s.num_request_tokens == 1:
            rows += [(s, s.start + j, 1) for j in range(s.num_new_tokens)]
        else:
            rows.append((s, s.start, s.num_new_tokens))
    return rows


class StepInputs(NamedTuple):
    """A step's inputs on the device, ready to run (a decode graph's static ones, or eager)."""

    run: Callable[[], torch.Tensor]
    """Runs the model over them: the hidden states of the step's tokens."""
    slots: torch.Tensor
    """[tokens] int64 on the device: the KV slot each token's K and V are stored at."""
    nbytes: int
    """Bytes of metadata the step moved or viewed (StepResult.metadata_bytes)."""


class _CopiesDone:
    """The CPU's upload event: its copies are synchronous, so they are done when recorded."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def upload_event(device: torch.device) -> torch.cuda.Event | _CopiesDone:
    """An event to record after a step's copies out of pinned host memory and to wait on before
    that memory is written again."""
    return torch.cuda.Event() if device.type == "cuda" else _CopiesDone()
