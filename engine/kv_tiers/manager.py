"""TierManager: the KV tiers below the device cache, in lookup order, and their threads.

Threads and what they own:

    caller (step loop)          load pool (load_workers)     writers (store_workers per tier)
    ------------------          ------------------------     --------------------------------
    lookup(): contains_prefix   LoadHandle jobs:             StoreQueue._run: tier.store(),
      on each allowed tier        tier.load([key])             which records BlockStored
    start_load() -> LoadHandle                                 after the writes
    store()/demote(): one host
      copy, put_nowait per tier

clear() runs on its caller's thread; whichever thread drops a block records BlockRemoved.

The caller never waits on a payload read or write: lookup() asks only for presence (for s3,
HEAD requests bounded by max_blocks, the breaker and the timeouts), loads run on the pool, and a
store whose queue is full is dropped and counted. Per-request filters (load_tiers, store_tiers)
and the load budget (max_blocks) are arguments of each call; None means every configured tier.

`events` is the log of what the tiers stored, removed and cleared (events.py), for routers.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import replace
from typing import Iterable, Sequence

import torch

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers.base import KVTier
from tierserve.engine.kv_tiers.config import TIERS, TierConfig
from tierserve.engine.kv_tiers.events import BlockMeta, EventLog
from tierserve.engine.core.tier_descriptor import TierDescriptor
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.kv_tiers.load import LoadHandle, TierHit
from tierserve.engine.kv_tiers.registry import create_tier
from tierserve.engine.kv_tiers.stats import TierStats
from tierserve.engine.kv_tiers.writer import StoreQueue

log = logging.getLogger(__name__)


class TierManager:
    def __init__(self, config: TierConfig, fingerprint: bytes, block_shape: Sequence[int],
                 dtype: torch.dtype):
        self.config = config
        self.layout = BlockLayout(fingerprint, tuple(block_shape), dtype)
        self.events = EventLog(config.event_log_size, config.event_token_ids)
        """What the tiers stored, removed and cleared (GET /v1/kv/events)."""
        self.tiers: dict[str, KVTier] = {}
        """The tiers in lookup order, by name."""
        for name in config.tiers:
            self.tiers[name] = create_tier(name, config, self.layout)
            self.tiers[name].events.log = self.events
        self._writers = {name: StoreQueue(t, config.store_queue_depth, config.store_workers)
                         for name, t in self.tiers.items()}
        self._pool = cf.ThreadPoolExecutor(config.load_workers, thread_name_prefix="kv-load")

    def descriptors(self) -> tuple[TierDescriptor, ...]:
        """The tiers in lookup order, as the policy and the server name them."""
        return tuple(TierDescriptor(n, t.medium, t.locality) for n, t in self.tiers.items())

    def lookup(self, keys: Sequence[BlockHash], load_tiers: Iterable[str] | None = None,
               max_blocks: int | None = None) -> TierHit:
        """The longest leading run of `keys` the allowed tiers hold together, block by block
        from the first tier in lookup order that has it. Never raises; reads no payload."""
        keys = list(keys if max_blocks is None else keys[:max(0, max_blocks)])
        tiers = self._select(load_tiers)
        sources, asked = _plan(keys, tiers)
        for tier in tiers:
            if tier.name in asked:
                tier.counters.add(lookups=1, hit_blocks=sources.count(tier.name))
        return TierHit(tuple(keys[:len(sources)]), tuple(sources), self.layout.block_size, asked)

    def start_load(self, hit: TierHit) -> LoadHandle:
        """Read the hit's payloads in the background (see LoadHandle)."""
        return LoadHandle(hit, self.tiers, self._pool)

    def store(self, keys: Sequence[BlockHash], blocks: torch.Tensor,
              store_tiers: Iterable[str] | None = None,
              meta: Sequence[BlockMeta] | None = None) -> int:
        """Queue blocks [n, *block_shape] for every allowed tier; returns how many tiers took
        the job. Copies the blocks once (the caller may reuse its buffer at once); never waits.
        `meta`: (parent hash or None, token ids) per key, for the BlockStored events (None:
        parent_block_hash None and no token ids)."""
        self._check_blocks(keys, blocks)
        if meta is not None and len(meta) != len(keys):
            raise ValueError(f"{len(meta)} meta entries for {len(keys)} keys")
        queues = [self._writers[t.name] for t in self._select(store_tiers)]
        if not keys or not queues:
            return 0
        if not any(q.has_room() for q in queues):
            for q in queues:
                q.drop()
            return 0
        host = torch.empty(blocks.shape, dtype=blocks.dtype, device="cpu").copy_(blocks)
        meta = tuple(meta) if meta is not None else None
        return sum(q.submit(tuple(keys), host, meta) for q in queues)

    def demote(self, keys: Sequence[BlockHash], blocks: torch.Tensor,
               meta: Sequence[BlockMeta] | None = None) -> int:
        """Keep blocks the device cache evicts in the cpu tier (if configured)."""
        return self.store(keys, blocks, store_tiers=("cpu",), meta=meta)

    def clear(self, tiers: Iterable[str] | None = None) -> int:
        """Drop every block of the given tiers (None: all), each announced as AllBlocksCleared;
        returns how many blocks were dropped. s3 drops only what this process uploaded (see
        s3.py). Runs on the caller's thread (s3: one DELETE per block)."""
        return sum(t.clear() for t in self._select(tiers))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done; False if `timeout` ran out first."""
        return all(q.flush(timeout) for q in self._writers.values())

    def stats(self) -> dict[str, TierStats]:
        """A snapshot per tier, in lookup order; cheap, safe from any thread."""
        return {name: replace(t.stats(), queued_writes=self._writers[name].pending())
                for name, t in self.tiers.items()}

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued writes (up to `timeout`), stop the threads. Stored data stays."""
        for q in self._writers.values():
            q.close(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.tiers.values():
            t.close()

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _select(self, names: Iterable[str] | None) -> list[KVTier]:
        """The configured tiers among `names`, in lookup order (None: all of them)."""
        if names is None:
            return list(self.tiers.values())
        wanted = set(names)
        for n in wanted - set(TIERS):
            raise ValueError(f"unknown KV tier {n!r} (valid: {', '.join(TIERS)})")
        return [t for name, t in self.tiers.items() if name in wanted]

    def _check_blocks(self, keys: Sequence[BlockHash], blocks: torch.Tensor) -> None:
        lay = self.layout
        want = (len(keys), *lay.block_shape)
        if tuple(blocks.shape) != want or blocks.dtype != lay.dtype:
            raise ValueError(f"blocks are {blocks.dtype} {tuple(blocks.shape)}, "
                             f"expected {lay.dtype} {want}")


def _plan(keys: list[BlockHash], tiers: list[KVTier]) -> tuple[list[str], dict[str, float]]:
    """Source tier of each leading key, and the seconds each asked tier took. A tier's
    contains_prefix answer is remembered as a span [start, end) of keys it holds with keys[end]
    absent, so a tier is asked again only past what it already told: a remote tier later in the
    order is asked only where no local tier has the block."""
    spans: dict[str, tuple[int, int]] = {}
    seconds: dict[str, float] = {}
    sources: list[str] = []
    for i in range(len(keys)):
        for tier in tiers:
            span = spans.get(tier.name)
            if span is None or i > span[1]:  # nothing known about keys[i] yet: ask
                t0 = time.perf_counter()
                span = spans[tier.name] = (i, i + _contains(tier, keys[i:]))
                seconds[tier.name] = seconds.get(tier.name, 0.0) + time.perf_counter() - t0
            if i < span[1]:
                sources.append(tier.name)
                break
        else:
            break
    return sources, seconds


def _contains(tier: KVTier, keys: list[BlockHash]) -> int:
    try:
        return tier.contains_prefix(keys)
    except Exception:  # a lookup is never worth an exception in the step loop
        tier.counters.error("unexpected")
        log.exception("%s tier: contains_prefix failed", tier.name)
        return 0
