"""How the server's wait for a grammar compile ends, and whose fault it says it was
(server/structured.compile_checked), against scripted compiles: no model, no processes."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time

import pytest

from tierserve.engine.sampling_params import StructuredOutput
from tierserve.engine.worker.grammar import GrammarBusy, GrammarError
from tierserve.engine.worker.grammar_pool import CompileProgress, JobState, Lane
from tierserve.server.errors import ApiError
from tierserve.server.structured import Constraint, compile_checked

TIMEOUT = 1.0
PARAM = "response_format.json_schema.schema"


class ScriptedTicket(cf.Future):
    """Queued for `queued_s`, then compiling for `run_s` with `cpu_share` of a core, then done
    (or never, when run_s is None)."""

    def __init__(self, queued_s: float, run_s: float | None, tenant: str | None = "A",
                 held_by_own: bool = False, others_running: int = 2, cpu_share: float = 1.0):
        super().__init__()
        self.t0, self.queued_s, self.run_s = time.monotonic(), queued_s, run_s
        self.tenant, self.held_by_own, self.others_running = tenant, held_by_own, others_running
        self.cpu_share = cpu_share
        if run_s is not None:
            threading.Timer(queued_s + run_s, self._finish).start()

    def _finish(self) -> None:
        if not self.done():
            self.set_result("grammar")

    def progress(self) -> CompileProgress | None:
        if self.done():
            return None
        age = time.monotonic() - self.t0
        if age < self.queued_s:
            return CompileProgress(JobState.QUEUED, Lane.HEAVY, age, 0.0, 0.0, 0,
                                   self.held_by_own, self.others_running, self.tenant)
        wall = age - self.queued_s
        return CompileProgress(JobState.RUNNING, Lane.HEAVY, self.queued_s,
                               wall * self.cpu_share, wall, 0, self.held_by_own, 0, self.tenant)


class FakeEngine:
    def __init__(self, make):
        self.make, self.tickets = make, []

    def compile_grammar(self, spec, scope):
        ticket = self.make()
        self.tickets.append(ticket)
        return ticket


def _run(make) -> tuple[ApiError | None, ScriptedTicket | None]:
    async def go():
        engine = FakeEngine(make)
        c = Constraint(StructuredOutput.json({"type": "integer"}), PARAM)
        try:
            await compile_checked(engine, c, TIMEOUT, "scope-a")
        except ApiError as e:
            return e, engine.tickets[0] if engine.tickets else None
        return None, engine.tickets[0]
    return asyncio.run(go())


def test_queue_wait_does_not_count_against_the_compile():
    """0.7 s queued and 0.7 s compiling: each under the 1 s timeout, their sum over it."""
    err, ticket = _run(lambda: ScriptedTicket(0.7, 0.7))
    assert err is None and ticket.result() == "grammar"


def test_its_own_slow_compile_is_a_400_and_is_stopped():
    err, ticket = _run(lambda: ScriptedTicket(0.1, None))
    assert err.status == 400 and err.param == PARAM and err.code == "invalid_value"
    assert f"compiled for {TIMEOUT:g} s" in err.message and "simplify" in err.message
    assert ticket.cancelled()  # the compile is told nobody waits for it


def test_a_compile_short_of_cpu_is_not_the_schemas_fault():
    """A fifth of a core: 1.5 s on the clock is 0.3 s of CPU, under the 1 s timeout; at three
    timeouts on the clock it is stopped with a 503."""
    err, _ = _run(lambda: ScriptedTicket(0.0, 1.5, cpu_share=0.2))
    assert err is None
    t0 = time.monotonic()
    err, ticket = _run(lambda: ScriptedTicket(0.0, None, cpu_share=0.2))
    assert time.monotonic() - t0 >= 3 * TIMEOUT
    assert err.status == 503 and err.code == "grammar_cpu_busy" and ticket.cancelled()
    assert "not at fault" in err.message


def test_a_wait_behind_its_own_keys_compiles_is_a_429():
    err, ticket = _run(lambda: ScriptedTicket(10.0, None, held_by_own=True))
    assert err.status == 429 and err.code == "grammar_queue_timeout"
    assert "this API key's grammar queue" in err.message and ticket.cancelled()


def test_a_wait_for_workers_other_keys_hold_is_a_503_that_does_not_blame_the_schema():
    err, ticket = _run(lambda: ScriptedTicket(10.0, None))
    assert err.status == 503 and err.code == "grammar_workers_busy"
    assert "not at fault" in err.message and "2 running" in err.message
    assert err.headers == {"Retry-After": "1"} and ticket.cancelled()


def test_a_key_at_its_limit_gets_a_429_naming_it():
    def busy():
        raise GrammarBusy(3, "scope-a")

    err, _ = _run(busy)
    assert err.status == 429 and err.code == "grammar_compiles_per_key"
    assert "grammar_compiles_per_key = 3" in err.message and err.param == PARAM


def test_a_refusal_is_a_400_naming_the_field():
    def refused():
        t = cf.Future()
        t.set_exception(GrammarError("json", 'Unsupported type "strin"'))
        t.progress = lambda: None
        return t

    err, _ = _run(refused)
    assert err.status == 400 and err.code == "invalid_grammar" and "strin" in err.message


@pytest.mark.parametrize("tenant, whose", [("A", "this API key's"), (None, "the server's")])
def test_the_message_names_whose_queue(tenant, whose):
    err, _ = _run(lambda: ScriptedTicket(10.0, None, tenant=tenant, held_by_own=True))
    assert whose in err.message
