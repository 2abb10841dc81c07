"""KV events for routers: what each tier stored, removed and cleared, in vLLM's vocabulary.

Event types and their fields follow vllm/distributed/kv_events.py (BlockStored, BlockRemoved,
AllBlocksCleared), plus `locality` on each and `medium` on AllBlocksCleared, so a router can tell
the tiers apart. One BlockStored covers a chain: `parent_block_hash` is the parent of the first
hash, each later hash's parent is the one before it, and `token_ids` are the blocks' tokens
concatenated (block_size per block).

    writer threads, load threads       EventLog (one per TierManager)      readers (SSE route)
    ----------------------------       ------------------------------      -------------------
    TierEvents.storing/removed/   ->   record(): seq += 1, append to   ->  since(seq), wait()
      cleared (per tier)                 a ring of capacity events

Ordering: a tier announces a store when its store() call ends, and announces a removal at once;
so that a key is never announced removed before it was announced stored, a removal first flushes
the stores the same thread has written but not yet announced. With store_workers > 1 another
writer's eviction can still slip in between (the router then believes a block is held that is
not, which costs it one miss).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, fields
from typing import Iterator, NamedTuple, Sequence

from tierserve.engine.core.block_hash import BlockHash, BlockMeta


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    """The blocks written, a chain in order (see the module docstring)."""
    parent_block_hash: BlockHash | None
    """Parent of the first block; None for a sequence's first block or when unknown."""
    token_ids: tuple[int, ...]
    """Tokens of all the blocks, concatenated; empty unless the log keeps them (an operator's
    opt-in: they are the tenants' prompts) or when the caller gave none."""
    block_size: int
    """Tokens per block."""
    lora_id: int | None = None
    """Always None: no LoRA adapters here."""
    medium: str
    """Medium value of the tier: CPU or STORAGE."""
    locality: str
    """Locality value of the tier: LOCAL or REMOTE."""


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    """Blocks evicted or removed (corrupt, vanished, or deleted)."""
    medium: str
    locality: str


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    medium: str
    """The tier that was emptied (vLLM's event carries no field: it means the device cache)."""
    locality: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class LoggedEvent:
    seq: int
    """Position in the log: 1, 2, 3... without gaps."""
    ts: float
    """Unix time it was recorded."""
    event: KVEvent

    def to_json(self) -> dict:
        out: dict = {"seq": self.seq, "ts": self.ts, "type": type(self.event).__name__}
        for f in fields(self.event):
            out[f.name] = _plain(getattr(self.event, f.name))
        return out


@dataclass(frozen=True)
class EventsDropped:
    """Events a reader asked for that the ring no longer holds (it fell too far behind)."""

    first_seq: int
    last_seq: int

    def to_json(self) -> dict:
        return {"type": "EventsDropped", "first_seq": self.first_seq, "last_seq": self.last_seq}


class EventSlice(NamedTuple):
    events: list[LoggedEvent]
    """Buffered events past the asked-for seq, oldest first."""
    first_available: int
    """Seq of the oldest buffered event (last_seq + 1 when none is buffered)."""

    def dropped(self, since: int) -> EventsDropped | None:
        """The events after `since` that were lost before they could be read, if any."""
        if self.first_available > since + 1:
            return EventsDropped(since + 1, self.first_available - 1)
        return None


class EventLog:
    """A thread-safe ring of the last `capacity` events; record() never blocks for long."""

    def __init__(self, capacity: int, token_ids: bool = False):
        if capacity < 1:
            raise ValueError(f"event_log_size: must be at least 1, got {capacity}")
        self.token_ids = token_ids
        """BlockStored events keep the blocks' tokens (TierConfig.event_token_ids); else ()."""
        self._ring: collections.deque[LoggedEvent] = collections.deque(maxlen=capacity)
        self._cond = threading.Condition()
        self._last = 0

    @property
    def last_seq(self) -> int:
        """Seq of the newest event (0 before the first)."""
        return self._last

    def record(self, *events: KVEvent) -> int:
        """Append events (one timestamp for all); returns the last seq."""
        if not events:
            return self._last
        ts = time.time()
        with self._cond:
            for e in events:
                self._last += 1
                self._ring.append(LoggedEvent(self._last, ts, e))
            self._cond.notify_all()
            return self._last

    def since(self, seq: int) -> EventSlice:
        """Buffered events with seq > `seq`, and where the buffer starts (to detect a loss)."""
        with self._cond:
            first = self._ring[0].seq if self._ring else self._last + 1
            skip = max(0, seq + 1 - first)
            return EventSlice(list(itertools.islice(self._ring, skip, None)), first)

    def wait(self, seq: int, timeout: float) -> bool:
        """Block until an event past `seq` exists (True) or `timeout` seconds pass (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._last > seq, timeout)


class _Batch:
    """One store() call's written positions that were not announced yet."""

    def __init__(self, keys: Sequence[BlockHash], meta: Sequence[BlockMeta] | None):
        self.keys, self.meta = keys, meta
        self.pending: list[int] = []
        self.written = 0

    def add(self, i: int) -> None:
        self.pending.append(i)
        self.written += 1


class TierEvents:
    """One tier's voice in the log: stamps its medium and locality. Without a log (a tier built
    outside a TierManager) every call is a no-op."""

    def __init__(self, medium: str, locality: str, block_size: int):
        self.medium, self.locality, self.block_size = medium, locality, block_size
        self.log: EventLog | None = None
        """Set by the TierManager that owns the tier."""
        self._local = threading.local()  # the batch a writer thread is storing, if any

    @contextlib.contextmanager
    def storing(self, keys: Sequence[BlockHash],
                meta: Sequence[BlockMeta] | None) -> Iterator[_Batch]:
        """Collect the written positions of one store() call (batch.add(i)); announced at the
        end, or earlier if this thread removes a key meanwhile."""
        batch = _Batch(keys, meta)
        self._local.batch = batch
        try:
            yield batch
        finally:
            self._local.batch = None
            self._flush(batch)

    def removed(self, keys: Sequence[BlockHash]) -> None:
        if self.log is None or not keys:
            return
        batch = getattr(self._local, "batch", None)
        if batch is not None:
            self._flush(batch)
        self.log.record(BlockRemoved(block_hashes=tuple(keys), medium=self.medium,
                                     locality=self.locality))

    def cleared(self) -> None:
        if self.log is not None:
            self.log.record(AllBlocksCleared(medium=self.medium, locality=self.locality))

    def _flush(self, batch: _Batch) -> None:
        idx, batch.pending = batch.pending, []
        if self.log is not None and idx:
            self.log.record(*[self._stored(batch, run) for run in _chains(batch, idx)])

    def _stored(self, batch: _Batch, run: list[int]) -> BlockStored:
        meta = batch.meta
        keep = meta is not None and self.log is not None and self.log.token_ids
        return BlockStored(
            block_hashes=tuple(batch.keys[i] for i in run),
            parent_block_hash=meta[run[0]][0] if meta is not None else None,
            token_ids=tuple(t for i in run for t in meta[i][1]) if keep else (),
            block_size=self.block_size, medium=self.medium, locality=self.locality)


def _chains(batch: _Batch, idx: list[int]) -> list[list[int]]:
    """Split written positions into runs where each block's parent is the block before it (one
    run without meta: no chain is claimed then, as no tokens are given)."""
    if batch.meta is None:
        return [idx]
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1 and batch.meta[i][0] == batch.keys[i - 1]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _plain(value):
    """JSON-ready: hashes as hex strings, tuples as lists."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
