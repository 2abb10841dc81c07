"""TierHit (which tier serves which block) and LoadHandle (its payloads, read in the background).

A LoadHandle reads one block per job on the manager's load pool, so blocks from several tiers (and
several S3 objects) are read in parallel. It never raises: a block that is missing, corrupt or
unreachable ends the usable run there, its later jobs are cancelled, and result() is the shorter
leading run (possibly empty). The tiers count the failure; a corrupt payload is removed by its
tier. When every job is done the loaded keys are touched per tier, last-to-first, so each tier's
recency keeps the prefix ahead of its suffix whatever order the jobs finished in.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import torch

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers.base import KVTier
from tierserve.engine.kv_tiers.errors import TierError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierHit:
    """The leading run of keys the tiers can serve, and the tier that serves each block."""

    keys: tuple[BlockHash, ...]
    """Keys of the hit blocks, in order: a prefix of the keys asked about."""
    sources: tuple[str, ...]
    """Name of the tier that serves each block (the first tier in lookup order holding it)."""
    block_size: int
    """Tokens per block."""
    lookup_seconds: dict[str, float] = field(default_factory=dict)
    """Time each asked tier took to answer the lookup (a cost model's latency samples)."""

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.block_size

    def blocks_by_tier(self) -> dict[str, int]:
        return dict(Counter(self.sources))


class LoadHandle:
    """The payloads of a TierHit, loading on a thread pool. See the module docstring."""

    def __init__(self, hit: TierHit, tiers: dict[str, KVTier], pool: cf.ThreadPoolExecutor):
        self.hit = hit
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None if hit.keys else self.started_at
        """perf_counter() when the last job ended (None while loading)."""
        self._tiers = tiers
        self._lock = threading.Lock()
        self._pending = len(hit.keys)
        self._cancelled = threading.Event()
        self._futures = [pool.submit(self._load_one, tiers[src], key)
                         for key, src in zip(hit.keys, hit.sources)]
        for i, fut in enumerate(self._futures):
            fut.add_done_callback(partial(self._one_done, i))

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> list[torch.Tensor]:
        """The leading run of loaded blocks, each [layers, 2, kv_heads, block_size, dim].
        Waits for the load (at most `timeout` seconds, then returns the run ready so far)."""
        cf.wait(self._futures, timeout=timeout)
        out = []
        for fut in self._futures:
            block = _value(fut)
            if block is None:
                break
            out.append(block)
        return out

    def cancel(self) -> None:
        """Stop reading: jobs not started are dropped; result() returns what finished."""
        self._cancelled.set()
        for fut in self._futures:
            fut.cancel()

    @property
    def seconds(self) -> float | None:
        """Wall time from start_load until the last job ended (None while loading)."""
        return None if self.finished_at is None else self.finished_at - self.started_at

    @property
    def bytes_loaded(self) -> int:
        """Tensor bytes of the blocks read so far (leading run or not)."""
        blocks = [_value(f) for f in self._futures]
        return sum(b.nelement() * b.element_size() for b in blocks if b is not None)

    def _load_one(self, tier: KVTier, key: BlockHash) -> torch.Tensor | None:
        if self._cancelled.is_set():
            return None
        try:
            return tier.load([key])[0]
        except TierError:
            return None  # counted by the tier
        except Exception:
            tier.counters.error("unexpected")
            log.exception("%s tier: loading %s", tier.name, key.hex())
            return None

    def _one_done(self, i: int, fut: cf.Future) -> None:
        if _value(fut) is None:  # the run ends here: later blocks are of no use
            for later in self._futures[i + 1:]:
                later.cancel()
        with self._lock:
            self._pending -= 1
            if self._pending:
                return
            self.finished_at = time.perf_counter()
        self._touch_loaded()

    def _touch_loaded(self) -> None:
        run = len(self.result(timeout=0))
        for name, tier in self._tiers.items():
            keys = [k for k, s in zip(self.hit.keys[:run], self.hit.sources[:run]) if s == name]
            if keys:
                tier.touch(keys)


def _value(fut: cf.Future) -> torch.Tensor | None:
    if not fut.done() or fut.cancelled():
        return None
    return fut.result()
