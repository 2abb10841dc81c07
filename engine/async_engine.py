"""The async engine: one loop thread owns the LLMEngine; asyncio callers talk to it by queue.

Ownership (nothing else touches the LLMEngine after start()):

    caller (event loop)            loop thread
    -------------------            -----------
    add_group() -> _commands  -->  engine.add_request(...) per child
    abort()     -> _commands  -->  engine.abort_request(...)
    GroupStream.queue         <--  loop.call_soon_threadsafe(put, outputs of one step)

The loop survives its own bugs: a command or a step that raises is logged with its traceback,
the groups it touches end with EngineError (a 500) after their requests are aborted (their
blocks return to the pool), and the loop goes on. If the thread ends anyway, every open and
queued group ends with EngineStopped, `alive` turns False (/health answers 503) and add_group
refuses at once, so no client waits on a loop that is gone.

A group is what one HTTP request asks for: one engine request per (prompt, choice). Its stream
yields (child index, RequestOutput) in step order and ends after every child finished; the
outputs carry cumulative text and token ids, so a consumer takes deltas by length.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tierserve.engine.info import EngineInfo
from tierserve.engine.core.kv_hints import KVHints
from tierserve.engine.sampling_params import ParamError, SamplingParams, StructuredOutput
from tierserve.engine.llm_engine import LLMEngine
from tierserve.engine.worker.tp.protocol import WorkerDied
from tierserve.engine.outputs import RequestOutput
from tierserve.engine.stats import EngineSnapshot

log = logging.getLogger(__name__)
GRAMMAR_INIT_WAIT_S = 120.0
"""How long stop() waits for the grammar compiler still starting (an import cannot be cut)."""


@dataclass(frozen=True)
class ChildRequest:
    """One engine request of a group."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    kv_hints: KVHints | None = None
    cache_scope: str | None = None
    """Who may share the child's KV blocks (Request.cache_scope)."""
    tenant: str | None = None
    """Whose share of the engine the child uses (Request.tenant)."""


class QueueFull(Exception):
    """More requests in flight than max_num_seqs + max_queue."""


class EngineStopped(Exception):
    """The engine is draining or stopped and admits nothing new."""


class EngineError(Exception):
    """A bug on the loop thread ended this request (the client gets a 500)."""


class NeverAdmissible(ParamError):
    """More engine requests in one group than the server can ever hold at once (a 400)."""


@dataclass(frozen=True)
class _Command:
    fn: Callable[[], None]
    streams: tuple[GroupStream, ...]
    """The groups the command acts for: they end with an error if it fails."""


class GroupStream:
    """The async side of one group: (child index, output) pairs until every child finished."""

    def __init__(self, children: list[ChildRequest], loop: asyncio.AbstractEventLoop):
        self.children = children
        self.index = {c.request_id: i for i, c in enumerate(children)}
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished = set(self.index)
        self.failed = False
        self.started = False
        """The loop thread registered the children (their in-flight count is settled per child)."""

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            i, out = item
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield i, out

    def _put(self, item) -> None:  # runs on the event loop
        self.queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (from any thread; once only)."""
        if self.failed:
            return
        self.failed = True
        try:
            self.loop.call_soon_threadsafe(self._put, error)
        except RuntimeError:  # the event loop is already closed
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256):
        self.engine = engine
        self.max_in_flight = engine.config.scheduler.max_num_seqs + max_queue
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, GroupStream] = {}  # child id -> stream; loop thread only
        self._in_flight = 0  # engine requests admitted and not finished; guarded by _lock
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._dead = False  # set by the loop thread as it ends, before it fails what is queued
        self.fatal = False
        """The loop thread ended on an error (a tensor-parallel rank died, a bug): the server
        exits non-zero."""
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # the grammar compiler imports xgrammar (and transformers, ~2 s; much longer from a fresh
        # venv on a busy box): off the event loop and the step, before the first structured
        # request. stop() waits for it: a daemon thread still inside xgrammar's C++ when the
        # interpreter finalizes aborts the process ("terminate called without an active
        # exception") instead of exiting 0.
        self._grammar_init = threading.Thread(target=lambda: self.engine.grammars,
                                              name="grammar-init", daemon=True)
        self._wake = threading.Event()

    # ---- caller side (any thread; typically the event loop) -----------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def set_chat_template(self, template: str) -> None:
        """Replace the model's chat template (--chat-template); before the server starts."""
        self.engine.tokenizer.set_chat_template(template)

    @property
    def info(self) -> EngineInfo:
        """What the engine chose at start-up (read-only; the server's view of it)."""
        return self.engine.info

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def alive(self) -> bool:
        """The loop thread is running (False before start() and after it ended)."""
        return self._thread.is_alive() and not self._dead

    def start(self) -> None:
        self._publish()
        self._thread.start()
        self._grammar_init.start()

    def check(self, prompt_token_ids: list[int], params: SamplingParams,
              cache_salt: str | None = None) -> None:
        """Raise ParamError now, before a stream opens. Pure: reads only frozen engine limits."""
        self.engine.check_prompt(prompt_token_ids, params, cache_salt)

    def compile_grammar(self, spec: StructuredOutput, scope: str | None = None) -> cf.Future:
        """Start (or find in the caller's scope of the cache) the compile of a structured output,
        in the grammar pool (engine/worker/grammar_pool.py: per-key queues, killable processes);
        the future holds the compiled grammar or a GrammarError."""
        return self.engine.compile_grammar(spec, scope)

    def add_group(self, children: list[ChildRequest]) -> GroupStream:
        """Admit every child or none (QueueFull / EngineStopped / ParamError)."""
        if self._draining or self._stopping.is_set():
            raise EngineStopped("the server is shutting down")
        if not self.alive:
            raise EngineStopped("the engine loop is not running")
        if len(children) > self.max_in_flight:
            raise NeverAdmissible("n", f"this request needs {len(children)} engine requests "
                                  f"(prompts x n); the server holds at most {self.max_in_flight} "
                                  f"at once (max_num_seqs + max_queue)")
        for c in children:
            self.check(c.prompt_token_ids, c.params, c.cache_salt)
        with self._lock:
            if self._in_flight + len(children) > self.max_in_flight:
                raise QueueFull(f"{self._in_flight} requests in flight; the limit is "
                                f"{self.max_in_flight} (max_num_seqs + max_queue)")
            self._in_flight += len(children)
        stream = GroupStream(children, asyncio.get_running_loop())
        self._submit(lambda: self._add(stream), stream)
        if self._dead:  # the loop ended meanwhile: it may not have seen the command
            stream.fail(EngineStopped("the engine loop is not running"))
        return stream

    def abort(self, stream: GroupStream) -> None:
        """Abort the group's unfinished children; their blocks return to the pool."""
        ids = list(stream.unfinished)
        if ids:
            self._submit(lambda: self._abort(ids), stream)

    def drain(self) -> None:
        """Admit nothing new; work in flight continues."""
        self._draining = True

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._grammar_init.is_alive():
            log.info("waiting for the grammar compiler to finish starting before exiting")
            self._grammar_init.join(GRAMMAR_INIT_WAIT_S)
        self.engine.close()

    def _submit(self, fn: Callable[[], None], *streams: GroupStream) -> None:
        self._commands.put(_Command(fn, streams))
        self._wake.set()

    # ---- loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        reason = EngineStopped("the server shut down")
        try:
            while not self._stopping.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self._publish()  # grammar compiles move their counters while it idles
                    continue
                self._step()
        except BaseException:
            log.critical("the engine loop thread died", exc_info=True)
            reason = EngineStopped("the engine loop stopped after an internal error")
            self.fatal = True
            raise
        finally:
            self._dead = True
            self._fail_all(reason)
            self._fail_queued(reason)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDied:  # fatal: the loop ends, every request fails, the server exits
            raise
        except Exception:  # a bug in a step must not leave clients hanging forever
            log.exception("engine step failed; its requests end with an internal error")
            self._fail_all(EngineError("internal engine error"))
            return
        self._dispatch(outputs)
        self._publish()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                cmd.fn()
            except Exception:
                log.exception("engine command failed; its requests end with an internal error")
                for stream in cmd.streams:
                    self._fail_stream(stream, EngineError("internal engine error"))

    def _fail_queued(self, error: BaseException) -> None:
        """Commands the loop will never run: their groups end with `error`."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            for stream in cmd.streams:
                self._fail_stream(stream, error)

    def _add(self, stream: GroupStream) -> None:
        now = time.monotonic()
        for c in stream.children:  # registered first: a failure below aborts what was added
            self._streams[c.request_id] = stream
        stream.started = True
        try:
            for c in stream.children:
                self.engine.add_request(c.request_id, c.prompt_token_ids, c.params,
                                        priority=c.priority, cache_salt=c.cache_salt,
                                        arrival_time=now, kv_hints=c.kv_hints,
                                        cache_scope=c.cache_scope, tenant=c.tenant)
        except ParamError as e:  # checked before admission; only a changed engine gets here
            self._fail_stream(stream, e)
            return
        self._publish()

    def _abort(self, ids: list[str]) -> None:
        live = [i for i in ids if i in self._streams]
        self.engine.abort_request(live)
        for rid in live:
            stream = self._streams.pop(rid)
            self._finish_count(1)
            out = RequestOutput(rid, None, [], [], finished=True)
            stream.loop.call_soon_threadsafe(stream._put, (stream.index[rid], out))
        self._publish()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_stream: dict[int, tuple[GroupStream, list]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._finish_count(1)
            by_stream.setdefault(id(stream), (stream, []))[1].append((stream.index[out.request_id], out))
        for stream, items in by_stream.values():  # one cross-thread wake-up per group per step
            stream.loop.call_soon_threadsafe(_put_all, stream, items)

    def _fail_all(self, error: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            self._fail_stream(stream, error)

    def _fail_stream(self, stream: GroupStream, error: BaseException) -> None:
        """End a group with `error`: abort its live requests (their blocks return to the pool)
        and settle the in-flight count once per child, whatever state the group was in."""
        live = [c.request_id for c in stream.children if self._streams.get(c.request_id) is stream]
        for rid in live:
            del self._streams[rid]
        try:
            self.engine.abort_request(live)
        except Exception:  # noqa: BLE001 - the loop must go on; the pool check is the engine's
            log.exception("aborting requests %s failed", live)
        if not stream.failed:
            self._finish_count(len(live) if stream.started else len(stream.children))
        stream.fail(error)
        self._publish()

    def _finish_count(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n

    def _publish(self) -> None:
        self.snapshot = self.engine.snapshot()


def _put_all(stream: GroupStream, items: list) -> None:
    for item in items:
        stream.queue.put_nowait(item)
