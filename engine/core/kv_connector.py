"""The scheduler side of the KV connector: which tiers each request may use, and the plan of
which blocks move where. Plain Python, no torch (as vLLM v1's scheduler-side connector); the
worker side (engine/worker/kv_worker.py) moves the bytes.

    the step (engine/kv_connector.py)      this side                       the worker side
    ---------------------------------      ---------                       ---------------
    before scheduling                <-    place(fetched): allocate   <-   finished(): FetchedRun
      complete_load                        device blocks, plan the
                                           promotions
    scheduler admits a request       ->    on_admit: decide, LoadJob
    before the forward               ->    plan_step: one KVStepPlan  ->   apply(plan), in order:
                                           (the blocks the pool took        copy the demoted
                                           back, the placements, the        blocks out, write the
                                           loads)                           fetched runs in (and
                                                                            promote), start the
                                                                            fetches
    newly full blocks (update)       ->    stores(full)               ->   copy_out(jobs): gather,
                                                                           queue to the tiers

The table of per-request tier state (decision, hit tokens, blocks stored, asked already) is this
side's own, keyed by request id: the Request type carries no tier fields. Decisions come from the
TierPolicy and the CostModel (engine/core/tier_policy.py), which the worker side feeds with measured
lookups, reads and copies; this side feeds it the prefill steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tierserve.engine.core.block_hash import BlockHash, BlockMeta
from tierserve.engine.core.block_pool import BlockPool, EvictedBlock
from tierserve.engine.core.tier_descriptor import TierDescriptor
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import FullBlock
from tierserve.engine.core.tier_policy import CostModel, SkipReason, TierDecision, TierPolicy


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


_SKIP_COUNTERS = {SkipReason.BUDGET: "skipped_budget", SkipReason.COST: "skipped_cost",
                  SkipReason.SHORT_PROMPT: "skipped_short"}


@dataclass(frozen=True)
class LoadJob:
    """Blocks past a request's device prefix to look up and read, within its decision."""

    request_id: RequestId
    keys: tuple[BlockHash, ...]
    decision: TierDecision


@dataclass(frozen=True)
class FetchedRun:
    """What a finished fetch found: the leading blocks read, by source tier (the worker keeps
    their KV until write())."""

    request_id: RequestId
    sources: tuple[str, ...]
    """The tier each read block came from, in order."""
    abandoned: bool = False
    """The load ran past its deadline: what arrived before it is kept."""


@dataclass(frozen=True)
class BlockCopy:
    """Blocks to copy out to tiers: device blocks (stores, demotions) or, for a promotion,
    rows of a request's fetched blocks."""

    keys: tuple[BlockHash, ...]
    blocks: tuple[int, ...]
    """Device block ids, or rows of the fetched run (Placement.promote)."""
    tiers: tuple[str, ...]
    meta: tuple[BlockMeta, ...]
    """(parent hash, token ids) per block, for the KV events."""
    unless_held: bool = False
    """Skip blocks the tiers already hold (a demotion of a block stored before)."""


@dataclass(frozen=True)
class Placement:
    """Where a fetched run goes in the device cache, and what of it is promoted."""

    request_id: RequestId
    block_ids: tuple[int, ...]
    """Device blocks for the first len(block_ids) fetched blocks (empty: no room, recompute)."""
    promote: tuple[BlockCopy, ...] = ()


@dataclass
class _TierState:
    """One request's tier state."""

    request: Request
    decision: TierDecision | None = None
    asked: bool = False
    """The tiers were asked for this admission (a preemption asks again)."""
    hit_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens loaded from each tier at the first admission."""
    stored_blocks: int = 0
    """Blocks handed to the tier store (for max_offload_tokens)."""


@dataclass(frozen=True)
class KVStepPlan:
    """What the worker side does before a step's forward, in this order: copy out the cached
    blocks the pool took back (their KV is intact until the forward writes), write the fetched
    runs into their device blocks (and queue their promotions), start the new fetches."""

    copies: tuple[BlockCopy, ...] = ()
    placements: tuple[Placement, ...] = ()
    loads: tuple[LoadJob, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.copies or self.placements or self.loads)


class KVConnectorScheduler:
    def __init__(self, tiers: Sequence[TierDescriptor], block_size: int, block_bytes: int,
                 pool: BlockPool):
        self.tiers = tuple(t.name for t in tiers)
        self.block_size, self.pool = block_size, pool
        self.cost = CostModel(block_bytes, block_size)
        self.policy = TierPolicy(tiers, self.cost, block_size)
        self.counters = PolicyCounters()
        self._state: dict[RequestId, _TierState] = {}
        self._loads: list[LoadJob] = []
        self._no_demote: set[BlockHash] = set()
        """Device blocks whose request did not allow the cpu tier: never demoted there."""

    # ---- admission (the scheduler's hook) -----------------------------------------------------

    def on_admit(self, req: Request) -> bool:
        """Decide the request's tiers once per admission and plan a load of the blocks past its
        device prefix. True sends it to LOADING; the last prompt token is always computed, so
        its block is never asked for."""
        st = self._state.setdefault(req.request_id, _TierState(req))
        if st.asked:
            return False
        st.asked = True
        first = len(req.block_ids)
        keys = tuple(req.block_hashes[first:(req.num_tokens - 1) // self.block_size])
        st.decision = d = self.policy.decide(req.hints, len(keys), req.arrival_time)
        self.counters.loads_chosen += bool(d.load_tiers)
        for why in d.skipped.values():
            if why in _SKIP_COUNTERS:
                name = _SKIP_COUNTERS[why]
                setattr(self.counters, name, getattr(self.counters, name) + 1)
        if not keys or not d.load_tiers:
            return False
        self._loads.append(LoadJob(req.request_id, keys, d))
        return True

    def take_loads(self) -> list[LoadJob]:
        loads, self._loads = self._loads, []
        return loads

    def plan_step(self, placements: Sequence[Placement],
                  preempted: Sequence[RequestId]) -> KVStepPlan:
        """The step's plan once the scheduler has run: the demotions of every block the pool
        took back since the last plan (placing fetched runs and scheduling both allocate), the
        placements made before scheduling, the loads its admissions planned. Requests preempted
        by it ask the tiers again when readmitted."""
        self.preempted(preempted)
        return KVStepPlan(tuple(self.demotions(self.pool.take_evicted())), tuple(placements),
                          tuple(self.take_loads()))

    def preempted(self, ids: Sequence[RequestId]) -> None:
        """Preempted requests ask the tiers again when readmitted (their blocks may be there)."""
        for rid in ids:
            if rid in self._state:
                self._state[rid].asked = False

    def finished(self, ids: Sequence[RequestId]) -> None:
        for rid in ids:
            self._state.pop(rid, None)
        self._loads = [j for j in self._loads if j.request_id not in ids]

    # ---- loads in ------------------------------------------------------------------------------

    def place(self, fetched: Sequence[FetchedRun]) -> list[Placement]:
        """Device blocks for each finished fetch (none if the pool has no room: recompute), the
        hit tokens counted at the first admission, and the promotions to plan."""
        out = []
        for run in fetched:
            st = self._state.get(run.request_id)
            if st is None:  # aborted meanwhile
                continue
            self.counters.abandoned += run.abandoned
            ids = self.pool.allocate(len(run.sources)) if run.sources else []
            sources = run.sources if ids else ()
            if st.request.num_preemptions == 0:  # usage counts the first admission's hits
                for name in sources:
                    st.hit_tokens[name] = st.hit_tokens.get(name, 0) + self.block_size
            out.append(Placement(st.request.request_id, tuple(ids or ()),
                                 self._promotions(st, sources)))
        return out

    def _promotions(self, st: _TierState, sources: Sequence[str]) -> tuple[BlockCopy, ...]:
        """Loaded blocks go to the faster tiers below the device the request may store to
        (s3 -> disk), so the next load of the prefix is local. The cpu tier is left out: it gets
        them when the device evicts them. Counts against max_offload_tokens like any store."""
        d, req = st.decision, st.request
        allowed = set(d.store_tiers if d is not None else self.tiers) - {"cpu"}
        first = len(req.block_ids)  # the device prefix the loaded run follows
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, src in enumerate(sources):
            faster = tuple(t for t in self.tiers[:self.tiers.index(src)] if t in allowed)
            if faster and self._may_store(st):
                groups.setdefault(faster, []).append(i)
        self.counters.promoted += sum(len(rows) for rows in groups.values())
        return tuple(BlockCopy(tuple(req.block_hashes[first + i] for i in rows), tuple(rows),
                               tiers, tuple(self._meta(req, first + i) for i in rows))
                     for tiers, rows in groups.items())

    def _meta(self, req: Request, i: int) -> BlockMeta:
        bs = self.block_size
        return (req.block_hashes[i - 1] if i else None,
                tuple(req.token_slice(i * bs, (i + 1) * bs)))

    # ---- blocks out ----------------------------------------------------------------------------

    def demotions(self, evicted: Sequence[EvictedBlock]) -> list[BlockCopy]:
        """Cached blocks the device pool took for new data go to the cpu tier (their KV is
        intact until the next step or block write), unless their request kept them out of it.
        The pool does not keep a block's parent: announced with none."""
        todo = [e for e in evicted if e.hash not in self._no_demote]
        self._no_demote.difference_update(e.hash for e in evicted)
        if not todo or "cpu" not in self.tiers:
            return []
        return [BlockCopy(tuple(e.hash for e in todo), tuple(e.block_id for e in todo),
                          ("cpu",), tuple((None, e.token_ids) for e in todo), unless_held=True)]

    def stores(self, full: Sequence[FullBlock]) -> list[BlockCopy]:
        """Blocks that became full and computed in the last step, grouped by the tiers each
        block's request allows within its max_offload_tokens."""
        groups: dict[tuple[str, ...], list[FullBlock]] = {}
        for f in full:
            tiers = self._store_tiers(f.request)
            if "cpu" not in tiers:
                self._no_demote.add(f.hash)
            if tiers:
                groups.setdefault(tiers, []).append(f)
        return [BlockCopy(tuple(f.hash for f in fs), tuple(f.block_id for f in fs), tiers,
                          tuple((f.parent_hash, f.token_ids) for f in fs))
                for tiers, fs in groups.items()]

    def _store_tiers(self, req: Request) -> tuple[str, ...]:
        st = self._state.get(req.request_id)
        if st is None or st.decision is None:
            return self.tiers
        return st.decision.store_tiers if self._may_store(st) else ()

    def _may_store(self, st: _TierState) -> bool:
        """One more block of this request may be stored (max_offload_tokens); counts it."""
        limit = st.decision.max_store_blocks if st.decision is not None else None
        if limit is not None and st.stored_blocks >= limit:
            return False
        st.stored_blocks += 1
        return True

    # ---- facts -------------------------------------------------------------------------------

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step's throughput; steps with a prefill's worth of tokens feed the cost model."""
        if tokens >= 64:
            self.cost.observe_prefill(tokens, seconds)

    def facts(self, req: Request) -> tuple[TierDecision | None, dict[str, int] | None]:
        """The request's latest decision and its prompt tokens served per cache (device first)."""
        st = self._state.get(req.request_id)
        if st is None or st.decision is None:
            return None, None
        hits = {"device": req.num_cached_tokens - sum(st.hit_tokens.values())}
        hits.update({name: st.hit_tokens.get(name, 0) for name in self.tiers})
        return st.decision, hits


class NoKVConnector:
    """The scheduler side without tiers: nothing is looked up, stored or moved."""

    tiers: tuple[str, ...] = ()
    counters = None

    def on_admit(self, req: Request) -> bool:
        return False

    def take_loads(self) -> list[LoadJob]:
        return []

    def plan_step(self, placements: Sequence[Placement],
                  preempted: Sequence[RequestId]) -> KVStepPlan:
        return KVStepPlan()

    def preempted(self, ids: Sequence[RequestId]) -> None:
        pass

    def finished(self, ids: Sequence[RequestId]) -> None:
        pass

    def place(self, fetched: Sequence[FetchedRun]) -> list[Placement]:
        return []

    def demotions(self, evicted: Sequence[EvictedBlock]) -> list[BlockCopy]:
        return []

    def stores(self, full: Sequence[FullBlock]) -> list[BlockCopy]:
        return []

    def observe_step(self, tokens: int, seconds: float) -> None:
        pass

    def facts(self, req: Request) -> tuple[None, None]:
        return None, None
