"""The HTTP transport of `tierserve serve`: connections that never finish their request head are
closed (slowloris) while others are served, an oversized head gets 431 as JSON instead of a reset,
a percent-encoded API key never reaches the log, and a stream still running when the drain time
runs out ends with a shutting_down error event and [DONE]."""

from __future__ import annotations

import concurrent.futures
import json
import re
import select
import signal
import socket
import time
from urllib.parse import unquote

import httpx
import pytest

from server_fixtures import MODEL, run_server

KEY = "k-alpha-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("transport"), "--header-timeout-s",
                    str(HEADER_TIMEOUT_S), "--max-header-bytes", "16KiB", "--api-key", KEY,
                    "--log-level", "info") as s:
        yield s


def _address(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _watch(socks: list[socket.socket], slow: set[int], until: float, on_tick) -> dict[int, tuple]:
    """Send the next byte of a head on each open socket in `slow` every 0.5 s; for each socket,
    (seconds until the server closed it, what it sent first) once it closed."""
    start, first, done = time.monotonic(), {}, {}
    next_byte = start
    while len(done) < len(socks) and time.monotonic() < until:
        if time.monotonic() >= next_byte:
            for i in slow - done.keys():
                try:
                    socks[i].send(b"a")
                except OSError:  # the server is gone from it already: the reads below say how
                    pass
            next_byte += 0.5
            on_tick(time.monotonic() - start)
        open_ = [s for i, s in enumerate(socks) if i not in done]
        for s in select.select(open_, [], [], 0.1)[0]:
            i = socks.index(s)
            try:
                data = s.recv(4096)
            except ConnectionResetError:
                data = b""
            first.setdefault(i, data)
            if not data:
                done[i] = (time.monotonic() - start, first[i])
    return done


def test_slow_and_silent_connections_are_closed_while_others_are_served(server):
    socks = [socket.create_connection(_address(server)) for _ in range(25)]
    slow = set(range(20))  # these trickle a head byte by byte; the last 5 send nothing
    for i in slow:
        socks[i].send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    served = []

    def on_tick(elapsed: float) -> None:
        if 0.5 <= elapsed < 1.5:  # while the slow ones are held: a normal client is served
            served.append(httpx.get(server.v1 + "/models", headers=AUTH, timeout=5).status_code)

    try:
        done = _watch(socks, slow, time.monotonic() + HEADER_TIMEOUT_S + 4, on_tick)
    finally:
        for s in socks:
            s.close()
    assert served and set(served) == {200}
    assert sorted(done) == list(range(25)), f"still open: {sorted(set(range(25)) - set(done))}"
    for i, (after, first) in done.items():  # the trickle did not push the deadline back
        assert HEADER_TIMEOUT_S - 0.5 < after < HEADER_TIMEOUT_S + 2, (i, after)
        if i in slow:  # a client mid-head is told why
            assert first.startswith(b"HTTP/1.1 408 "), first
            assert b'"code": "request_timeout"' in first
        else:
            assert first == b""
    assert httpx.get(server.v1 + "/models", headers=AUTH, timeout=5).status_code == 200


@pytest.mark.parametrize("size", [20 << 10, 1 << 20])
def test_oversized_head_gets_431_as_json(server, size):
    """20 KiB comes in one read (h11 would let it through); 1 MiB in many (h11 stops reading
    it): both get the answer, not a reset, while the client is still sending."""
    r = httpx.get(server.v1 + "/models", headers={**AUTH, "X-Big": "a" * size}, timeout=10)
    assert r.status_code == 431
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] is None
    assert err["code"] == "request_header_too_large" and "16384 bytes" in err["message"]
    assert r.headers["connection"] == "close"
    assert httpx.get(server.v1 + "/models", headers=AUTH, timeout=5).status_code == 200


def test_percent_encoded_key_is_masked_in_the_access_log(server):
    encoded = ("k%2Dalpha%2D1", "k%2dalpha%2d1", "k%252Dalpha%252D1", "%6B-alpha-1")
    for spelling in encoded:
        r = httpx.get(server.v1 + f"/models?api_key={spelling}", timeout=5)
        assert r.status_code == 401
        r = httpx.get(server.v1 + f"/{spelling}", headers=AUTH, timeout=5)
        assert r.status_code == 404 and KEY not in r.text
    time.sleep(0.5)
    log = server.log()
    assert '"GET /v1/models?api_key=*** HTTP/1.1" 401' in log  # the lines are there, masked
    assert '"GET /v1/*** HTTP/1.1" 404' in log
    assert KEY not in unquote(unquote(log))
    assert not re.search(r"alpha%2d1", log, re.IGNORECASE)


def test_requests_cut_by_the_drain_timeout_end_with_an_error(tmp_path):
    """A stream gets an error event and [DONE]; a request waiting for its whole answer, a 503."""
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with run_server(tmp_path, "--drain-timeout-s", "3", "--log-level", "info") as srv:
        whole = concurrent.futures.ThreadPoolExecutor(1).submit(  # the same, not streamed
            httpx.post, srv.v1 + "/completions", json={**body, "stream": False}, timeout=60)
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=60) as r:
            lines = (x for x in r.iter_lines() if x)
            assert next(lines).startswith("data: {")
            srv.proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            rest = [x.removeprefix("data: ") for x in lines]
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "shutting_down" and err["type"] == "server_error"
        assert "shutting down" in err["message"]
        assert len(rest) > 3  # tokens kept coming while the server drained
        answer = whole.result(30)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "shutting_down"
        assert srv.proc.wait(3 + 10) == 0 and time.monotonic() - stopped < 3 + 10
        log = srv.log()
        assert "Traceback" not in log and "drain time is up" in log
