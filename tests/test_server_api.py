"""The HTTP server end to end: a real `tierserve serve` process driven by the openai client."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

import tierserve
from server_fixtures import API_KEY, MODEL, run_server, scrape

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("srv"), "--api-key", API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def _post(server, path: str, body, headers=None, raw: bytes | None = None) -> httpx.Response:
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers=h, timeout=120)


def _greedy(client, prompt=PROMPT, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                     max_tokens=kw.pop("max_tokens", 12), **kw)


# ---- happy paths -------------------------------------------------------------------------------


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 2048
    assert client.models.retrieve(MODEL) == models[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "`org/other-model` does not exist" in e.value.body["message"]
    r = httpx.get(server.base_url + "/version", timeout=30,
                  headers={"Authorization": f"Bearer {API_KEY}", "Origin": "https://ui.example"})
    assert r.status_code == 200 and r.json() == {"version": tierserve.__version__}
    assert "access-control-allow-origin" not in r.headers  # no --allowed-origins: no CORS


def test_completion_usage_and_finish(client):
    r = _greedy(client, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    c = r.choices[0]
    assert c.text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == 13
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # 5 tokens: no full 16-token block


def test_cached_tokens_count_the_prefix_hit(client, server):
    prompt = "cached tokens " * 20
    n = len(_post(server, "/tokenize", {"prompt": prompt}).json()["tokens"])
    assert n > 32
    first = _greedy(client, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "ct"})
    second = _greedy(client, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "ct"})
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full 16-token block but one that would hold the last prompt token (always computed)
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


def test_stream_equals_non_stream(client):
    full = _greedy(client, max_tokens=16).choices[0]
    chunks = list(_greedy(client, max_tokens=16, stream=True))
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_n2_and_seed_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, n=2, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # choice j samples with seed + j
    assert a.usage.completion_tokens == 20
    assert a.usage.prompt_tokens == 5  # the prompt counts once for n choices


def test_logprobs(client):
    r = _greedy(client, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy took the best token
    assert lp.text_offset[0] == 0


def test_echo_with_logprobs(client):
    r = _greedy(client, max_tokens=4, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    assert c.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(c.logprobs.tokens) == 5 + 4


def test_stop_string_spanning_tokens(client):
    full = _greedy(client, max_tokens=16, logprobs=0).choices[0]
    toks = full.logprobs.tokens
    # A stop string made of the last 2 chars of one token and the first 2 chars of the next.
    k = next(i for i in range(1, len(toks) - 1) if len(toks[i]) >= 2 and len(toks[i + 1]) >= 2)
    stop = toks[k][-2:] + toks[k + 1][:2]
    cut = full.text.index(stop)
    r = _greedy(client, max_tokens=16, stop=[stop]).choices[0]
    assert r.text == full.text[:cut]
    assert r.finish_reason == "stop" and r.model_extra["stop_reason"] == stop
    streamed = "".join(ch.choices[0].text for ch in _greedy(client, max_tokens=16, stop=stop,
                                                             stream=True))
    assert streamed == full.text[:cut]


def test_include_usage(client):
    chunks = list(_greedy(client, max_tokens=5, stream=True, extra_body={"ignore_eos": True},
                          stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + \
        chunks[-1].usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_token_id_prompts_and_prompt_lists(client, server):
    ids = _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    text = _greedy(client).choices[0].text
    assert _greedy(client, prompt=ids).choices[0].text == text
    other = "Once upon a time"
    r = _greedy(client, prompt=[PROMPT, other])
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == text
    assert r.choices[1].text == _greedy(client, prompt=other).choices[0].text
    r2 = _greedy(client, prompt=[ids, ids])
    assert [c.text for c in r2.choices] == [text, text]


def test_tokenize_round_trip(server):
    text = "Hello, wörld! 你好 🙂"
    t = _post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 2048
    d = _post(server, "/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json()
    assert d["prompt"] == text
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_chat(client):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                                 max_completion_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_n2_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, n=2, seed=7, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert "".join(t.token for t in content) == c.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_request_id_header(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1},
              headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert len(r.headers["x-request-id"]) >= 16


# ---- bad input ---------------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

BAD = [  # (id, path, body or raw bytes, headers, status, words in the message)
    ("wrong-type-max-tokens", C, {**OK, "max_tokens": "many"}, None, 400, ["max_tokens"]),
    ("wrong-type-prompt", C, {**OK, "prompt": {"a": 1}}, None, 400, ["prompt"]),
    ("temperature-range", C, {**OK, "temperature": -1}, None, 400, ["temperature", "[0, 100]"]),
    ("top-p-range", C, {**OK, "top_p": 0}, None, 400, ["top_p", "(0, 1]"]),
    ("n-zero", C, {**OK, "n": 0}, None, 400, ["n must be in [1, 16]"]),
    ("n-huge", C, {**OK, "n": 10**9}, None, 400, ["n must be in [1, 16]"]),
    ("logprobs-range", C, {**OK, "logprobs": 50}, None, 400, ["logprobs", "[0, 20]"]),
    ("penalty-range", C, {**OK, "presence_penalty": 3}, None, 400, ["presence_penalty", "[-2, 2]"]),
    ("empty-prompt", C, {**OK, "prompt": ""}, None, 400, ["prompt must not be empty"]),
    ("empty-prompt-list", C, {**OK, "prompt": []}, None, 400, ["prompt must not be empty"]),
    ("prompt-over-context", C, {**OK, "prompt": "hello " * 2100}, None, 400,
     ["prompt has", "2048"]),
    ("max-tokens-over-context", C, {**OK, "max_tokens": 5000}, None, 400,
     ["max_tokens", "2048"]),
    ("token-id-range", C, {**OK, "prompt": [1, 99999999]}, None, 400, ["token id 99999999"]),
    ("logit-bias-key", C, {**OK, "logit_bias": {"x": 1}}, None, 400, ["logit_bias"]),
    ("stop-empty", C, {**OK, "stop": [""]}, None, 400, ["stop"]),
    ("min-tokens", C, {**OK, "min_tokens": 5}, None, 400, ["min_tokens", "max_tokens"]),
    ("missing-model", C, {"prompt": "hi"}, None, 400, ["model"]),
    ("unknown-model", C, {**OK, "model": "gpt-17"}, None, 404, ["gpt-17", "does not exist"]),
    ("malformed-json", C, b'{"model": "x", "prompt": ', None, 400, ["malformed JSON"]),
    ("bad-api-key", C, OK, {"Authorization": "Bearer nope"}, 401, ["API key incorrect"]),
    ("missing-api-key", C, OK, {"Authorization": ""}, 401, ["API key missing"]),
    ("body-too-large", C, {**OK, "user": "x" * (5 << 20)}, None, 413, ["exceeds the limit"]),
    ("chat-tools", CH, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, None,
     400, ["tools[0] must be"]),
    ("chat-json-format", CH, {"model": MODEL, "messages": MSG,
                              "response_format": {"type": "yaml"}}, None, 400,
     ["response_format.type", "json_object"]),
    ("chat-tool-turn", CH, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, None,
     400, ["tool_call_id is required"]),
    ("chat-bad-role", CH, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, None,
     400, ["role 'robot'"]),
    ("chat-empty-messages", CH, {"model": MODEL, "messages": []}, None, 400, ["messages"]),
    ("chat-top-logprobs", CH, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, None, 400,
     ["top_logprobs requires logprobs"]),
    ("chat-image", CH, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, ["only text parts"]),
    ("unknown-route", "/v1/nothing", OK, None, 404, ["Not Found"]),
    ("detokenize-range", "/detokenize", {"tokens": [-1]}, None, 400, ["token id -1"]),
]


@pytest.mark.parametrize("path,body,headers,status,words", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input(server, path, body, headers, status, words):
    raw = body if isinstance(body, bytes) else None
    r = _post(server, path, body, headers=headers, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err
    assert "Traceback" not in r.text and 'File "' not in r.text


def test_serves_after_bad_input(client):
    assert _greedy(client, max_tokens=3).choices[0].text


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-3)
    assert e.value.body["param"] == "temperature"


# ---- what third-party clients (guidellm, aiperf) showed ------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head_probes_answer_like_get(server, path):
    r = httpx.head(server.base_url + path, timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(server.base_url + path, timeout=10).status_code == 200


def _sse(server, path: str, body: dict) -> list[dict]:
    h = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.base_url + path, json={"model": MODEL, **body}, headers=h,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in lines[:-1]]


@pytest.mark.parametrize("path,body", [
    (C, {"prompt": PROMPT}),
    (CH, {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_continuous_usage_stats_puts_usage_on_every_chunk(server, path, body):
    chunks = _sse(server, path, {**body, "max_tokens": 6, "ignore_eos": True, "stream": True,
                                 "temperature": 0, "stream_options": {
                                     "include_usage": True, "continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    assert [u["completion_tokens"] for u in usages[-7:]] == [1, 2, 3, 4, 5, 6, 6]
    assert chunks[-1]["choices"] == []
    assert len({u["prompt_tokens"] for u in usages}) == 1


def test_chat_deltas_leave_unset_fields_out(server):
    chunks = _sse(server, CH, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                               "stream": True, "temperature": 0})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    for d in deltas[1:]:
        assert "role" not in d and None not in d.values(), d


def test_one_chunk_per_token(server):
    """A token whose text is complete gets a chunk of its own; chunks merge only where text must
    be held back (an unfinished UTF-8 sequence, a possible stop string) or a token has no text
    (a special token with skip_special_tokens)."""
    chunks = _sse(server, C, {"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True,
                              "stream": True, "temperature": 0, "logprobs": 0})
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks] == [1] * 32


# ---- metrics and disconnects -------------------------------------------------------------------


def test_metrics_move(client, server):
    prompt = "metrics " * 40  # > 2 full KV blocks, so the prefix cache is asked (and hit)
    before = scrape(server)
    for _ in range(2):
        list(_greedy(client, prompt=prompt, max_tokens=4, stream=True,
                     extra_body={"ignore_eos": True}))
    after = scrape(server)
    for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:request_success_total{finished_reason=length}"):
        assert after[name] > before[name], name
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert after[name + "_count"] == before[name + "_count"] + 2, name
    assert after["vllm:request_generation_tokens_sum"] == before["vllm:request_generation_tokens_sum"] + 8
    assert after["vllm:request_prompt_tokens_sum"] >= before["vllm:request_prompt_tokens_sum"] + 80
    assert after["vllm:iteration_tokens_total_count"] >= before["vllm:iteration_tokens_total_count"] + 8
    assert after["vllm:iteration_tokens_total_sum"] > before["vllm:iteration_tokens_total_sum"]
    assert "vllm:num_preemptions_total" in after
    assert after["vllm:inter_token_latency_seconds_count"] >= before[
        "vllm:inter_token_latency_seconds_count"] + 3
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert name in after


def _wait_all_free(server, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        if m["tierserve:kv_cache_blocks_free"] == m["tierserve:kv_cache_blocks_total"] and \
                m["vllm:num_requests_running"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": "word " * 300, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    h = {"Authorization": f"Bearer {API_KEY}"}
    aborted = scrape(server).get("vllm:request_success_total{finished_reason=abort}", 0)
    with httpx.stream("POST", server.base_url + C, json=body, headers=h, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
        m = scrape(server)
        assert m["vllm:num_requests_running"] == 1
        assert m["tierserve:kv_cache_blocks_free"] < m["tierserve:kv_cache_blocks_total"]
    m = _wait_all_free(server)
    assert m["tierserve:kv_cache_blocks_free"] == m["tierserve:kv_cache_blocks_total"]
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:request_success_total{finished_reason=abort}"] == aborted + 1


def test_disconnect_non_streaming_frees_blocks(server):
    """The request held blocks while it ran; the client's timeout aborted it and freed them."""
    body = {"model": MODEL, "prompt": "word " * 300, "max_tokens": 1500, "ignore_eos": True}
    h = {"Authorization": f"Bearer {API_KEY}"}
    aborted = scrape(server).get("vllm:request_success_total{finished_reason=abort}", 0)
    held = []

    def watch() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not held:
            m = scrape(server)
            if m["vllm:num_requests_running"] == 1:
                held.append(m["tierserve:kv_cache_blocks_total"] - m["tierserve:kv_cache_blocks_free"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + C, json=body, headers=h, timeout=3)
    watcher.join()
    assert held and held[0] >= 300 // 16  # the prompt's blocks at least
    m = _wait_all_free(server)
    assert m["tierserve:kv_cache_blocks_free"] == m["tierserve:kv_cache_blocks_total"]
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:request_success_total{finished_reason=abort}"] == aborted + 1


# ---- streaming equals the offline engine, under load --------------------------------------------


def test_64_concurrent_streams_equal_offline_engine(server):
    from tierserve.engine import LLM, SamplingParams

    prompts = [f"Question {i}: what is {i} plus {i * 3}? Answer:" if i % 2 else
               f"Write a short line about the number {i}." for i in range(64)]
    llm = LLM(kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    offline = [o.outputs[0].text for o in
               llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))]
    del llm
    aclient = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)

    async def one(p: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=16,
                                                  temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def all_() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    served = asyncio.run(all_())
    mismatched = [i for i, (a, b) in enumerate(zip(served, offline)) if a != b]
    assert not mismatched, [(served[i], offline[i]) for i in mismatched[:3]]
