"""What a sparse decode step hands the attention backends (built by engine/sparse.py).

Quest-style page selection: every full KV block keeps the element-wise min and max of its keys per
KV head (its summary); a decode query scores each block by the upper bound of q.k those give and
attends only the top-k blocks of each (sequence, KV head), always with the first and the newest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseStep:
    summaries: list[torch.Tensor]
    """Per layer [2 (min, max), Hkv, num_blocks, D] float32 on the KV cache's device."""
    dense_layers: int
    """The first layers attend densely (Quest keeps the first two dense)."""
    topk: torch.Tensor
    """[num_decodes] int64 view: blocks each decode may attend; 0 attends all of them."""
    selected: torch.Tensor
    """[num_decodes, Hkv, width] int32 view the kernel writes each head's chosen blocks into."""
    stats: torch.Tensor
    """[2] float64 accumulator: blocks attended (over sequences, KV heads and sparse layers) and
    selection nanoseconds."""
    max_blocks: int = 0
    """The most blocks any decode of the step attends (a host int, for kernels that size their
    grid by it); 0: not known."""

    def applies(self, layer: int) -> bool:
        return layer >= self.dense_layers
