"""BlockLayout: what one block payload is (shape, dtype) and whose it is (the model fingerprint).

A block's payload is its K and V for every layer, one tensor of shape
[num_layers, 2, num_kv_heads, block_size, head_dim] in the KV cache's dtype. The fingerprint
namespaces every tier (disk subfolder, S3 key component), so two models never share a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    """The shape, dtype and owner of every payload in a set of tiers."""

    fingerprint: bytes
    """Model fingerprint (engine.block_hash.fingerprint); its hex names folders and key prefixes."""
    block_shape: tuple[int, ...]
    """[num_layers, 2, num_kv_heads, block_size, head_dim] of one block."""
    dtype: torch.dtype
    """The KV cache's dtype: float32, float16 or bfloat16."""

    def __post_init__(self) -> None:
        if len(self.block_shape) != 5 or self.block_shape[1] != 2:
            raise ValueError(f"block_shape: want [layers, 2, kv_heads, block_size, head_dim], "
                             f"got {self.block_shape}")

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.block_shape[3]

    @property
    def block_bytes(self) -> int:
        """Tensor bytes of one block (a stored payload adds a small header)."""
        return math.prod(self.block_shape) * self.dtype.itemsize
