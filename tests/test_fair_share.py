"""Fair share across tenants (API keys): seats, the step's token budget and preemption.

The policy and the scheduler run on fakes in milliseconds; one test runs the real model and
counts the steps until a lone tenant's first token while another tenant's backlog prefills."""

from __future__ import annotations

import itertools
import random

import pytest

from tierserve.engine.config import SchedulerConfig
from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.core.fair_share import FairShare, FirstCome, water_fill
from tierserve.engine.core.request import Request, RequestId, RequestStatus
from tierserve.engine.core.scheduler import Scheduler
from tierserve.engine.sampling_params import SamplingParams


def make(num_blocks=1024, bs=4, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw), BlockPool(num_blocks, bs), lambda r: b"fake")


_PROMPTS = itertools.count()


def req(rid, n, tenant=None, t=0.0, priority=0, max_tokens=4) -> Request:
    base = 1000 * next(_PROMPTS)  # distinct prompts: no prefix hits between requests
    return Request(RequestId(rid), list(range(base, base + n)),
                   SamplingParams(max_tokens=max_tokens), max_tokens, arrival_time=t,
                   priority=priority, tenant=tenant)


def step(s: Scheduler):
    """A fake model: every sampling request gets token 7; finished at max_tokens."""
    out = s.schedule()
    s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    done = [x.request.request_id for x in out.scheduled
            if x.request.status is RequestStatus.RUNNING
            and len(x.request.output_token_ids) >= x.request.max_tokens]
    s.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return out


def tokens_by_tenant(out) -> dict:
    got: dict = {}
    for x in out.scheduled:
        got[x.request.tenant] = got.get(x.request.tenant, 0) + x.num_new_tokens
    return got


def steps_until_first_token(s: Scheduler, rid: str, limit: int = 500) -> int:
    for n in range(1, limit + 1):
        out = step(s)
        if any(x.request.request_id == rid and x.samples for x in out.scheduled):
            return n
    raise AssertionError(f"{rid} got no token in {limit} steps")


# ---- the policy alone -----------------------------------------------------------------------


def test_water_fill_splits_evenly_and_passes_on_what_small_tenants_leave():
    assert water_fill(90, {"a": 1000, "b": 1000, "c": 1000}) == {"a": 30, "b": 30, "c": 30}
    assert water_fill(90, {"a": 1000, "b": 10, "c": 1000}) == {"a": 40, "b": 10, "c": 40}
    assert water_fill(100, {"a": 1000, "b": 1000, "c": 1000}) == {"a": 34, "b": 33, "c": 33}
    assert water_fill(2, {"a": 5, "b": 5, "c": 5}) == {"a": 1, "b": 1, "c": 0}
    assert water_fill(512, {"a": 100, "b": 50}) == {"a": 100, "b": 50}  # demand, not more


def test_seats_go_to_the_tenant_holding_fewest_and_rank_orders_within_a_tenant():
    rank = lambda r: (r.priority, r.arrival_time)  # noqa: E731 - the priority policy's order
    ready = [req(f"a{i}", 8, "a", t=i, priority=5 - i) for i in range(4)] + \
        [req("b0", 8, "b", t=10, priority=-100), req("b1", 8, "b", t=11, priority=-100)]
    fair = FairShare(rank)
    # a tie of seats goes to the better-ranked head (b0); then a and b alternate by seats held;
    # a's own order follows its priorities (a3 first): b's -100 does not buy it a's seats
    order = [r.request_id for r in fair.admission_order(ready, [])]
    assert order == ["b0", "a3", "b1", "a2", "a1", "a0"]
    running = [req("a-run", 8, "a")]  # a holds a seat already: b's two come first
    order = [r.request_id for r in fair.admission_order(ready, running)]
    assert order == ["b0", "b1", "a3", "a2", "a1", "a0"]
    first = [r.request_id for r in FirstCome(rank).admission_order(ready, [])]
    assert first == ["b0", "b1", "a3", "a2", "a1", "a0"]  # rank alone


def test_one_tenant_is_first_come():
    rank = lambda r: (r.arrival_time,)  # noqa: E731
    ready = [req(f"r{i}", 8, t=random.Random(i).random()) for i in range(20)]
    fair, first = FairShare(rank), FirstCome(rank)
    assert fair.admission_order(ready, []) == first.admission_order(ready, [])
    shares = fair.quotas(512, [], ready, lambda r: 10_000)
    assert shares.allowed(ready[0], 512) == 512  # the whole budget, whatever the demand


# ---- the scheduler with tenants -------------------------------------------------------------


@pytest.mark.parametrize("fair", [True, False])
def test_a_lone_request_is_prefilled_in_the_next_step_despite_a_backlog(fair):
    s = make(max_num_batched_tokens=64, max_num_seqs=64, fair_share=fair)
    for i in range(40):
        s.add_request(req(f"a{i}", 32, "a", t=i))
    step(s)  # a's flood is running
    s.add_request(req("b", 32, "b", t=100))
    n = steps_until_first_token(s, "b")
    if fair:
        assert n == 1  # b's whole prompt (32 of the 64) in the first step after it came
    else:
        assert n > 15  # first come: behind the 39 x 32 tokens of a's prefill left


def test_a_newcomers_step_is_short_and_never_twice_in_a_row():
    s = make(max_num_batched_tokens=64, max_num_seqs=64)
    for i in range(40):
        s.add_request(req(f"a{i}", 32, "a", t=i))
    step(s)  # a alone: a0 and a1 prefilled
    s.add_request(req("b", 32, "b", t=100))
    out = step(s)  # b's even share, a's two decodes, none of a's prefill
    assert tokens_by_tenant(out) == {"a": 2, "b": 32} and out.num_batched_tokens == 34
    s.add_request(req("c", 32, "c", t=101))
    out = step(s)  # c is new too, but the last step was short: the whole budget, water-filled
    assert tokens_by_tenant(out) == {"a": 32, "b": 1, "c": 31} and out.num_batched_tokens == 64
    assert tokens_by_tenant(step(s)) == {"a": 62, "b": 1, "c": 1}


def test_the_budget_splits_evenly_between_backlogged_tenants():
    s = make(max_num_batched_tokens=90, max_num_seqs=64)
    for t in "abc":
        for i in range(10):
            s.add_request(req(f"{t}{i}", 200, t, t=i))
    for _ in range(5):
        assert tokens_by_tenant(step(s)) == {"a": 30, "b": 30, "c": 30}


def test_a_small_tenant_takes_its_demand_and_leaves_the_rest():
    s = make(max_num_batched_tokens=90, max_num_seqs=64)
    for i in range(10):
        s.add_request(req(f"a{i}", 200, "a", t=i))
    s.add_request(req("b", 10, "b", t=50))
    assert tokens_by_tenant(step(s)) == {"a": 80, "b": 10}
    assert tokens_by_tenant(step(s)) == {"a": 89, "b": 1}  # b decodes: one token


def test_seats_are_shared_when_they_are_few():
    s = make(max_num_batched_tokens=512, max_num_seqs=4)
    for i in range(10):
        s.add_request(req(f"a{i}", 8, "a", t=i))
    for i in range(3):
        s.add_request(req(f"b{i}", 8, "b", t=20 + i))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a0", "b0", "a1", "b1"]


def test_priority_orders_requests_within_a_tenant_only():
    s = make(max_num_batched_tokens=512, max_num_seqs=2, policy="priority")
    s.add_request(req("a-late", 8, "a", t=0, priority=5))
    s.add_request(req("a-urgent", 8, "a", t=1, priority=-1))
    s.add_request(req("b0", 8, "b", t=2, priority=-100))
    s.add_request(req("b1", 8, "b", t=3, priority=-100))
    assert {x.request.request_id for x in step(s).scheduled} == {"b0", "a-urgent"}


def test_preemption_takes_from_the_tenant_holding_the_most_seats():
    def run(fair: bool) -> list[str]:
        s = make(num_blocks=10, bs=4, max_num_batched_tokens=64, fair_share=fair,
                 max_num_seqs=8)
        for i in range(3):
            s.add_request(req(f"a{i}", 8, "a", t=i, max_tokens=8))
        s.add_request(req("b", 8, "b", t=3, max_tokens=8))
        step(s)  # 4 x 2 blocks of prompt; 2 free
        return list(step(s).preempted)  # each decode needs a third block: one must go

    assert run(fair=True) == ["a2"]  # a holds 3 seats, b 1
    assert run(fair=False) == ["b"]  # first come: the newest request, b's only one


def test_without_tenants_fair_share_schedules_exactly_as_first_come():
    """Random arrivals, lengths, priorities and a tight pool (preemptions): every step's
    (request, start, tokens) and every preemption are the same with the policy on and off."""
    rng = random.Random(7)
    plan = [(i, rng.randrange(1, 120), rng.randrange(1, 12), rng.randrange(-2, 3))
            for i in range(60)]

    def trace(fair: bool) -> list:
        s = make(num_blocks=48, bs=4, max_num_batched_tokens=48, max_num_seqs=6,
                 policy="priority", long_prefill_token_threshold=20, fair_share=fair)
        steps, pending = [], list(plan)
        while pending or s.num_unfinished:
            while pending and pending[0][0] <= len(steps) // 2:
                i, n, m, p = pending.pop(0)
                s.add_request(req(f"r{i}", n, t=i, priority=p, max_tokens=m))
            out = step(s)
            steps.append(([(x.request.request_id, x.start, x.num_new_tokens)
                           for x in out.scheduled], out.preempted))
        return steps

    fair, first = trace(True), trace(False)
    assert any(p for _, p in first)  # the pool is tight enough to preempt
    assert fair == first


# ---- the engine, on the real model ----------------------------------------------------------


def test_engine_gives_a_lone_tenant_its_first_token_within_two_steps(corpus_ids):
    from tierserve.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(fair: bool) -> tuple[int, list[int]]:
        """Steps from b's arrival to its first token, and b's tokens."""
        eng = LLM(kv_cache_memory_bytes=1 << 27, max_num_batched_tokens=64,
                  fair_share=fair).engine
        for i in range(8):
            eng.add_request(f"a{i}", corpus_ids[64 * i:64 * (i + 1)], params, tenant="a")
        eng.step()
        eng.add_request("b", corpus_ids[2000:2048], params, tenant="b")
        first, n = None, 0
        while True:
            n += 1
            b = next((o for o in eng.step() if o.request_id == "b"), None)
            first = first or (b and n)
            if b is not None and b.finished:
                return first, b.outputs[0].token_ids

    fair_steps, fair_tokens = run(True)
    first_steps, first_tokens = run(False)
    assert fair_steps <= 2  # 48 prompt tokens at half of the 64-token budget
    assert first_steps >= 7  # first come: behind a's 448 prompt tokens left
    assert fair_tokens == first_tokens  # chunked differently, the same greedy tokens


def test_the_tenant_is_a_short_digest_per_key_never_the_key():
    from starlette.requests import Request as HttpRequest

    from tierserve.server.auth import Caller, digest, tenant_of

    def http(who):
        return HttpRequest({"type": "http", "state": {"caller": who}})

    a, b = (Caller(digest(k.encode()), admin=False) for k in ("sk-alpha-0d5e91", "sk-beta-77c2"))
    assert tenant_of(http(a)) == a.tenant != b.tenant
    assert len(a.tenant) == 12 and int(a.tenant, 16) >= 0
    assert a.tenant not in ("sk-alpha-0d5e91", a.key_digest.hex()[:12])
    assert tenant_of(http(None)) is None  # no key: the one tenant
