"""The engine's side of the KV tiers: lookups and loads in the background, copies between the
device cache and the tiers between steps.

    admission (scheduler hook)   fetch thread                 step thread, between steps
    --------------------------   ------------                 --------------------------
    on_admit(req): keys past     manager.lookup(keys)         poll(): a finished fetch gets
      the device prefix ->       manager.start_load(hit)        fresh blocks, its KV written
      LOADING, fetch submitted   .result(deadline)              in, published; req waits again
                                                              demote_evicted(): cached blocks
                                                                the pool took -> cpu tier
                                                              store_full(): newly full blocks
                                                                -> one gather -> store queues

The step never waits on a tier: a lookup (S3 HEADs) and the payload reads run on the fetch
thread; a fetch that fails, is corrupt or runs past `load_timeout_s` gives a shorter run (maybe
none) and the rest of the prompt is recomputed. Loaded KV is the KV a cold run computes (the
key chains every token before it and the model fingerprint), so the tokens are the same."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from tierserve.engine.block_hash import BlockHash
from tierserve.engine.block_pool import BlockPool
from tierserve.engine.kv_tiers.manager import TierManager
from tierserve.engine.request import Request, RequestId
from tierserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class _Fetch:
    request: Request
    future: cf.Future
    """-> (tier name of each loaded block, the loaded blocks), the leading run only."""
    started: float


class TierIO:
    def __init__(self, manager: TierManager, runner, scheduler: Scheduler, pool: BlockPool,
                 load_timeout_s: float = 30.0):
        self.manager, self.runner, self.scheduler, self.pool = manager, runner, scheduler, pool
        self.block_size = pool.block_size
        self.load_timeout_s = load_timeout_s
        self._fetches: dict[RequestId, _Fetch] = {}
        self._thread = cf.ThreadPoolExecutor(2, thread_name_prefix="kv-fetch")
        self._demote = "cpu" in manager.tiers
        if self._demote:
            pool.evicted = []

    # ---- admission --------------------------------------------------------------------------

    def on_admit(self, req: Request) -> bool:
        """Scheduler hook: look the blocks past the device prefix up in the tiers. True sends the
        request to LOADING; the last prompt token is always computed, so its block is never
        asked for."""
        first = len(req.block_ids)
        keys = req.block_hashes[first:(req.num_tokens - 1) // self.block_size]
        if not keys:
            return False
        fut = self._thread.submit(self._fetch, list(keys))
        self._fetches[req.request_id] = _Fetch(req, fut, time.monotonic())
        return True

    def _fetch(self, keys: list[BlockHash]) -> tuple[list[str], list[torch.Tensor]]:
        hit = self.manager.lookup(keys)
        if not hit.num_blocks:
            return [], []
        handle = self.manager.start_load(hit)
        blocks = handle.result(timeout=self.load_timeout_s)
        if not handle.done():
            handle.cancel()
            log.warning("KV load of %d blocks ran past %.1f s; recomputing the rest",
                        hit.num_blocks, self.load_timeout_s)
        return list(hit.sources[:len(blocks)]), blocks

    # ---- between steps (the step thread) -------------------------------------------------------

    @property
    def loading(self) -> int:
        return len(self._fetches)

    def poll(self) -> None:
        """Bring finished fetches into the device cache; their requests wait to be admitted."""
        for rid, f in list(self._fetches.items()):
            if f.future.done():
                del self._fetches[rid]
                self._complete(f)

    def wait(self, timeout: float) -> None:
        """Nothing can run until a fetch finishes: sleep until one does (at most `timeout`)."""
        if self._fetches:
            cf.wait([f.future for f in self._fetches.values()], timeout,
                    return_when=cf.FIRST_COMPLETED)

    def cancel(self, rid: RequestId) -> None:
        """The request was aborted: its fetch result, when it comes, is dropped."""
        self._fetches.pop(rid, None)

    def _complete(self, f: _Fetch) -> None:
        req = f.request
        try:
            sources, blocks = f.future.result()
        except Exception:  # noqa: BLE001 - a failed fetch is a miss: recompute
            log.exception("KV fetch for request %s failed; recomputing", req.request_id)
            sources, blocks = [], []
        ids = self.pool.allocate(len(blocks)) if blocks else []
        if ids is None:  # no room for the hit now: recompute is the fallback
            sources, blocks, ids = [], [], []
        self.demote_evicted()  # before the writes below reuse evicted blocks
        if blocks:
            self.runner.write_blocks(ids, torch.stack(blocks))
        for name in sources:
            req.tier_hit_tokens[name] = req.tier_hit_tokens.get(name, 0) + self.block_size
        self.scheduler.complete_load(req, ids)

    def demote_evicted(self) -> None:
        """Cached blocks the device pool just took for new data go to the cpu tier (their KV is
        intact until the next step or block write), unless it already holds them."""
        if not self._demote or not self.pool.evicted:
            return
        evicted, self.pool.evicted = self.pool.evicted, []
        cpu = self.manager.tiers["cpu"]
        todo = [(h, bid) for h, bid in evicted if not cpu.contains_prefix([h])]
        if todo:
            self.manager.demote([h for h, _ in todo], self.runner.gather_blocks([b for _, b in todo]))

    def store_full(self) -> None:
        """Blocks that became full and computed in the last step: one gather, then the store
        queues of every tier (a full queue drops the write; the step never waits)."""
        full = self.scheduler.newly_full
        if not full:
            return
        self.scheduler.newly_full = []
        self.manager.store([h for h, _ in full], self.runner.gather_blocks([b for _, b in full]))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.manager.close()
