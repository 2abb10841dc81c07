"""Token-budget continuous batching over the block pool. Plain Python, no torch.

Every step each running request's computed-token count catches up with its token count, within
`max_num_batched_tokens`: a decode is a request one token behind, a prefill chunk is a request
many tokens behind, and both share the step. Requests that run out of blocks preempt the
lowest-ranked running request (its blocks are freed and it is recomputed later, mostly from the
prefix cache or a KV tier).

KV tiers plug in as one hook, `on_admit(request) -> bool` (the KV connector's scheduler side),
asked at each admission attempt after the device prefix match: True means it sent the request
to LOADING (its blocks are read in the background). LOADING requests stay in the waiting queue
but are passed over; `complete_load` brings one back with its loaded blocks published, and it is
admitted like any other. `update` returns the blocks that became full, for the tier store.
A second hook, `ready(request)`, holds a request in the queue the same way while its structured-
output grammar compiles.

Tenants (API keys) share the engine through a small policy object (engine/core/fair_share.py):
it orders the waiting requests for seats, gives each tenant a quota of the step's budget and
picks whom to preempt; a newcomer's step may be shorter than the budget. FirstCome (fair_share
off, or one tenant) is the order above. Tokens a tenant's quota leaves unspent (a prefix hit, a
load) go to the requests quotas held back.

Speculative decoding: a decode whose request holds proposals (`spec_token_ids`, set by the
speculator before `schedule`) computes 1 + k positions (its last token, then the proposals; the
budget may trim them) and its blocks cover them. The update counts computed only the last token
and the accepted proposals, so a rejected position is never hashed or published; blocks wholly past
the kept tokens go back to the pool, and the partly used last block is overwritten by later steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from tierserve.engine.core.block_hash import BlockHash, extend_hashes
from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.config import SchedulerConfig, SchedulingPolicy
from tierserve.engine.core.fair_share import FairShare, FirstCome, Shares
from tierserve.engine.core.kv_hints import SloClass
from tierserve.engine.core.request import Request, RequestId, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int
    """Position of the first token computed this step (the request's computed count before)."""
    num_new_tokens: int
    """Tokens computed this step, at positions start .. start + num_new_tokens - 1."""
    block_ids: tuple[int, ...]
    """Block table covering every position up to start + num_new_tokens."""
    samples: bool
    """The step reaches the request's last token, so a next token is sampled."""
    spec_token_ids: tuple[int, ...] = ()
    """Proposed tokens verified this step, at the positions after the request's last token
    (included in num_new_tokens): the target samples at each of the 1 + k positions."""

    @property
    def num_request_tokens(self) -> int:
        """Tokens of the request itself computed this step (the proposals are not yet)."""
        return self.num_new_tokens - len(self.spec_token_ids)


@dataclass(frozen=True)
class FullBlock:
    """A block that became full and computed in the last update, for the tier store."""

    hash: BlockHash
    """Its chained hash: the key in the prefix index and in every tier."""
    block_id: int
    """Its device block, whose KV the store gathers."""
    parent_hash: BlockHash | None
    """Hash of the block before it in the request; None for the request's first block."""
    token_ids: tuple[int, ...]
    """The block's tokens (block_size of them)."""
    request: Request
    """The request that filled it (per-request store filters read it)."""


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs. Decodes come first, in running order, then verified decodes
    (speculative), then prefill chunks."""

    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted: tuple[RequestId, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.scheduled


_CLASS_RANK = {SloClass.INTERACTIVE: 0, None: 1, SloClass.BATCH: 2}


def _class_rank(req: Request) -> int:
    """interactive requests are admitted before class-less ones, and those before batch."""
    return _CLASS_RANK[req.hints.slo_class]


def _fcfs_rank(req: Request) -> tuple:
    return _class_rank(req), req.arrival_time


def _priority_rank(req: Request) -> tuple:
    return req.priority, _class_rank(req), req.arrival_time  # priority wins over the SLO class


def _phase(s: ScheduledRequest) -> int:
    """Step order: decodes, verified decodes (their rows are decode rows too), prefills."""
    if s.num_new_tokens == 1:
        return 0
    return 1 if s.spec_token_ids and s.num_request_tokens == 1 else 2


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool,
                 hash_extra: Callable[[Request], bytes],
                 on_admit: Callable[[Request], bool] = lambda req: False,
                 ready: Callable[[Request], bool] = lambda req: True):
        self.config = config
        self.pool = pool
        self.hash_extra = hash_extra
        """Extra bytes mixed into a request's block hashes (model fingerprint + cache salt)."""
        self.on_admit = on_admit
        """The KV tier lookup (see the module docstring)."""
        self.ready = ready
        """False while a request may not start yet (its structured-output grammar compiles):
        it keeps its place in the queue and others are admitted past it."""
        rank = _priority_rank if config.policy is SchedulingPolicy.PRIORITY else _fcfs_rank
        self.share = FairShare(rank) if config.fair_share else FirstCome(rank)
        """Seats, token quotas and preemption across tenants (see the module docstring)."""
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0

    # ---- queue management ------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        extend_hashes(req.block_hashes, req.prompt_token_ids, self.pool.block_size,
                      self.hash_extra(req))
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, ids: Iterable[RequestId], status: RequestStatus) -> list[Request]:
        """Finish (or abort) requests in any state; their blocks return to the pool."""
        done = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._release(req)
            req.status = status
            done.append(req)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted: list[RequestId] = []
        if self.config.policy is SchedulingPolicy.PRIORITY:
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        seats = self.config.max_num_seqs - len(self.running)
        offered = self.share.admission_order(self._ready_waiting(), self.running) \
            if seats > 0 else []
        running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        shares = self.share.quotas(self.config.max_num_batched_tokens, running, offered[:seats],
                                   self._want)
        budget = shares.budget
        for req in running:
            allowed = shares.allowed(req, budget)
            if req.status is not RequestStatus.RUNNING or allowed == 0:
                continue
            n = self._chunk(req, allowed)
            while not self._grow(req, req.num_computed_tokens + n):
                if req.spec_token_ids:  # proposals are given up before anyone is preempted
                    req.spec_token_ids = []
                    n = self._chunk(req, allowed)
                    continue
                victim = self._victim(scheduled)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._entry(req, n))
                shares.take(req, n)
                budget -= n
        if not preempted:
            held: list[Request] = []
            budget = self._admit(budget, scheduled, offered, shares, held)
            # what a quota left unspent (a prefix hit, a load) goes to those quotas held back
            budget = self._admit(budget, scheduled, held, Shares(budget, {}, budget), [])
        scheduled.sort(key=_phase)
        return SchedulerOutput(tuple(scheduled), shares.budget - budget, tuple(preempted))

    def _admit(self, budget: int, scheduled: list[ScheduledRequest], offered: list[Request],
               shares: Shares, held: list[Request]) -> int:
        """Seat the offered requests in order while budget and seats last; those whose tenant's
        quota is spent go to `held`."""
        for req in offered:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            allowed = shares.allowed(req, budget)
            if allowed == 0:
                held.append(req)
                continue
            if not req.block_ids:
                self._match_prefix(req)
            if self.on_admit(req):
                req.status = RequestStatus.LOADING
                continue
            n = self._chunk(req, allowed)
            if not self._grow(req, req.num_computed_tokens + n):
                self._release(req)
                held.clear()  # out of blocks: no one else gets in this step either
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            scheduled.append(self._entry(req, n))
            shares.take(req, n)
            budget -= n
        return budget

    def _ready_waiting(self) -> list[Request]:
        return [r for r in self.waiting if r.status is not RequestStatus.LOADING and self.ready(r)]

    def _want(self, req: Request) -> int:
        """Tokens the request computes this step if it gets the whole budget (its demand)."""
        n = req.num_tokens - req.num_computed_tokens
        if req.spec_token_ids:
            return n + len(req.spec_token_ids)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _victim(self, scheduled: list[ScheduledRequest]) -> Request:
        """Whom to preempt: never a request already scheduled this step (its entry holds its
        blocks); FirstCome's is the last running request, the lowest ranked."""
        taken = {s.request for s in scheduled}
        return self.share.victim([r for r in self.running if r not in taken], self.running)

    def complete_load(self, req: Request, block_ids: list[int]) -> None:
        """Blocks whose KV was read from a tier and written to the device follow the request's
        device prefix: publish them and count them computed. The request waits again."""
        bs = self.pool.block_size
        first = len(req.block_ids)
        tokens = req.all_token_ids
        for i, bid in enumerate(block_ids, start=first):
            self.pool.publish(bid, req.block_hashes[i], tokens[i * bs:(i + 1) * bs])
        req.block_ids.extend(block_ids)
        req.num_published_blocks = len(req.block_ids)
        req.num_computed_tokens = len(req.block_ids) * bs
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.WAITING

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.spec_token_ids:  # a decode with proposals: as many as the budget takes
            del req.spec_token_ids[max(0, budget - 1):]
            return n + len(req.spec_token_ids)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        start, spec = req.num_computed_tokens, tuple(req.spec_token_ids)
        return ScheduledRequest(req, start, n, tuple(req.block_ids),
                                start + n - len(spec) == req.num_tokens, spec)

    def _match_prefix(self, req: Request) -> None:
        """Take the leading cached blocks; at least the last token is always recomputed."""
        bs = self.pool.block_size
        usable = req.block_hashes[:(req.num_tokens - 1) // bs]
        hit = self.pool.match_prefix(usable, req.all_token_ids)
        self.pool.touch(hit)
        req.block_ids = list(hit)
        req.num_published_blocks = len(hit)
        req.num_computed_tokens = len(hit) * bs
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.pool.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_published_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    # ---- after the model ran ---------------------------------------------------------------

    def update(self, output: SchedulerOutput,
               sampled: dict[RequestId, list[int]]) -> list[FullBlock]:
        """Advance computed counts, append sampled tokens (a verified row's accepted proposals and
        the target's next token), publish newly full blocks; returns those blocks (a finished
        request's keep their KV until allocation reuses them)."""
        bs = self.pool.block_size
        full_blocks: list[FullBlock] = []
        for s in output.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            tokens = sampled.get(req.request_id, ())
            # computed: the request's own tokens, and the accepted proposals (all kept tokens
            # but the last, whose KV the next step writes)
            req.num_computed_tokens = s.start + s.num_request_tokens + max(0, len(tokens) - 1)
            req.output_token_ids.extend(tokens)
            if s.spec_token_ids:
                req.spec_token_ids = []
                keep = -(-req.num_computed_tokens // bs)
                self.pool.free(req.block_ids[keep:])
                del req.block_ids[keep:]
            full = req.num_computed_tokens // bs
            if full > req.num_published_blocks:
                tokens = req.all_token_ids
                extend_hashes(req.block_hashes, tokens, bs, self.hash_extra(req))
                for i in range(req.num_published_blocks, full):
                    block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
                    self.pool.publish(req.block_ids[i], req.block_hashes[i], block_tokens)
                    full_blocks.append(FullBlock(
                        req.block_hashes[i], req.block_ids[i],
                        req.block_hashes[i - 1] if i > 0 else None, block_tokens, req))
                req.num_published_blocks = full
        return full_blocks
