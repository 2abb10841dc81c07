"""KVTier: the interface every KV tier implements, and the bookkeeping they all share.

Two phases, called from the manager's threads (never from the step loop itself):
  contains_prefix(keys) -> int      how many leading keys the tier holds; reads no payload
  load(keys) -> [tensor]            verified payloads, each [layers, 2, kv_heads, block_size, dim]
  store(keys, blocks) -> int        write blocks the tier lacks; never raises for I/O trouble

Every tier announces what it writes, evicts, removes and clears through `self.events`
(TierEvents; the owning TierManager connects it to its EventLog).

All public methods are thread-safe: each tier guards its index with its own lock and does slow
I/O outside it. Recency: load() and store() end by touching their keys last-to-first, so within
one sequence the prefix is the most recently used block and a suffix is evicted before its prefix
(a suffix without its prefix can never be a hit). A subclass implements the _underscored hooks.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Sequence

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers.errors import CorruptPayload, TierError, TierUnavailable
from tierserve.engine.kv_tiers.events import BlockMeta, TierEvents
from tierserve.engine.core.tier_descriptor import Locality, Medium
from tierserve.engine.kv_tiers.stats import TierCounters, TierStats

if TYPE_CHECKING:
    import torch

    from tierserve.engine.kv_tiers.config import TierConfig
    from tierserve.engine.kv_tiers.layout import BlockLayout


class KVTier(ABC):
    name: ClassVar[str]
    medium: ClassVar[Medium]
    locality: ClassVar[Locality]

    def __init__(self, config: TierConfig, layout: BlockLayout):
        self.config = config
        self.layout = layout
        self.counters = TierCounters()
        self.events = TierEvents(self.medium.value, self.locality.value, layout.block_size)
        self.delay_s = 0.0
        """Test hook: each block's read and write sleeps this long first, inside the timed
        part, so a slow tier looks slow in the stats too."""

    # ---- the interface -------------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many of the leading keys the tier holds (stops at the first miss)."""
        n = 0
        for key in keys:
            if not self._has(key):
                break
            n += 1
        return n

    def load(self, keys: Sequence[BlockHash]) -> list[torch.Tensor]:
        """Payloads of all keys, verified. Raises TierError (a miss, corruption, I/O); a corrupt
        payload is removed before the error is raised. Callers must not write to the tensors."""
        out = []
        for key in keys:
            out.append(self._load_one(key))
        self.touch(keys)
        return out

    def store(self, keys: Sequence[BlockHash], blocks: Sequence[torch.Tensor],
              meta: Sequence[BlockMeta] | None = None) -> int:
        """Write the blocks whose keys the tier lacks, in order; returns how many were written.
        A failure is counted by kind and ends the call (the blocks before it stay). The written
        keys are announced as BlockStored, with `meta` (parent hash, token ids) per key."""
        if len(keys) != len(blocks) or (meta is not None and len(meta) != len(keys)):
            raise ValueError(f"{len(keys)} keys for {len(blocks)} blocks"
                             + (f" and {len(meta)} meta entries" if meta is not None else ""))
        for b in blocks:
            self._check_block(b)
        if not self._allow_store():
            self.counters.error(TierUnavailable.kind)
            return 0
        done = 0
        with self.events.storing(keys, meta) as batch:
            for i, (key, block) in enumerate(zip(keys, blocks)):
                try:
                    if self._store_one(key, block):
                        batch.add(i)
                except TierError as e:
                    self.counters.error(e.kind)
                    self._store_failed(e)
                    break
                done += 1
            else:
                self._store_succeeded()
        self.touch(keys[:done])
        return batch.written

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Mark keys used, the first key last, so it is the most recently used."""
        for key in reversed(keys):
            self._touch(key)

    def remove(self, key: BlockHash) -> bool:
        """Drop one block; True if it was there (and then it is announced as BlockRemoved)."""
        if not self._delete(key):
            return False
        self.events.removed([key])
        return True

    def clear(self) -> int:
        """Drop every block the tier knows of (see _clearable); announced as one
        AllBlocksCleared. Returns how many were dropped. Writes still queued land afterwards."""
        n = sum(self._delete(key) for key in self._clearable())
        self.events.cleared()
        return n

    @abstractmethod
    def keys(self) -> list[BlockHash]:
        """Keys held, in eviction order where the tier has one (next victim first)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None: ...

    @property
    def breaker_state(self) -> str | None:
        return None

    def stats(self) -> TierStats:
        st = self.counters.snapshot(
            name=self.name, medium=self.medium.value, locality=self.locality.value,
            used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes,
            breaker_state=self.breaker_state)
        return replace(st, hit_tokens=st.hit_blocks * self.layout.block_size)

    def close(self) -> None:
        """Release threads and connections; the tier's stored data stays."""

    # ---- shared steps --------------------------------------------------------------------
    def _load_one(self, key: BlockHash) -> torch.Tensor:
        t0 = time.perf_counter()
        self._pause()
        try:
            if not self._allow_load():
                raise TierUnavailable(f"{self.name} tier is not accepting requests")
            block = self._read(key)
        except TierError as e:
            self.counters.error(e.kind)
            if isinstance(e, CorruptPayload):
                self.remove(key)
            raise
        dt = time.perf_counter() - t0
        self.counters.add(loaded_blocks=1, bytes_loaded=self.layout.block_bytes, load_seconds=dt)
        self.counters.observe("load", dt)
        return block

    def _store_one(self, key: BlockHash, block: torch.Tensor) -> int:
        t0 = time.perf_counter()
        self._pause()
        nbytes = self._write(key, block)
        if nbytes:
            dt = time.perf_counter() - t0
            self.counters.add(stored_blocks=1, bytes_stored=nbytes, store_seconds=dt)
            self.counters.observe("store", dt)
        return 1 if nbytes else 0

    def _check_block(self, block: torch.Tensor) -> None:
        lay = self.layout
        if tuple(block.shape) != lay.block_shape or block.dtype != lay.dtype:
            raise ValueError(f"{self.name} tier: block is {block.dtype} {tuple(block.shape)}, "
                             f"expected {lay.dtype} {lay.block_shape}")

    def _evicted(self, keys: Sequence[BlockHash]) -> None:
        """Count and announce blocks dropped to make room (call without the index lock)."""
        self.counters.add(evictions=len(keys))
        self.events.removed(keys)

    def _pause(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    # ---- hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _has(self, key: BlockHash) -> bool: ...

    @abstractmethod
    def _read(self, key: BlockHash) -> torch.Tensor:
        """The verified payload, [layers, 2, kv_heads, block_size, dim]; raises TierError."""

    @abstractmethod
    def _write(self, key: BlockHash, block: torch.Tensor) -> int:
        """Store one block; payload bytes written, 0 if the key was already there."""

    @abstractmethod
    def _delete(self, key: BlockHash) -> bool: ...

    def _touch(self, key: BlockHash) -> None:
        """Mark one key most recently used (tiers without an eviction order ignore it)."""

    def _clearable(self) -> list[BlockHash]:
        """The keys clear() deletes: all of keys() unless a tier says otherwise."""
        return self.keys()

    def _allow_load(self) -> bool:
        return True

    def _allow_store(self) -> bool:
        return True

    def _store_failed(self, error: TierError) -> None:
        """A write failed with `error` (already counted)."""

    def _store_succeeded(self) -> None:
        """Every write of one store() call went through."""
