"""What a sparse decode step hands the attention backends (built by engine/worker/sparse.py).

Quest-style page selection: every full KV block keeps the element-wise min and max of its keys per
KV head (its summary); a decode query scores each block by the upper bound of q.k those give and
attends only the top-k blocks of each (sequence, KV head), always with the first and the newest.

The engine says which decodes attend densely with a mask (engine/worker/sparse.py: RowChoice). The
kernels (csrc/sparse_decode.cpp, kernels/triton_kernels.py, the torch oracle kernels/sparse.py)
take one int64 per row instead, 0 selecting their dense path; kernel_topk() is the one place that
writes that encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def kernel_topk(topk: np.ndarray, dense: np.ndarray, out: np.ndarray) -> None:
    """Write each row's top-k into `out` in the kernels' encoding: 0 where the row is dense."""
    out[:] = np.where(dense, 0, topk)


@dataclass(frozen=True)
class SparseStep:
    summaries: list[torch.Tensor]
    """Per layer [2 (min, max), Hkv, num_blocks, D] float32 on the KV cache's device."""
    dense_layers: int
    """The first layers attend densely (Quest keeps the first two dense)."""
    topk: torch.Tensor
    """[num_decodes] int64 on the device: blocks each decode may attend, in the kernels' encoding
    (kernel_topk)."""
    selected: torch.Tensor | None
    """[num_decodes, Hkv, width] int32 view the kernel writes each head's chosen blocks into, or
    None: not recorded (the decode graphs, whose choice nothing reads)."""
    stats: torch.Tensor
    """[2] float64 accumulator: blocks attended (over sequences, KV heads and sparse layers) and
    selection nanoseconds."""
    max_blocks: int | None = None
    """The most blocks any decode of the step attends (a host int, for kernels that size their
    grid by it), or None: not known (a captured graph serves many steps)."""

    def applies(self, layer: int) -> bool:
        return layer >= self.dense_layers
