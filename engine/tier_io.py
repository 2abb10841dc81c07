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

Each admission asks the TierPolicy (engine/tier_policy.py) which tiers the request may load
from and store to, from its KVHints and the cost model this class feeds: lookup latency and
load bandwidth per tier from real loads (seeded by a probe at start-up), prefill throughput from
real steps. A load past the request's deadline (arrival + TTFT budget) is abandoned.

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
from tierserve.engine.scheduler import FullBlock, Scheduler
from tierserve.engine.tier_policy import CostModel, SkipReason, TierDecision, TierPolicy

log = logging.getLogger(__name__)


@dataclass
class _Fetch:
    request: Request
    future: cf.Future
    """-> (tier name of each loaded block, the loaded blocks), the leading run only."""
    started: float


@dataclass
class PolicyCounters:
    """Per-request decisions of the tier policy (plain ints, exported as metrics)."""

    loads_chosen: int = 0
    """Admissions that planned a load from at least one tier."""
    skipped_budget: int = 0
    """Tiers not looked up: the load would not fit the TTFT budget."""
    skipped_cost: int = 0
    """Tiers not looked up: recomputing is faster than loading."""
    skipped_short: int = 0
    """Remote tiers not looked up for a short prompt."""
    abandoned: int = 0
    """Loads that ran past their deadline; the rest of the prompt was recomputed."""
    promoted: int = 0
    """Blocks loaded from a tier and written to a faster one the request may store to."""


class TierIO:
    def __init__(self, manager: TierManager, runner, scheduler: Scheduler, pool: BlockPool,
                 load_timeout_s: float = 30.0):
        self.manager, self.runner, self.scheduler, self.pool = manager, runner, scheduler, pool
        self.block_size = pool.block_size
        self.load_timeout_s = load_timeout_s
        self._fetches: dict[RequestId, _Fetch] = {}
        self._thread = cf.ThreadPoolExecutor(4, thread_name_prefix="kv-fetch")
        self._demote = "cpu" in manager.tiers
        if self._demote:
            pool.evicted = []
        self._no_demote: set[BlockHash] = set()
        """Device blocks whose request did not allow the cpu tier: never demoted there."""
        self.cost = CostModel(manager.layout.block_bytes, self.block_size)
        self.policy = TierPolicy(manager.descriptors(), self.cost, self.block_size)
        self.counters = PolicyCounters()
        self._thread.submit(self._probe)

    # ---- admission --------------------------------------------------------------------------

    def on_admit(self, req: Request) -> bool:
        """Scheduler hook: decide the request's tiers, then look the blocks past the device
        prefix up in the tiers it may load from. True sends the request to LOADING; the last
        prompt token is always computed, so its block is never asked for."""
        first = len(req.block_ids)
        keys = req.block_hashes[first:(req.num_tokens - 1) // self.block_size]
        d = self.policy.decide(req.hints, len(keys), req.arrival_time)
        req.tier_decision = d
        self._count(d)
        if not keys or not d.load_tiers:
            return False
        fut = self._thread.submit(self._fetch, list(keys), d)
        self._fetches[req.request_id] = _Fetch(req, fut, time.monotonic())
        return True

    def _count(self, d: TierDecision) -> None:
        c = self.counters
        c.loads_chosen += bool(d.load_tiers)
        for why in d.skipped.values():
            if why is SkipReason.BUDGET:
                c.skipped_budget += 1
            elif why is SkipReason.COST:
                c.skipped_cost += 1
            elif why is SkipReason.SHORT_PROMPT:
                c.skipped_short += 1

    def _fetch(self, keys: list[BlockHash], d: TierDecision) -> tuple[list[str], list[torch.Tensor]]:
        hit = self.manager.lookup(keys, d.load_tiers, d.max_load_blocks)
        for name, seconds in hit.lookup_seconds.items():
            self.cost.observe_lookup(name, seconds)
        if not hit.num_blocks:
            return [], []
        handle = self.manager.start_load(hit)
        limit = self.load_timeout_s
        if d.deadline is not None:
            limit = min(limit, max(0.0, d.deadline - time.monotonic()))
        blocks = handle.result(timeout=limit)
        if not handle.done():
            handle.cancel()
            self.counters.abandoned += 1
            log.info("KV load of %d blocks ran past its deadline (%.2f s); recomputing the rest",
                     hit.num_blocks, limit)
        self._observe_load(hit.sources[:len(blocks)], handle.seconds or limit)
        return list(hit.sources[:len(blocks)]), blocks

    def _observe_load(self, sources, seconds: float) -> None:
        """Read rate per source tier, lookup excluded (a load from several tiers charges each
        the whole time)."""
        for name in set(sources):
            n = sum(s == name for s in sources)
            self.cost.observe_load(name, n * self.manager.layout.block_bytes, seconds)

    def _probe(self) -> None:
        """Seed the cost model: a lookup of a key no tier holds (the round trip), and the
        fastest of up to three reads of blocks a tier already holds (a disk restored from a last
        run, say; the start-up's own work slows any one read). Writes nothing."""
        absent = BlockHash(b"\xff" * 16)
        for name, tier in self.manager.tiers.items():
            try:
                t0 = time.monotonic()
                tier.contains_prefix([absent])
                self.cost.observe_lookup(name, time.monotonic() - t0)
                reads = []
                for key in tier.keys()[-3:]:  # the fastest of a few reads: start-up is busy
                    t0 = time.monotonic()
                    tier._read(key)  # no touch, no counters: a probe, not a load
                    reads.append(time.monotonic() - t0)
                if reads:
                    self.cost.observe_load(name, self.manager.layout.block_bytes, min(reads))
            except Exception:  # noqa: BLE001 - unmeasured: the first real load measures it
                log.info("probing the %s tier failed; its first load measures it", name)

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
            t0 = time.monotonic()
            self.runner.write_blocks(ids, torch.stack(blocks))
            self.cost.observe_copy_in(len(blocks), time.monotonic() - t0)
        if req.num_preemptions == 0:  # usage counts the first admission's hits only
            for name in sources:
                req.tier_hit_tokens[name] = req.tier_hit_tokens.get(name, 0) + self.block_size
        if blocks:
            self._promote(req, sources, blocks)
        self.scheduler.complete_load(req, ids)

    def _promote(self, req: Request, sources: list[str], blocks: list[torch.Tensor]) -> None:
        """Write blocks loaded from a slower tier to the faster tiers below the device that the
        request may store to (s3 -> disk), so the next load of the prefix is local. The cpu
        tier is left out: it gets the blocks when the device cache evicts them (demote_evicted).
        Called before complete_load, while req.block_ids is still the device prefix the loaded
        run follows; counts against the request's max_offload_tokens like any store."""
        d = req.tier_decision
        order = list(self.manager.tiers)
        allowed = set(d.store_tiers if d is not None else order) - {"cpu"}
        first = len(req.block_ids)
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, src in enumerate(sources):
            faster = tuple(t for t in order[:order.index(src)] if t in allowed)
            if not faster:
                continue
            if d is not None and d.max_store_blocks is not None:
                if req.num_stored_blocks >= d.max_store_blocks:
                    break
                req.num_stored_blocks += 1
            groups.setdefault(faster, []).append(i)
        bs = self.block_size
        for tiers, rows in groups.items():
            keys = [req.block_hashes[first + i] for i in rows]
            meta = [(req.block_hashes[first + i - 1] if first + i else None,
                     tuple(req.token_slice((first + i) * bs, (first + i + 1) * bs))) for i in rows]
            if self.manager.store(keys, torch.stack([blocks[i] for i in rows]), tiers, meta=meta):
                self.counters.promoted += len(rows)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step's throughput; steps with a prefill's worth of tokens feed the cost model."""
        if tokens >= 64:
            self.cost.observe_prefill(tokens, seconds)

    def demote_evicted(self) -> None:
        """Cached blocks the device pool just took for new data go to the cpu tier (their KV is
        intact until the next step or block write), unless it already holds them."""
        if not self._demote or not self.pool.evicted:
            return
        evicted, self.pool.evicted = self.pool.evicted, []
        cpu = self.manager.tiers["cpu"]
        todo = [e for e in evicted if e.hash not in self._no_demote
                and not cpu.contains_prefix([e.hash])]
        self._no_demote.difference_update(e.hash for e in evicted)
        if todo:  # the pool does not keep a block's parent: announced with none
            self.manager.demote([e.hash for e in todo],
                                self.runner.gather_blocks([e.block_id for e in todo]),
                                meta=[(None, e.token_ids) for e in todo])

    def store_full(self) -> None:
        """Blocks that became full and computed in the last step: one gather, then the store
        queues of the tiers each block's request allows (a full queue drops the write; the
        step never waits)."""
        full = self.scheduler.newly_full
        if not full:
            return
        self.scheduler.newly_full = []
        groups: dict[tuple[str, ...], list[FullBlock]] = {}
        for f in full:
            tiers = self._store_tiers(f.request)
            if "cpu" not in tiers:
                self._no_demote.add(f.hash)
            if tiers:
                groups.setdefault(tiers, []).append(f)
        kept = [f for fs in groups.values() for f in fs]
        if not kept:
            return
        data = self.runner.gather_blocks([f.block_id for f in kept])
        start = 0
        for tiers, fs in groups.items():
            self.manager.store([f.hash for f in fs], data[start:start + len(fs)], tiers,
                               meta=[(f.parent_hash, f.token_ids) for f in fs])
            start += len(fs)

    def _store_tiers(self, req: Request) -> tuple[str, ...]:
        """The tiers this block of `req` goes to, within its max_offload_tokens."""
        d = req.tier_decision
        if d is None:
            return tuple(self.manager.tiers)
        if d.max_store_blocks is not None:
            if req.num_stored_blocks >= d.max_store_blocks:
                return ()
            req.num_stored_blocks += 1
        return d.store_tiers

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.manager.close()
