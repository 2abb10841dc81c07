"""The KV tiers under tensor parallel: each rank stores and loads its own shard of every block.

    main process (TPTierWorker: the worker side's face)        rank r of N (tp/rank.py)
    ---------------------------------------------------        -----------
    apply(plan)       -- kv_plan  -->  every rank           RankTiers: a TierManager over the
    finished()        -- kv_poll  -->  every rank, <-- done    rank's shard ([layers, 2, its KV
                      a run is done when every rank's is:      heads, block, dim]), fingerprint
                      its length the shortest of them          named by rank and world size, and
    copy_out(jobs)    -- kv_copy  -->  every rank               a KVConnectorWorker over it (the
    cancel(rid)       -- kv_cancel -> every rank               rank's own fetch thread, queues)

The scheduler side (the tier policy, the block hashes, which blocks move where) stays in the main
process, one for all ranks; the bytes never leave their rank. A tier's key space is the rank's
fingerprint (the model's, which names the world size, hashed with the rank): disk keeps a folder
per rank, s3 a prefix per rank, so no rank, and no other world size, reads another's shard. The cpu
and disk budgets are split evenly between the ranks (each holds 1/N of a block).

Messages are in the executor's pipe order, so a write or a copy-out is done before the next
step's message runs on that rank. Only kv_poll and kv_flush are answered. What the main process
reports comes from the ranks: rank 0's tier events (relayed into the main EventLog on each poll),
rank 0's counters with the bytes summed over ranks, and rank 0's measurements for the cost model
(reads scaled to whole blocks: the ranks read their shards side by side).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from tierserve.engine.core.kv_connector import BlockCopy, FetchedRun, KVStepPlan
from tierserve.engine.core.request import RequestId
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.events import EventLog, EventSlice
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.kv_tiers.stats import TierStats
from tierserve.engine.worker.tp.protocol import WorkerDied

POLL_INTERVAL_S = 0.25
"""With no fetch in flight, how often the step loop still asks the ranks for their events and
counters."""


class _RelayedEvents(EventLog):
    """The main EventLog: rank 0's events, pulled from the ranks when a reader asks (and on the
    step loop's polls)."""

    def __init__(self, capacity: int, token_ids: bool, refresh):
        super().__init__(capacity, token_ids)
        self._refresh = refresh

    @property
    def last_seq(self) -> int:
        self._refresh()  # readers poll this (an idle engine polls nothing itself)
        return self._last

    def since(self, seq: int) -> EventSlice:
        self._refresh()
        return super().since(seq)

    def wait(self, seq: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._refresh()
            if self.last_seq > seq:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            super().wait(seq, min(left, POLL_INTERVAL_S))


class TPTierManager:
    """What the engine and the server read of the tiers under tensor parallel (TierManager's
    reporting face): descriptors, layout (whole blocks, every rank's heads), events, stats, flush."""

    def __init__(self, owner: TPTierWorker, config: TierConfig, layout: BlockLayout,
                 descriptors):
        self.layout, self._descriptors = layout, descriptors
        self._owner = owner
        self.events = _RelayedEvents(config.event_log_size, config.event_token_ids,
                                     lambda: owner.refresh(block=False))
        self._stats: list[dict[str, TierStats]] = []

    def descriptors(self):
        return self._descriptors

    def stats(self) -> dict[str, TierStats]:
        """Rank 0's counters with every rank's bytes summed (as of the last poll)."""
        self._owner.refresh(block=False)
        if not self._stats:
            return {}
        out = {}
        for name, first in self._stats[0].items():
            per = [s[name] for s in self._stats]
            out[name] = dataclasses.replace(
                first, bytes_loaded=sum(s.bytes_loaded for s in per),
                bytes_stored=sum(s.bytes_stored for s in per),
                used_bytes=sum(s.used_bytes for s in per),
                capacity_bytes=(None if first.capacity_bytes is None
                                else sum(s.capacity_bytes or 0 for s in per)))
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Every rank's queued writes done (False if `timeout` ran out first)."""
        return self._owner.flush(timeout)

    def _update(self, stats: list[dict[str, TierStats]]) -> None:
        self._stats = stats


class TPTierWorker:
    """The KV connector's worker side when the ranks hold the cache (KVConnectorWorker's face)."""

    def __init__(self, executor, config: TierConfig, fingerprint: bytes):
        self.ex = executor
        self.size = executor.size
        self.cost = None
        """The scheduler side's CostModel (attach)."""
        infos = executor.request_all(("kv_tiers", (config, fingerprint)))
        facts = executor.facts()
        layout = BlockLayout(fingerprint, facts.block_shape, facts.kv_dtype)
        self.manager = TPTierManager(self, config, layout, infos[0]["descriptors"])
        self._in_flight: set[RequestId] = set()
        """Loads started whose fetch not every rank has finished."""
        self._unwritten: set[RequestId] = set()
        """Loads started and not written yet: a rank may hold their KV."""
        self._partial: dict[RequestId, list] = {}
        """Finished fetches per request, by rank, until every rank's is in."""
        self._done: list[FetchedRun] = []
        self._last_poll = 0.0

    # ---- KVConnectorWorker's face --------------------------------------------------------------

    def attach(self, cost) -> None:
        """The scheduler side's CostModel: the ranks' measurements go into it."""
        self.cost = cost

    # The bookkeeping below changes only while the channel is held: a reader's thread may poll
    # the ranks (refresh) between two steps.

    def apply(self, plan: KVStepPlan) -> None:
        """The step's plan to every rank in one message (each applies it to its own shard, in
        the plan's order; a rank times its own copy-ins, its measurements come back on a poll)."""
        if not plan.empty:
            with self.ex.exchange():
                self._in_flight.update(j.request_id for j in plan.loads)
                self._unwritten.update(j.request_id for j in plan.loads)
                self._unwritten.difference_update(p.request_id for p in plan.placements)
                self.ex.send_all(("kv_plan", plan))

    def finished(self) -> list[FetchedRun]:
        """Fetches every rank has finished; a run is as long as the shortest rank's."""
        with self.ex.exchange():
            if self._in_flight or time.monotonic() - self._last_poll > POLL_INTERVAL_S:
                self._poll()
            out, self._done = self._done, []
        return out

    def wait(self, timeout: float) -> None:
        if self._in_flight:
            time.sleep(timeout)

    def cancel(self, rid: RequestId) -> None:
        with self.ex.exchange():
            if rid in self._unwritten:  # a rank may hold its fetch, or its KV: dropped there
                self._in_flight.discard(rid)
                self._unwritten.discard(rid)
                self._partial.pop(rid, None)
                self.ex.send_all(("kv_cancel", rid))

    def copy_out(self, jobs: Sequence[BlockCopy]) -> None:
        jobs = [j for j in jobs if j.keys]
        if jobs:
            self.ex.send_all(("kv_copy", jobs))

    def close(self) -> None:
        pass  # each rank closes its tiers when it stops

    # ---- plumbing ------------------------------------------------------------------------------

    def refresh(self, block: bool = True) -> None:
        """Ask the ranks for their events and counters (from a reader's thread: at most every
        POLL_INTERVAL_S, and only if the step loop is not talking to them; it polls soon enough
        itself)."""
        if time.monotonic() - self._last_poll < POLL_INTERVAL_S:
            return
        with self.ex.exchange(block) as held:
            try:
                if held:
                    self._poll()
            except WorkerDied:  # the step loop meets it next and ends the engine; a reader
                pass            # (metrics, events) keeps what it had

    def flush(self, timeout: float) -> bool:
        with self.ex.exchange():
            answers = self.ex.request_all(("kv_flush", timeout))
            self._absorb([a[1:] for a in answers])
        return all(a[0] for a in answers)

    def _poll(self) -> None:
        """Every rank's finished fetches, measurements, events and counters (channel held)."""
        answers = self.ex.request_all(("kv_poll", None))
        self._last_poll = time.monotonic()
        self._absorb([a[1:] for a in answers])
        for rank, (done, *_) in enumerate(answers):
            for rid, sources, abandoned in done:
                if rid in self._in_flight:
                    self._partial.setdefault(rid, [None] * self.size)[rank] = (sources,
                                                                               abandoned)
        for rid, parts in list(self._partial.items()):
            if all(p is not None for p in parts):
                del self._partial[rid]
                self._in_flight.discard(rid)
                n = min(len(p[0]) for p in parts)
                self._done.append(FetchedRun(rid, tuple(parts[0][0][:n]),
                                             any(p[1] for p in parts)))

    def _absorb(self, reports: list) -> None:
        """Rank 0's measurements into the cost model (a read's bytes times the ranks, which read
        side by side), its events into the main log, every rank's counters."""
        measured, events, _ = reports[0]
        for name, args in measured:
            if name == "observe_load":
                args = (args[0], args[1] * self.size, args[2])
            if self.cost is not None:
                getattr(self.cost, name)(*args)
        if events:
            self.manager.events.record(*events)
        self.manager._update([r[2] for r in reports])
