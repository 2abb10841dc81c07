"""The worker side of the KV connector: moves blocks between the device cache and the tiers by
the plans of the scheduler side (engine/core/kv_connector.py), and reports what finished.

    finished()         fetches that are done, as FetchedRun (their KV stays here until written)
    apply(plan)        the step's KVStepPlan before its forward, in order: its copies (demotions)
                       out, its placements written (a fetched run's KV into its device blocks;
                       its promotions to the tiers), its loads started (each LoadJob on the fetch
                       thread: manager.lookup, then start_load and a wait bounded by the job's
                       deadline, arrival + TTFT budget, or load_timeout_s)
    copy_out(jobs)     device blocks gathered once, queued to the tiers (the stores after the
                       forward)

The step never waits on a tier: lookups (S3 HEADs) and payload reads run on the fetch thread; a
fetch that fails, is corrupt or runs late gives a shorter run (maybe none) and the rest of the
prompt is recomputed. Loaded KV is the KV a cold run computes (the key chains every token before
it and the model fingerprint), so the tokens are the same. Every lookup, read and copy feeds the
cost model the scheduler side decides with; a probe at start-up seeds it."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.core.kv_connector import (BlockCopy, FetchedRun, KVStepPlan, LoadJob,
                                                Placement)
from tierserve.engine.kv_tiers.manager import TierManager
from tierserve.engine.core.request import RequestId
from tierserve.engine.core.tier_policy import CostModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Fetched:
    sources: tuple[str, ...]
    blocks: list[torch.Tensor]
    abandoned: bool


class KVConnectorWorker:
    def __init__(self, manager: TierManager, runner, load_timeout_s: float = 30.0):
        self.manager, self.runner = manager, runner
        self.cost: CostModel | None = None
        """Where measurements go (attach): the scheduler side's CostModel, or a rank's
        Measurements under tensor parallel."""
        self.load_timeout_s = load_timeout_s
        self._thread = cf.ThreadPoolExecutor(4, thread_name_prefix="kv-fetch")
        self._futures: dict[RequestId, cf.Future] = {}
        self._fetched: dict[RequestId, _Fetched] = {}

    def attach(self, cost: CostModel) -> None:
        """The cost model to feed; its first measurements (a probe of each tier) start now."""
        self.cost = cost
        self._thread.submit(self._probe)

    def apply(self, plan: KVStepPlan) -> None:
        """The step's plan, before its forward (see KVStepPlan for the order)."""
        self.copy_out(plan.copies)
        self.write(plan.placements)
        self.start(plan.loads)

    # ---- loads ---------------------------------------------------------------------------------

    def start(self, loads: Sequence[LoadJob]) -> None:
        for job in loads:
            self._futures[job.request_id] = self._thread.submit(self._fetch, job)

    def finished(self) -> list[FetchedRun]:
        """The fetches that are done (a failed one is an empty run: recompute)."""
        out = []
        for rid, fut in list(self._futures.items()):
            if not fut.done():
                continue
            del self._futures[rid]
            try:
                got = fut.result()
            except Exception:  # noqa: BLE001 - a failed fetch is a miss: recompute
                log.exception("KV fetch for request %s failed; recomputing", rid)
                got = _Fetched((), [], False)
            self._fetched[rid] = got
            out.append(FetchedRun(rid, got.sources, got.abandoned))
        return out

    def wait(self, timeout: float) -> None:
        """Nothing can run until a fetch finishes: sleep until one does (at most `timeout`)."""
        if self._futures:
            cf.wait(list(self._futures.values()), timeout, return_when=cf.FIRST_COMPLETED)

    def cancel(self, rid: RequestId) -> None:
        """The request was aborted: its fetch result, when it comes, is dropped."""
        self._futures.pop(rid, None)
        self._fetched.pop(rid, None)

    def write(self, placements: Sequence[Placement]) -> None:
        """Each fetched run's KV into its device blocks, then its promotions to the tiers."""
        for p in placements:
            got = self._fetched.pop(p.request_id, None)
            if got is None or not p.block_ids:
                continue
            blocks = got.blocks[:len(p.block_ids)]
            t0 = time.monotonic()
            self.runner.write_blocks(list(p.block_ids), torch.stack(blocks))
            self.cost.observe_copy_in(len(blocks), time.monotonic() - t0)
            for job in p.promote:
                self.manager.store(job.keys, torch.stack([blocks[i] for i in job.blocks]),
                                   job.tiers, meta=job.meta)

    def _fetch(self, job: LoadJob) -> _Fetched:
        d = job.decision
        hit = self.manager.lookup(job.keys, d.load_tiers, d.max_load_blocks)
        for name, seconds in hit.lookup_seconds.items():
            self.cost.observe_lookup(name, seconds)
        if not hit.num_blocks:
            return _Fetched((), [], False)
        handle = self.manager.start_load(hit)
        limit = self.load_timeout_s
        if d.deadline is not None:
            limit = min(limit, max(0.0, d.deadline - time.monotonic()))
        blocks = handle.result(timeout=limit)
        abandoned = not handle.done()
        if abandoned:
            handle.cancel()
            log.info("KV load of %d blocks ran past its deadline (%.2f s); recomputing the rest",
                     hit.num_blocks, limit)
        sources = tuple(hit.sources[:len(blocks)])
        self._observe_load(sources, handle.seconds or limit)
        return _Fetched(sources, blocks, abandoned)

    def _observe_load(self, sources: Sequence[str], seconds: float) -> None:
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
                for key in tier.keys()[-3:]:
                    t0 = time.monotonic()
                    tier._read(key)  # no touch, no counters: a probe, not a load
                    reads.append(time.monotonic() - t0)
                if reads:
                    self.cost.observe_load(name, self.manager.layout.block_bytes, min(reads))
            except Exception:  # noqa: BLE001 - unmeasured: the first real load measures it
                log.info("probing the %s tier failed; its first load measures it", name)

    # ---- stores --------------------------------------------------------------------------------

    def copy_out(self, jobs: Sequence[BlockCopy]) -> None:
        """Device blocks to the tiers: one gather for all jobs, then each job's store queues (a
        full queue drops the write; the step never waits)."""
        jobs = [self._unheld(j) if j.unless_held else j for j in jobs]
        jobs = [j for j in jobs if j.keys]
        if not jobs:
            return
        data = self.runner.gather_blocks([b for j in jobs for b in j.blocks])
        start = 0
        for j in jobs:
            self.manager.store(j.keys, data[start:start + len(j.keys)], j.tiers, meta=j.meta)
            start += len(j.keys)

    def _unheld(self, job: BlockCopy) -> BlockCopy:
        """The job without the blocks its tiers already hold."""
        tiers = [self.manager.tiers[t] for t in job.tiers]
        keep = [i for i, k in enumerate(job.keys)
                if not all(t.contains_prefix([k]) for t in tiers)]
        return BlockCopy(tuple(job.keys[i] for i in keep), tuple(job.blocks[i] for i in keep),
                         job.tiers, tuple(job.meta[i] for i in keep))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.manager.close()


class NoKVWorker:
    """The worker side without tiers: nothing to fetch, write or copy."""

    manager = None

    def apply(self, plan: KVStepPlan) -> None:
        pass

    def attach(self, cost) -> None:
        pass

    def finished(self) -> list[FetchedRun]:
        return []

    def wait(self, timeout: float) -> None:
        pass

    def cancel(self, rid: RequestId) -> None:
        pass

    def copy_out(self, jobs: Sequence[BlockCopy]) -> None:
        pass

    def close(self) -> None:
        pass
