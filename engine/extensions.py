"""What a request carries beyond the scheduler's own state: its grammar, its speculation, its KV
tiers. Each is a RequestExtension, one small lifecycle the engine runs over a list:

    on_add(req)                    admitted (a grammar's compile is looked up or started)
    ready(req) -> bool             the scheduler's admission hook (a grammar still compiling:
                                   not yet)
    before_schedule(running)       the step begins (the speculator proposes)
    on_step_result(req, tokens, proposed) -> bool
                                   the tokens a step kept for the request; True: the extension
                                   ends it (a grammar that is complete)
    failed() -> [(id, reason)]     requests the extension cannot serve (a grammar that does not
                                   compile): the engine aborts them
    on_finish(req)                 the request ended, any way: the extension forgets it

KVExtension also runs the KV connector's part of each step: the fetched runs placed before the
scheduler runs, one KVStepPlan handed to the worker side before the forward, the stores after it.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Callable, Sequence

from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.core.kv_connector import KVConnectorScheduler, NoKVConnector, Placement
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import FullBlock, Scheduler, SchedulerOutput
from tierserve.engine.sampling_params import StructuredOutput
from tierserve.engine.spec.speculator import Speculator
from tierserve.engine.worker.grammar import GrammarBook, GrammarCompiler, GrammarStats
from tierserve.engine.worker.kv_worker import KVConnectorWorker, NoKVWorker


class RequestExtension:
    """The lifecycle (see the module docstring); every hook a no-op unless overridden."""

    def on_add(self, req: Request) -> None:
        pass

    def ready(self, req: Request) -> bool:
        return True

    def before_schedule(self, running: list[Request]) -> None:
        pass

    def on_step_result(self, req: Request, tokens: list[int], proposed: int) -> bool:
        return False

    def failed(self) -> list[tuple[RequestId, str]]:
        return []

    def on_finish(self, req: Request) -> None:
        pass


class GrammarExtension(RequestExtension):
    """Structured outputs: the grammar book, built on first use (xgrammar imports transformers,
    ~2 s; the server builds it at start-up, off the loop thread)."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]):
        self._make = make_compiler
        self._book: GrammarBook | None = None
        self._lock = threading.Lock()

    @property
    def book(self) -> GrammarBook:
        with self._lock:
            if self._book is None:
                self._book = GrammarBook(self._make())
            return self._book

    @property
    def built(self) -> GrammarBook | None:
        """The book if something built it (None: no structured request yet, nothing to ask)."""
        return self._book

    def compile(self, spec: StructuredOutput, scope: str | None) -> cf.Future:
        return self.book.compiler.submit(spec, scope)

    def stats(self) -> GrammarStats:
        return self._book.stats() if self._book is not None else GrammarStats()

    def wait(self, timeout: float) -> None:
        if self._book is not None:
            self._book.wait(timeout)

    def close(self) -> None:
        if self._book is not None:
            self._book.compiler.close()

    def on_add(self, req: Request) -> None:
        spec = req.params.structured_outputs
        if spec is not None:
            self.book.add(req.request_id, spec, req.cache_scope)

    def ready(self, req: Request) -> bool:
        return self._book is None or self._book.ready(req.request_id)

    def on_step_result(self, req: Request, tokens: list[int], proposed: int) -> bool:
        """The matcher takes the kept token (a constrained request never speculates: one a
        step); True when the grammar is complete."""
        if self._book is None:
            return False
        complete = False
        for tok in tokens:
            complete = self._book.accept(req.request_id, tok)
        return complete

    def failed(self) -> list[tuple[RequestId, str]]:
        if self._book is None:
            return []
        return [(RequestId(rid), str(error)) for rid, error in self._book.failed()]

    def on_finish(self, req: Request) -> None:
        if self._book is not None:
            self._book.remove(req.request_id)


class SpecExtension(RequestExtension):
    """Speculative decoding: proposals before each schedule, acceptance counted per request."""

    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def before_schedule(self, running: list[Request]) -> None:
        self.speculator.propose(running)

    def on_step_result(self, req: Request, tokens: list[int], proposed: int) -> bool:
        if proposed:
            self.speculator.observe(req.request_id, proposed, len(tokens) - 1)
        return False

    def on_finish(self, req: Request) -> None:
        self.speculator.finished(req.request_id)


class KVExtension(RequestExtension):
    """The KV connector's two sides: the scheduler side (tier decisions, which blocks move
    where; torch-free) and the worker side (moves the bytes), joined once a step."""

    def __init__(self, scheduler: KVConnectorScheduler | NoKVConnector,
                 worker: KVConnectorWorker | NoKVWorker, pool: BlockPool):
        self.scheduler, self.worker, self.pool = scheduler, worker, pool
        self._placed: list[Placement] = []

    def bring_in(self, sched: Scheduler) -> None:
        """Before scheduling: the fetches that finished get device blocks (their requests
        complete their loads and may run this step); their KV is written by the step's plan."""
        placed = self.scheduler.place(self.worker.finished())
        for p in placed:
            sched.complete_load(sched.requests[p.request_id], list(p.block_ids))
        self._placed += placed

    def before_forward(self, out: SchedulerOutput) -> None:
        """The step's one plan to the worker side: demotions out, fetched runs in, new fetches
        started."""
        placed, self._placed = self._placed, []
        self.worker.apply(self.scheduler.plan_step(placed, out.preempted))

    def after_forward(self, tokens: int, seconds: float, full: Sequence[FullBlock]) -> None:
        """The model's time (the cost model's prefill rate) and the blocks the step filled,
        to the tiers."""
        self.scheduler.observe_step(tokens, seconds)
        self.worker.copy_out(self.scheduler.stores(full))

    def wait(self, timeout: float) -> None:
        self.worker.wait(timeout)

    def facts(self, req: Request):
        return self.scheduler.facts(req)

    def close(self) -> None:
        self.worker.close()

    def on_finish(self, req: Request) -> None:
        self.scheduler.finished([req.request_id])
        self.worker.cancel(req.request_id)
