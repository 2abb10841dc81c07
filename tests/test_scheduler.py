"""Scheduler with a fake model: token budget, chunking, priority, preemption, abort."""

from __future__ import annotations

from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.config import SchedulerConfig
from tierserve.engine.core.request import Request, RequestId, RequestStatus
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.core.scheduler import Scheduler


def make(num_blocks=64, bs=4, **kw):
    return Scheduler(SchedulerConfig(**kw), BlockPool(num_blocks, bs), lambda r: b"fake")


def req(rid, n, max_tokens=8, priority=0, t=0.0, base=0):
    return Request(RequestId(rid), list(range(base, base + n)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, arrival_time=t, priority=priority)


def run_step(s: Scheduler, next_token=7):
    """A fake model: every sampling request gets next_token; finishes at max_tokens."""
    out = s.schedule()
    s.update(out, {x.request.request_id: [next_token] for x in out.scheduled if x.samples})
    done = [x.request.request_id for x in out.scheduled
            if x.request.status is RequestStatus.RUNNING
            and len(x.request.output_token_ids) >= x.request.max_tokens]
    s.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return out


def test_budget_chunks_prefill_and_mixes_with_decodes():
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", 3))
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3)]
    s.add_request(req("b", 25, base=100))
    out = run_step(s)
    # a decodes (1 token, listed first) while b's prefill takes the remaining 9 of the budget
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10
    out = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 9]
    out = run_step(s)
    assert out.scheduled[1].num_new_tokens == 7 and out.scheduled[1].samples


def test_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, t=i, base=10 * i))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]


def test_priority_policy_admits_lowest_value_first():
    s = make(max_num_seqs=1, max_num_batched_tokens=100, policy="priority")
    s.add_request(req("low", 4, priority=5, t=0))
    s.add_request(req("high", 4, priority=-1, t=1, base=50))
    assert run_step(s).scheduled[0].request.request_id == "high"


def test_preemption_when_blocks_run_out_and_everything_finishes():
    s = make(num_blocks=6, bs=4, max_num_batched_tokens=64)
    s.add_request(req("a", 8, max_tokens=10, t=0))
    s.add_request(req("b", 8, max_tokens=10, t=1, base=100))
    steps = 0
    while s.num_unfinished and steps < 200:
        run_step(s)
        steps += 1
    assert s.num_unfinished == 0
    assert s.num_preemptions > 0
    assert s.pool.num_free == 6


def test_prefix_hit_skips_cached_blocks_but_recomputes_last_token():
    s = make(bs=4, max_num_batched_tokens=100)
    s.add_request(req("a", 12, max_tokens=1))
    run_step(s)  # a: computes 12, samples, finishes; 3 full blocks published
    s.add_request(req("b", 12, max_tokens=1))  # identical prompt
    out = run_step(s)
    b = out.scheduled[0]
    assert b.start == 8 and b.num_new_tokens == 4  # 2 blocks hit; the last block is recomputed
    assert b.request.num_cached_tokens == 8


def test_abort_in_any_state_frees_blocks():
    s = make(num_blocks=8, max_num_seqs=1)
    s.add_request(req("run", 10))
    s.add_request(req("wait", 10, base=50))
    run_step(s)
    assert s.pool.num_free < 8
    s.finish_requests([RequestId("run"), RequestId("wait")], RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and s.pool.num_free == 8


def test_interactive_requests_are_admitted_before_batch_and_priority_wins():
    from tierserve.engine.core.kv_hints import KVHints, SloClass

    def hinted(rid, cls, t, priority=0):
        r = req(rid, 4, t=t, priority=priority, base=100 * t)
        r.hints = KVHints(slo_class=cls)
        return r

    s = make(max_num_seqs=1)
    for r in (hinted("batch", SloClass.BATCH, 0), hinted("plain", None, 1),
              hinted("inter", SloClass.INTERACTIVE, 2)):
        s.add_request(r)
    order = []
    while s.num_unfinished:
        out = run_step(s)
        order += [x.request.request_id for x in out.scheduled if x.start == 0]
    assert order == ["inter", "plain", "batch"]  # fcfs within a class, classes first

    p = make(max_num_seqs=1, policy="priority")
    p.add_request(hinted("inter", SloClass.INTERACTIVE, 0, priority=5))
    p.add_request(hinted("batch", SloClass.BATCH, 1, priority=0))
    out = run_step(p)
    assert [x.request.request_id for x in out.scheduled] == ["batch"]  # the body's priority wins
