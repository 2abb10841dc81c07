"""The engine loop survives its own bugs: a failing command or step ends only the requests it
touches (a 500, or an error event on a stream), is logged with its traceback, leaves the block
pool whole, and the server goes on serving. A dead loop thread makes /health 503 and new requests
fail fast.

The server runs in this process (uvicorn on a thread over the real engine and model), so a test
can make an engine method fail on purpose."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn

from server_fixtures import MODEL, free_port
from tierserve.engine.async_engine import AsyncEngine
from tierserve.engine.sampling_params import StructuredOutput
from tierserve.engine.llm import build_config
from tierserve.engine.llm_engine import LLMEngine
from tierserve.server.app import build_app
from tierserve.server.config import ServerConfig

MARKER = [1000, 1001, 1002]  # a token-id prompt that the injected faults recognise


@dataclass
class InProcess:
    url: str
    engine: AsyncEngine

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)


@contextlib.contextmanager
def in_process_server() -> Iterator[InProcess]:
    config = ServerConfig(port=free_port(), kv_cache_memory_bytes=64 << 20, max_model_len=512,
                          kv_tiers="none")
    engine = AsyncEngine(LLMEngine(build_config(**config.engine_kwargs())), config.max_queue)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(build_app(config, engine), host="127.0.0.1",
                                           port=config.port, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield InProcess(f"http://127.0.0.1:{config.port}", engine)
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()


@pytest.fixture(scope="module")
def srv():
    with in_process_server() as s:
        yield s


def _pool_whole(srv: InProcess, timeout: float = 10.0) -> bool:
    """Every block is back in the free list and nothing is in flight (once the loop is idle)."""
    pool = srv.engine.engine.pool
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool.num_free == pool.num_blocks and srv.engine.in_flight == 0:
            return True
        time.sleep(0.05)
    return False


def _ok(srv: InProcess) -> str:
    r = srv.client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=4, temperature=0)
    return r.choices[0].text


def test_failing_command_ends_its_request_with_500(srv, monkeypatch, caplog):
    real_add = srv.engine.engine.add_request

    def add_request(request_id, prompt, params, **kw):
        if list(prompt) == MARKER and request_id.endswith("-1"):  # the second choice of n=2
            raise RuntimeError("injected add_request failure")
        return real_add(request_id, prompt, params, **kw)

    monkeypatch.setattr(srv.engine.engine, "add_request", add_request)
    with pytest.raises(openai.InternalServerError) as e:
        srv.client.completions.create(model=MODEL, prompt=MARKER, n=2, max_tokens=50,
                                      extra_body={"ignore_eos": True})
    assert e.value.status_code == 500
    assert e.value.body["type"] == "server_error" and "Traceback" not in str(e.value.body)
    assert "injected add_request failure" in caplog.text and "Traceback" in caplog.text
    assert _pool_whole(srv)  # the first choice, already added, was aborted and freed
    assert _ok(srv)  # the loop goes on


def test_failing_step_ends_the_stream_with_an_error_event(srv, monkeypatch, caplog):
    real_step, fail = srv.engine.engine.step, threading.Event()

    def step():
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(srv.engine.engine, "step", step)
    body = {"model": MODEL, "prompt": MARKER, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    fail.set()  # the next step fails, mid-stream
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert len(events) < 50  # ended by the failure, not by max_tokens
    assert "injected step failure" in caplog.text
    assert "stream of request" in caplog.text and "Traceback" in caplog.text
    assert _pool_whole(srv)
    assert _ok(srv)


def test_failing_step_gives_a_non_streaming_request_500(srv, monkeypatch):
    real_step, calls = srv.engine.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(srv.engine.engine, "step", step)
    with pytest.raises(openai.InternalServerError):
        srv.client.completions.create(model=MODEL, prompt=MARKER, max_tokens=50,
                                      extra_body={"ignore_eos": True})
    assert _pool_whole(srv)
    assert _ok(srv)


class _KillLoop(BaseException):
    """Not an Exception: the loop's guards do not catch it, so the thread ends."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_loop_thread_gives_503_at_once(srv):
    """Last in this module: it ends the loop thread."""
    def kill():
        raise _KillLoop()

    srv.engine._submit(kill)
    deadline = time.monotonic() + 10
    while srv.engine.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.engine.alive
    for method in ("GET", "HEAD"):
        assert httpx.request(method, srv.url + "/health", timeout=5).status_code == 503
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and time.monotonic() - t0 < 5
    assert r.json()["error"]["code"] == "shutting_down"


def test_stop_waits_for_the_grammar_compiler_still_starting():
    """A server stopped as soon as it starts (a SIGTERM at the first health check): the grammar
    compiler is still being built off the loop (xgrammar and transformers importing). stop()
    waits for it and closes it: no thread is left inside xgrammar's C++ when the interpreter
    exits, which aborted the process (exit -6, "terminate called without an active exception")."""
    config = ServerConfig(kv_cache_memory_bytes=64 << 20, max_model_len=512, kv_tiers="none")
    engine = AsyncEngine(LLMEngine(build_config(**config.engine_kwargs())), config.max_queue)
    engine.start()
    engine.stop()
    assert not [t for t in threading.enumerate() if t.name == "grammar-init"]
    book = engine.engine.grammar.built
    assert book is not None, "the grammar compiler was built by start()'s thread"
    with pytest.raises(Exception, match="stopped|closed"):
        book.compiler.submit(StructuredOutput.json_object(), None).result(timeout=10)
