"""Whole KV blocks copied between the device cache and the KV tiers, every layer at once.

A layer's cache is [2 (K, V), Hkv, slots, D] with slot = block * block_size + offset, so viewing
it as [2, Hkv, num_blocks, block_size, D] needs no copy, and a set of blocks is one index_select
(or index_copy_) per layer. Blocks leave and arrive as [n, layers, 2, Hkv, block_size, D].
"""

from __future__ import annotations

import torch


def _blocks_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    two, h, slots, d = cache.shape
    return cache.view(two, h, slots // block_size, block_size, d)


@torch.inference_mode()
def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int],
                  block_size: int) -> torch.Tensor:
    """Copies of these blocks' KV on the host."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    per_layer = [_blocks_view(c, block_size).index_select(2, idx) for c in kv_caches]
    return torch.stack(per_layer).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()


@torch.inference_mode()
def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: torch.Tensor,
                 block_size: int) -> None:
    """Write host or device blocks into these cache blocks (between steps)."""
    cache0 = kv_caches[0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache0.device)
    data = blocks.to(device=cache0.device, dtype=cache0.dtype).permute(1, 2, 3, 0, 4, 5)
    for cache, layer in zip(kv_caches, data):
        _blocks_view(cache, block_size).index_copy_(2, idx, layer)
