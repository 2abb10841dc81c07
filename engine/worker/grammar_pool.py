"""Grammar compiles, fair across tenants, in worker processes that can be stopped.

    lane    workers                       takes                          a compile there
    QUICK   1 process                     text of at most QUICK_CHARS    gets QUICK_BUDGET_S; past
                                          (JSON object, small schemas,   it the process is killed
                                          regexes, choices)              and the job queues HEAVY
    HEAVY   `workers` processes, nice 10  the rest (and QUICK's          runs until it is done or
                                          leftovers when QUICK is idle)  no request waits for it

xgrammar's compile cannot be interrupted in a thread; a process can be killed. So a compile no
request waits for any more (its requests timed out or went away) is killed at once and frees its
worker, and a schema sent by one tenant never waits behind another's large compiles: small texts
take the QUICK lane, where nothing runs longer than its budget. The process proves the compile:
it ends (in how long) and within `max_bytes` (a grammar past it never leaves the process). The
grammar is then compiled again here, on the worker's thread: cheaper than xgrammar's JSON of it
(grammar_child.py), and bounded by the proof, though it cannot be stopped.

Each lane keeps a FIFO per tenant (an API key's cache scope; None: callers without a key) and
takes from the tenants in turn. A tenant may have at most `per_tenant` HEAVY compiles queued or
running; one more is refused at once (GrammarBusy: a 429 at the server). Threads: one per worker
(it sends a job, waits for the reply, compiles the grammar here), plus any thread that submits
or cancels.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from tierserve.engine.worker.grammar_child import TIMED_OUT, Child

log = logging.getLogger(__name__)

QUICK_CHARS = 16 << 10
"""Grammar texts up to this many characters take the QUICK lane (a JSON schema of a few dozen
properties; a 1,000-string enum is ~20 KiB). Measured before compiling: the text is all there is."""
QUICK_BUDGET_S = 2.0
"""Longest a compile runs in the QUICK lane (the tiny schemas there take milliseconds)."""
HEAVY_NICE = 10
"""HEAVY workers yield the CPU to the engine's step and to the QUICK lane (at equal priority two
compiles on a 2-core box made a 12-token answer beside them take 14 s instead of 2). A compile's
own time is therefore counted in CPU seconds (a starved compile is not a slow grammar)."""


class Lane(enum.Enum):
    QUICK = "quick"
    HEAVY = "heavy"


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    """Compiled, refused or cancelled: no longer the pool's."""


@dataclass(eq=False)
class Job:
    """One compile. The pool owns its fields; callers read them through `GrammarPool.progress`."""

    key: Hashable
    tenant: str | None
    kind: str
    """What the child compiles (grammar_child.compile_grammar): json, json_object, regex, ..."""
    text: str
    limited: bool
    """Counts against the tenant's HEAVY limit (the engine's own lookups do not)."""
    lane: Lane
    submitted_at: float
    started_at: float | None = None
    """When its current run began (None while queued)."""
    cpu_at_start: float | None = None
    """Its worker's CPU seconds when the current run began (None where unknown)."""
    ran_s: float = 0.0
    """CPU seconds of earlier runs (a QUICK run that went past its budget)."""
    ran_wall_s: float = 0.0
    """Wall seconds of earlier runs."""
    replay: tuple[float, float] | None = None
    """(CPU seconds its process used, when the compile here began) once proven there."""
    state: JobState = JobState.QUEUED
    cancelled: bool = False
    held_by_own: bool = False
    """While it was queued, a compile of its own tenant held a worker it could have taken."""


@dataclass(frozen=True)
class CompileProgress:
    """Where a compile is, for a caller deciding whether it waited too long, and for whom."""

    state: JobState
    lane: Lane
    waited_s: float
    """Seconds spent queued (not running) so far."""
    ran_s: float
    """CPU seconds its compiles used so far (wall seconds where the OS does not say)."""
    run_wall_s: float
    """Wall seconds of its current run (0 while queued)."""
    own_ahead: int
    """The same tenant's compiles running in its lane or queued before it."""
    held_by_own: bool
    """The same tenant's compiles held a worker at some time while it was queued."""
    others_running: int
    """Other tenants' compiles running in its lane."""
    tenant: str | None


@dataclass(frozen=True)
class Compiled:
    grammar: object
    bytes: int
    seconds: float
    """What the compile took in its process."""


@dataclass(frozen=True)
class Refused:
    reason: str
    cacheable: bool
    """The text's own fault (xgrammar's reason, too large), not a crashed or stopped worker."""
    too_big: int | None = None
    """The compiled size when it was refused for passing max_bytes."""
    seconds: float = 0.0
    """What the compiler process spent before it refused (0 when no compiler answered)."""


@dataclass(frozen=True)
class Busy:
    limit: int


Outcome = Compiled | Refused | Busy


class GrammarBusy(Exception):
    """A tenant already has `limit` HEAVY compiles queued or running."""

    def __init__(self, limit: int, tenant: str | None):
        super().__init__(f"{limit} grammar compiles in flight or queued")
        self.limit, self.tenant = limit, tenant


class FairQueue:
    """Jobs in one FIFO per tenant; `pop` takes from the tenants in turn (round robin: a tenant
    that got a job goes to the back of the rotation; a tenant new to it joins at the back)."""

    def __init__(self):
        self._queues: OrderedDict[str | None, deque[Job]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, job: Job, front: bool = False) -> None:
        q = self._queues.setdefault(job.tenant, deque())
        q.appendleft(job) if front else q.append(job)

    def pop(self) -> Job | None:
        if not self._queues:
            return None
        tenant, q = self._queues.popitem(last=False)
        job = q.popleft()
        if q:
            self._queues[tenant] = q
        return job

    def remove(self, job: Job) -> bool:
        q = self._queues.get(job.tenant)
        if q is None or job not in q:
            return False
        q.remove(job)
        if not q:
            del self._queues[job.tenant]
        return True

    def of(self, tenant: str | None) -> Iterable[Job]:
        return self._queues.get(tenant, ())

    def ahead(self, job: Job) -> int:
        """The tenant's jobs queued before `job`."""
        q = self._queues.get(job.tenant, ())
        return next((i for i, j in enumerate(q) if j is job), len(q))


@dataclass(eq=False)
class _Slot:
    lanes: tuple[Lane, ...]
    """Lanes it takes from, in order."""
    nice: int
    child: Child | None = None
    job: Job | None = None


class GrammarPool:
    def __init__(self, init: bytes, replay: Callable[[str, str], object],
                 on_done: Callable[[Job, Outcome], None], *, workers: int = 2,
                 per_tenant: int = 4, max_bytes: int | None = None):
        """`init`: the tokenizer as xgrammar's JSON (each child's first frame); `replay(kind,
        text)`: the compile, here, once a process has proven it; `on_done(job, outcome)`:
        called once per job that was not cancelled, on a worker thread, without the pool's
        lock."""
        self._init, self._replay, self._on_done = init, replay, on_done
        self.per_tenant, self.max_bytes = per_tenant, max_bytes
        self._cv = threading.Condition()
        self._queues = {lane: FairQueue() for lane in Lane}
        self._slots = [_Slot((Lane.QUICK,), 0)] + \
            [_Slot((Lane.HEAVY, Lane.QUICK), HEAVY_NICE) for _ in range(workers)]
        self._heavy: Counter[str | None] = Counter()
        """Per tenant: its HEAVY jobs queued or running."""
        self._lean = True
        self._closed = False
        self.cancelled = 0
        """Compiles stopped (dequeued or killed) because no request waited for them."""
        self.rejected = 0
        """Compiles refused by the per-tenant limit."""
        for i, slot in enumerate(self._slots):
            threading.Thread(target=self._serve, args=(slot,), daemon=True,
                             name=f"grammar-{slot.lanes[0].value}-{i}").start()

    # ---- callers ------------------------------------------------------------------------------

    def submit(self, key: Hashable, tenant: str | None, kind: str, text: str,
               limited: bool = True) -> Job:
        """Queue a compile; GrammarBusy when the tenant is at its HEAVY limit."""
        lane = Lane.QUICK if len(text) <= QUICK_CHARS else Lane.HEAVY
        job = Job(key, tenant, kind, text, limited, lane, time.monotonic())
        with self._cv:
            if self._closed:
                raise RuntimeError("the grammar compiler is stopped")
            if lane is Lane.HEAVY:
                self._admit_heavy(job)
            self._queues[lane].push(job)
            job.held_by_own = any(s.job is not None and s.job.tenant == tenant and lane in s.lanes
                                  for s in self._slots)
            self._cv.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """No request waits for `job` any more: dequeue it, or kill the process compiling it."""
        with self._cv:
            if job.state is JobState.DONE or job.cancelled:
                return
            job.cancelled = True
            self.cancelled += 1
            child = None
            if job.state is JobState.QUEUED:
                self._queues[job.lane].remove(job)
                self._retire(job)
            else:
                child = next(s.child for s in self._slots if s.job is job)
        if child is not None:
            child.kill()  # its worker thread sees the pipe close, then starts a new process

    def progress(self, job: Job) -> CompileProgress:
        with self._cv:
            now = time.monotonic()
            child = next((s.child for s in self._slots if s.job is job), None)
            wall, cpu = _run_so_far(job, child, now)
            ran = job.ran_s + cpu
            waited = (now - job.submitted_at - job.ran_wall_s - wall
                      if job.state is not JobState.DONE else 0.0)
            busy = [s.job for s in self._slots if s.job is not None and s.job is not job
                    and s.job.lane is job.lane]
            own = sum(j.tenant == job.tenant for j in busy)
            ahead = self._queues[job.lane].ahead(job) if job.state is JobState.QUEUED else 0
            return CompileProgress(job.state, job.lane, waited, ran, wall, own + ahead,
                                   job.held_by_own, len(busy) - own, job.tenant)

    def load(self) -> tuple[int, int]:
        """(compiles running, compiles queued) now."""
        with self._cv:
            return (sum(s.job is not None for s in self._slots),
                    sum(len(q) for q in self._queues.values()))

    def pids(self) -> list[int]:
        """The worker processes' ids now (they change when one is killed)."""
        with self._cv:
            return [s.child.proc.pid for s in self._slots if s.child is not None]

    def close(self) -> None:
        """Stop every worker; queued jobs end Refused (not cacheable)."""
        with self._cv:
            self._closed = True
            queued = [j for q in self._queues.values() for j in iter(q.pop, None)]
            children = [s.child for s in self._slots if s.child is not None]
            self._cv.notify_all()
        for child in children:
            child.kill()
        for job in queued:
            job.state = JobState.DONE
            self._on_done(job, Refused("the grammar compiler stopped", cacheable=False))

    # ---- the worker threads -------------------------------------------------------------------

    def _admit_heavy(self, job: Job) -> None:
        if job.limited and self._heavy[job.tenant] >= self.per_tenant:
            self.rejected += 1
            raise GrammarBusy(self.per_tenant, job.tenant)
        self._heavy[job.tenant] += 1

    def _retire(self, job: Job) -> None:
        job.state = JobState.DONE
        if job.lane is Lane.HEAVY:
            self._heavy[job.tenant] -= 1
            if not self._heavy[job.tenant]:
                del self._heavy[job.tenant]

    def _serve(self, slot: _Slot) -> None:
        while not self._closed:
            if slot.child is None and not self._start(slot):
                continue
            job = self._take(slot)
            if job is None:
                break
            budget = QUICK_BUDGET_S if job.lane is Lane.QUICK else None
            head = {"op": "compile", "kind": job.kind, "max_bytes": self.max_bytes}
            reply = slot.child.run(head, job.text.encode(), budget)
            self._finish(slot, job, reply)
        if slot.child is not None:
            slot.child.close()

    def _start(self, slot: _Slot) -> bool:
        """A new process for `slot` (lean first; the full import if a lean one fails). On
        failure the next job of its lane is refused, so no caller waits forever."""
        error = None
        for lean in ((True, False) if self._lean else (False,)):
            try:
                child = Child(self._init, lean, slot.nice)
            except (OSError, RuntimeError) as e:
                error = e
                continue
            with self._cv:
                self._lean = lean
                if self._closed:
                    child.close()
                    return False
                slot.child = child
            return True
        log.error("grammar compiler process: %s", error)
        job = self._take(slot)
        if job is not None:
            with self._cv:
                slot.job = None
                self._retire(job)
            self._on_done(job, Refused(f"the grammar compiler is unavailable: {error}", False))
        time.sleep(1.0)
        return False

    def _take(self, slot: _Slot) -> Job | None:
        with self._cv:
            while not self._closed:
                job = next((j for lane in slot.lanes if (j := self._queues[lane].pop())), None)
                if job is not None:
                    job.state, job.started_at, slot.job = JobState.RUNNING, time.monotonic(), job
                    job.cpu_at_start = slot.child.cpu_s() if slot.child else None
                    for lane in slot.lanes:  # the tenant's jobs still queued now wait on it
                        for waiting in self._queues[lane].of(job.tenant):
                            waiting.held_by_own = True
                    return job
                self._cv.wait()
        return None

    def _finish(self, slot: _Slot, job: Job, reply) -> None:
        outcome = self._outcome(reply, job, slot) if isinstance(reply, tuple) else None
        with self._cv:
            wall, cpu = _run_so_far(job, slot.child, time.monotonic())
            job.ran_s, job.ran_wall_s = job.ran_s + cpu, job.ran_wall_s + wall
            slot.job = None
            job.started_at = None
            lost = None
            if reply is None or reply is TIMED_OUT or job.cancelled:  # killed, or to be
                lost, slot.child = slot.child, None
            if job.cancelled:
                outcome = None
                self._retire(job)
            elif reply is TIMED_OUT:
                outcome = self._demote(job)
            elif reply is None or outcome is not None:
                self._retire(job)
        if lost is not None:
            lost.close()
        if reply is None and not job.cancelled:
            outcome = Refused(f"the grammar compiler process ended (exit code "
                              f"{lost.proc.returncode}) while compiling it", cacheable=False)
        if outcome is not None:
            self._on_done(job, outcome)

    def _demote(self, job: Job) -> Busy | None:
        """A QUICK run past its budget: queue it HEAVY, first of its tenant's (under the
        pool's lock); Busy when the tenant is at its HEAVY limit."""
        log.info("a grammar compile ran past %.1f s in the quick lane; it goes on in the heavy "
                 "lane", QUICK_BUDGET_S)
        job.lane = Lane.HEAVY
        try:
            self._admit_heavy(job)
        except GrammarBusy:
            job.lane = Lane.QUICK  # not counted in HEAVY: retired as a QUICK job
            self._retire(job)
            return Busy(self.per_tenant)
        job.state = JobState.QUEUED
        self._queues[Lane.HEAVY].push(job, front=True)
        self._cv.notify_all()
        return None

    def _outcome(self, reply: tuple[dict, bytes], job: Job, slot: _Slot) -> Outcome:
        head = reply[0]
        if head.get("too_big") is not None:
            return Refused(f"its compiled grammar takes {head['too_big'] / 2**20:.0f} MiB, more "
                           f"than grammar_max_bytes ({self.max_bytes / 2**20:.0f} MiB) allows",
                           True, too_big=head["too_big"], seconds=head["seconds"])
        if not head.get("ok"):
            return Refused(head.get("error", "refused"), True, seconds=head["seconds"])
        with self._cv:
            job.replay = (_run_so_far(job, slot.child, time.monotonic())[1], time.monotonic())
        try:
            grammar = self._replay(job.kind, job.text)
        except Exception as e:  # the process compiled it: not the text's fault
            return Refused(f"the grammar compiled in its process but not here: {e}", False)
        return Compiled(grammar, head["bytes"], head["seconds"])


def _run_so_far(job: Job, child: Child | None, now: float) -> tuple[float, float]:
    """(wall, CPU) seconds of `job`'s current run on `child` (wall for both where the CPU time
    is unknown)."""
    if job.state is not JobState.RUNNING:
        return 0.0, 0.0
    wall = now - job.started_at
    if job.replay is not None:  # compiling here now: its process is idle, count the clock
        return wall, job.replay[0] + now - job.replay[1]
    cpu = child.cpu_s() if child is not None else None
    if cpu is None or job.cpu_at_start is None:
        return wall, wall
    return wall, cpu - job.cpu_at_start
