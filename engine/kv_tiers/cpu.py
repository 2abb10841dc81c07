"""The cpu tier: block payloads in host memory, an LRU under a byte capacity.

Eviction order: least recently used first, where a use is a store or a load. A store or load of
a sequence touches its keys last-to-first (KVTier.touch), so a sequence's tail is evicted before
its prefix. A key already present is touched, not copied again. keys() lists the next victim first.

Stored tensors are private contiguous copies, so the caller may reuse its buffer at once; load
returns the stored tensor itself (no copy): the caller copies it into the device cache and must
not write to it. One lock guards the index; the copy happens outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers.base import KVTier
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.errors import TierError, TierMiss
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.core.tier_descriptor import Locality, Medium


class CpuTier(KVTier):
    name = "cpu"
    medium = Medium.CPU
    locality = Locality.LOCAL

    def __init__(self, config: TierConfig, layout: BlockLayout):
        super().__init__(config, layout)
        self._capacity = config.cpu_bytes
        self._lock = threading.Lock()
        self._blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()  # LRU first
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return list(self._blocks)

    def _has(self, key: BlockHash) -> bool:
        return key in self._blocks  # a dict lookup is atomic under the GIL

    def _read(self, key: BlockHash) -> torch.Tensor:
        block = self._blocks.get(key)
        if block is None:
            raise TierMiss(f"cpu tier: no block {key.hex()}")
        return block

    def _write(self, key: BlockHash, block: torch.Tensor) -> int:
        if key in self._blocks:
            return 0
        n = block.nelement() * block.element_size()
        if n > self._capacity:
            raise TierError(f"cpu tier: a {n}-byte block exceeds the capacity", kind="too_large")
        copy = torch.empty(block.shape, dtype=block.dtype, device="cpu").copy_(block)
        with self._lock:
            if key in self._blocks:
                return 0
            evicted = self._evict_for(n)
            self._blocks[key] = copy
            self._used += n
        self._evicted(evicted)
        return n

    def _evict_for(self, n: int) -> list[BlockHash]:
        """Drop least recently used blocks until n more bytes fit; the lock is held."""
        evicted = []
        while self._blocks and self._used + n > self._capacity:
            victim, block = self._blocks.popitem(last=False)
            self._used -= block.nelement() * block.element_size()
            evicted.append(victim)
        return evicted

    def _touch(self, key: BlockHash) -> None:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _delete(self, key: BlockHash) -> bool:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is not None:
                self._used -= block.nelement() * block.element_size()
        return block is not None
