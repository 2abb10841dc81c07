"""StoreQueue: one tier's bounded write queue and the writer threads that drain it.

The caller (the step loop) only ever does put_nowait: a full queue drops the job and counts it
in the tier's dropped_writes, so a slow disk or a dead bucket never stalls a step. The writer
threads own the tier's store() calls; a job's blocks are a private host copy made by the manager.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Sequence

import torch

from tierserve.engine.core.block_hash import BlockHash, BlockMeta
from tierserve.engine.kv_tiers.base import KVTier

log = logging.getLogger(__name__)

Job = tuple[Sequence[BlockHash], torch.Tensor, Sequence[BlockMeta] | None]


class StoreQueue:
    def __init__(self, tier: KVTier, depth: int, workers: int):
        self.tier = tier
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._threads = [threading.Thread(target=self._run, daemon=True,
                                          name=f"kv-store-{tier.name}-{i}")
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def has_room(self) -> bool:
        return not self._q.full()

    def pending(self) -> int:
        """Jobs waiting in the queue (not counting the ones being written)."""
        return self._q.qsize()

    def submit(self, keys: Sequence[BlockHash], blocks: torch.Tensor,
               meta: Sequence[BlockMeta] | None = None) -> bool:
        """Queue a write of blocks [n, *block_shape] (meta: see KVTier.store); False (and
        counted) if the queue is full."""
        try:
            self._q.put_nowait((keys, blocks, meta))
            return True
        except queue.Full:
            self.tier.counters.add(dropped_writes=1)
            return False

    def drop(self) -> None:
        """Count a write that was refused before it reached the queue."""
        self.tier.counters.add(dropped_writes=1)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued job is written; False if `timeout` ran out first."""
        deadline = time.monotonic() + timeout
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._q.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Stop the writers after the queued jobs (waits at most about `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        for _ in self._threads:
            try:
                self._q.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                break  # still busy: the daemon threads die with the process
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                keys, blocks, meta = job
                self.tier.store(keys, list(blocks), meta)  # announces what it wrote
            except Exception:
                self.tier.counters.error("unexpected")
                log.exception("%s tier: store failed", self.tier.name)
            finally:
                self._q.task_done()
