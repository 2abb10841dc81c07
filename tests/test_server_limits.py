"""A deliberately small server: fuzzing finds no 5xx, a full queue gets 429, SIGTERM drains; and
the limits a server takes from its settings (prompt tokens, max_tokens, body bytes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import MODEL, run_server, scrape

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    # max_num_seqs 2 + max_queue 0: a third engine request in flight gets 429.
    with run_server(tmp_path_factory.mktemp("small"), "--max-model-len", "64", "--max-num-seqs",
                    "2", "--max-queue", "0", "--max-n", "2", "--max-prompts", "2") as s:
        yield s


def _long_stream(server, n: int = 2, max_tokens: int = 50):
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True,
            "n": n, "stream": True, "temperature": 0}
    return httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120)


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(small, tmp_path):
    """A bounded, seeded schemathesis run on every POST endpoint of /openapi.json."""
    st = Path(sys.executable).parent / "schemathesis"
    if not st.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    env = dict(os.environ, PYTHONPATH=str(TESTS), SCHEMATHESIS_HOOKS="server_schemathesis_hooks")
    cmd = [str(st), "run", small.base_url + "/openapi.json", "--include-method", "POST",
           "-c", "not_a_server_error", "-n", "15", "--seed", "1", "--request-timeout", "60",
           "--no-color", "--generation-database", "none"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "passed" in r.stdout
    assert "Traceback" not in small.log()


def test_queue_full_gets_429_with_retry_after(small):
    with _long_stream(small) as busy:
        lines = busy.iter_lines()
        next(lines)  # the server admitted both choices and is streaming
        r = httpx.post(small.base_url + "/v1/completions",
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert "at capacity" in err["message"] and "limit is 2" in err["message"]
        assert err["code"] == "queue_full"
        rest = [x for x in lines if x]
    assert rest[-1] == "data: [DONE]"
    r = httpx.post(small.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200  # serves normally once the queue has room


def test_never_admissible_request_is_400_naming_n(small):
    """2 prompts x n=2 = 4 sequences, but the server holds 2 (max_num_seqs 2 + max_queue 0): no
    retry can succeed, so it is a 400 naming n on an idle server, not a 429 with Retry-After."""
    url = small.base_url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": ["hi", "yo"], "n": 2, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == "never_admissible"
    assert "4 sequences" in err["message"] and "at most 2" in err["message"]
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_sigterm_drains_in_flight_and_exits_0(small):
    """Last in this module: it stops the server."""
    with _long_stream(small, n=1, max_tokens=40) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: {")
        small.proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]  # the in-flight stream still completes
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in x for x in rest)
    assert small.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(small.base_url + "/health", timeout=5)


# ---- limits from settings: prompt tokens, max_tokens, body size ----------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("limited"), "--max-prompt-tokens", "32",
                    "--max-tokens-limit", "8", "--max-body-bytes", "16KiB") as s:
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def _bad(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def test_prompt_over_max_prompt_tokens_is_400_naming_it(limited):
    client = _client(limited)
    at_limit, over = list(range(100, 132)), list(range(100, 133))
    ok = client.completions.create(model=MODEL, prompt=at_limit, max_tokens=1)
    assert ok.usage.prompt_tokens == 32
    err = _bad(lambda: client.completions.create(model=MODEL, prompt=over, max_tokens=1))
    assert err["param"] == "prompt" and err["code"] == "invalid_value"
    assert "33 tokens" in err["message"] and "at most 32" in err["message"]
    err = _bad(lambda: client.completions.create(model=MODEL, prompt=[at_limit, over],
                                                 max_tokens=1))
    assert err["param"] == "prompt" and err["message"].startswith("prompt[1] has 33 tokens")
    long_chat = [{"role": "user", "content": "Tell me about the sea and the sky."}]  # 39 tokens
    err = _bad(lambda: client.chat.completions.create(model=MODEL, messages=long_chat,
                                                      max_tokens=1))
    assert err["param"] == "messages" and "39 tokens" in err["message"]


def test_max_tokens_over_the_limit_is_400_with_the_range(limited):
    client = _client(limited)
    msgs = [{"role": "user", "content": "Hi"}]  # 31 tokens with the template's system prompt
    err = _bad(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=9))
    assert err["param"] == "max_tokens" and "[1, 8]" in err["message"]
    for field in ("max_tokens", "max_completion_tokens"):
        err = _bad(lambda: client.chat.completions.create(model=MODEL, messages=msgs,
                                                          **{field: 9}))
        assert err["param"] == field and "[1, 8]" in err["message"]
    at_limit = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8,
                                         extra_body={"ignore_eos": True})
    assert at_limit.usage.completion_tokens == 8
    # A request that names no max_tokens is capped: the completions default (16) and chat's
    # "up to the context" both stop at the limit instead of failing.
    plain = client.completions.create(model=MODEL, prompt="Hi", extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=MODEL, messages=msgs,
                                          extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == chat.usage.completion_tokens == 8
    assert plain.choices[0].finish_reason == chat.choices[0].finish_reason == "length"


def test_body_over_max_body_bytes_is_413_with_or_without_a_length(limited):
    url = limited.v1 + "/completions"
    counted = scrape(limited).get('tierserve:http_errors_total{status=413}', 0.0)
    big = json.dumps({"model": MODEL, "prompt": "hi", "user": "x" * (17 << 10)}).encode()
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "16384 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit counts the bytes as they arrive
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=30)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert scrape(limited)['tierserve:http_errors_total{status=413}'] == counted + 2  # both counted
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                              "user": "x" * (15 << 10)}, timeout=30)
    assert r.status_code == 200, r.text
