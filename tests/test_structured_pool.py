"""The grammar pool and its byte-bounded cache on their own: real xgrammar in real compiler
processes, over a tiny vocabulary (no model). Enums of many patterned strings are what xgrammar
compiles slowly: 6,000 take ~2.5 s and ~28 MiB here, 60,000 over a minute."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer, decoders, models

from tierserve.engine.sampling_params import StructuredOutput
from tierserve.engine.tokenizer import TextTokenizer, TokenizerInfo
from tierserve.engine.worker import grammar_pool
from tierserve.engine.worker.grammar import GrammarBusy, GrammarCompiler, GrammarError
from tierserve.engine.worker.grammar_cache import ENTRY_OVERHEAD, GrammarCache
from tierserve.engine.worker.grammar_pool import FairQueue, Job, JobState, Lane

SMALL = StructuredOutput.json({"type": "object", "properties": {"q": {"type": "integer"}}})


def _enum(tag: str, n: int) -> StructuredOutput:
    return StructuredOutput.json({"enum": [f"{tag}-{i:06d}-value" for i in range(n)]})


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))} | {"</s>": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.decoder = decoders.ByteLevel()
    return TextTokenizer(TokenizerInfo(tok, None, None, "</s>", False))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, 96, (95,), workers=2, per_key=2, cache_bytes=64 << 20,
                        max_bytes=48 << 20)
    assert c.submit(SMALL, "warm").result(60) is not None
    yield c
    c.close()


def _wait(until, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- the pure parts ----------------------------------------------------------------------------


def _job(tenant: str, name: str) -> Job:
    return Job(name, tenant, "json", "", True, Lane.HEAVY, 0.0)


def test_fair_queue_takes_tenants_in_turn():
    q = FairQueue()
    for tenant, name in [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1"), ("C", "c1"),
                         ("C", "c2")]:
        q.push(_job(tenant, name))
    assert [q.pop().key for _ in range(3)] == ["a1", "b1", "c1"]
    q.push(_job("D", "d1"))  # a tenant new to the rotation joins at its back
    assert [q.pop().key for _ in range(4)] == ["a2", "c2", "d1", "a3"]
    assert q.pop() is None and len(q) == 0


def test_fair_queue_front_and_remove():
    q = FairQueue()
    a1, a2, b1 = _job("A", "a1"), _job("A", "a2"), _job("B", "b1")
    for j in (a1, a2, b1):
        q.push(j)
    assert q.ahead(a2) == 1 and q.remove(a1) and q.ahead(a2) == 0
    q.push(a1, front=True)
    assert [q.pop().key for _ in range(3)] == ["a1", "b1", "a2"]


def test_cache_evicts_least_recently_used_by_bytes():
    cache = GrammarCache(3 * (100 + ENTRY_OVERHEAD))
    for key in "abc":
        cache.add(key, object(), 0)
        cache.settle(key, key.upper(), False, 100)
    assert len(cache) == 3 and cache.evictions == 0
    cache.get("a")  # a is now the most recent: b is the least
    cache.add("d", object(), 0)  # compiling: never evicted
    freed = cache.settle("d", "D", False, 100)
    assert freed == 100 + ENTRY_OVERHEAD and cache.get("b") is None and cache.evictions == 1
    assert [k for k in "acd" if cache.get(k)] == ["a", "c", "d"]
    cache.add("e", object(), 0)
    cache.add("big", object(), 0)
    cache.settle("big", "BIG", False, 10 * cache.limit_bytes)  # larger than the bound: not kept
    assert cache.get("big") is None and len(cache) == 4 and cache.get("e").job is not None
    assert cache.bytes == 3 * (100 + ENTRY_OVERHEAD)


# ---- the pool, with compiler processes -------------------------------------------------------


def test_small_schema_is_not_held_by_heavy_compiles_and_cancel_kills(compiler):
    heavy = [compiler.submit(_enum(f"a{i}-{time.monotonic_ns()}", 60_000), "A")
             for i in range(2)]
    _wait(lambda: all(t.progress().state is JobState.RUNNING for t in heavy))
    busy_pids = compiler.pool.pids()

    t0 = time.monotonic()
    assert compiler.submit(StructuredOutput.json({"type": "integer"}), "B").result(10) is not None
    assert time.monotonic() - t0 < 2.0  # the quick lane: no wait for A's workers

    with pytest.raises(GrammarBusy) as e:  # per_key=2: A's third large compile
        compiler.submit(_enum(f"a3-{time.monotonic_ns()}", 60_000), "A")
    assert e.value.limit == 2
    b_heavy = compiler.submit(_enum(f"b-{time.monotonic_ns()}", 60_000), "B")  # B's own limit
    assert b_heavy.progress().state is JobState.QUEUED

    before = compiler.stats().compiles_cancelled
    for t in (*heavy, b_heavy):
        t.cancel()
    _wait(lambda: compiler.stats().compiles_running == compiler.stats().compiles_queued == 0)
    assert compiler.stats().compiles_cancelled == before + 3
    killed = [p for p in busy_pids if p not in compiler.pool.pids()]
    assert len(killed) == 2, "the two busy compiler processes were killed"
    _wait(lambda: not any(_alive(p) for p in killed))
    _wait(lambda: len(compiler.pool.pids()) == 3)  # and replaced


def test_a_compile_stops_only_when_its_last_waiter_leaves(compiler):
    spec = _enum(f"shared-{time.monotonic_ns()}", 60_000)
    first, second = compiler.submit(spec, "A"), compiler.submit(spec, "A")
    _wait(lambda: first.progress().state is JobState.RUNNING)
    first.cancel()
    time.sleep(0.3)
    assert second.progress().state is JobState.RUNNING
    second.cancel()
    _wait(lambda: compiler.stats().compiles_running == 0)


def test_refusals_name_the_reason_and_are_cached(compiler):
    with pytest.raises(GrammarError, match="parenthesis"):
        compiler.submit(StructuredOutput.regex("a(b"), "A").result(10)
    hits = compiler.stats().cache_hits
    again = compiler.submit(StructuredOutput.regex("a(b"), "A")
    assert again.done() and isinstance(again.exception(), GrammarError)
    assert compiler.stats().cache_hits == hits + 1


def test_a_quick_compile_past_its_budget_goes_on_in_the_heavy_lane(compiler, monkeypatch):
    monkeypatch.setattr(grammar_pool, "QUICK_CHARS", 1 << 30)
    monkeypatch.setattr(grammar_pool, "QUICK_BUDGET_S", 0.05)
    ticket = compiler.submit(_enum(f"s{time.monotonic_ns()}", 3000), "C")
    assert ticket.progress().lane is Lane.QUICK
    assert compiler.matcher(ticket.result(60)).accept_string('"s')
    assert ticket.job.lane is Lane.HEAVY and ticket.job.ran_s >= 0.05


def test_grammars_past_max_bytes_are_refused_and_the_cache_stays_bounded(tokenizer):
    c = GrammarCompiler(tokenizer, 96, (95,), cache_bytes=64 << 10, max_bytes=64 << 10)
    try:
        with pytest.raises(GrammarError, match="grammar_max_bytes"):
            c.submit(_enum("big", 6000)).result(60)
        for i in range(40):
            c.submit(StructuredOutput.json({"type": "object", "properties": {
                f"f{i}": {"type": "integer"}}})).result(30)
        stats = c.stats()
        assert stats.cache_bytes <= 64 << 10 and stats.cache_evictions > 0
        assert stats.cache_entries < 41
    finally:
        pids = c.pool.pids()
        c.close()
    _wait(lambda: not any(_alive(p) for p in pids))  # the processes end with the compiler

