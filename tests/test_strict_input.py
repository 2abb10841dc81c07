"""Strict input over real HTTP (issues #41 item 5 and #40 item 6): wrong JSON types are 400
`invalid_type` naming the field, never converted; `null` means the default; token ids and KV token
counts are range-checked; a body that trickles in gets 408; a body is read as JSON whatever its
Content-Type says; unknown routes have a code; the kv_transfer_params echo comes only to a request
that sent kv_transfer_params. One server for the whole file."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from server_fixtures import MODEL, ROOT, run_server

HEADER_TIMEOUT_S = 2.0
C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("strict"), "--header-timeout-s",
                    str(HEADER_TIMEOUT_S)) as s:
        yield s


def _post(server, path: str, body=None, *, raw: bytes | None = None,
          headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"Content-Type": "application/json"} if headers is None else headers
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers=h, timeout=120)


def _error(r: httpx.Response, status: int, param: str | None, code: str) -> dict:
    """The OpenAI error body of `r`, checked: status, param, code, the field named."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code, err
    if param is not None:
        assert re.search(rf"\b{re.escape(param.split('.')[-1].split('[')[0])}\b",
                         err["message"]), err
    assert "Traceback" not in r.text
    return err


# ---- null means the default ----------------------------------------------------------------------


def test_null_max_tokens_is_the_completions_default_of_16(server):
    r = _post(server, C, {**OK, "max_tokens": None, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_null_fields_are_left_out_on_chat_too(server):
    r = _post(server, CH, {"model": MODEL, "messages": MSG, "max_tokens": None,
                           "max_completion_tokens": 3, "ignore_eos": True, "n": None,
                           "stream": None, "logprobs": None, "temperature": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and len(r.json()["choices"]) == 1


def test_a_required_field_sent_as_null_is_still_an_error(server):
    _error(_post(server, C, {**OK, "model": None}), 400, "model", "invalid_type")


# ---- types are strict ----------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param,words", [
    (C, {**OK, "max_tokens": "5"}, "max_tokens", ['expected an integer', 'a string ("5")']),
    (C, {**OK, "max_tokens": 5.0}, "max_tokens", ["expected an integer", "a number (5.0)"]),
    (C, {**OK, "stream": "yes"}, "stream", ["expected a boolean", '"yes"']),
    (C, {**OK, "echo": 1}, "echo", ["expected a boolean", "an integer (1)"]),
    (C, {**OK, "temperature": "0.5"}, "temperature", ["expected a number"]),
    (C, {**OK, "seed": "7"}, "seed", ["expected an integer"]),
    (C, {**OK, "stop_token_ids": [2.0]}, "stop_token_ids[0]", ["expected an integer"]),
    (C, {**OK, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     ["expected a boolean"]),
    (CH, {"model": MODEL, "messages": MSG, "logprobs": 1}, "logprobs", ["expected a boolean"]),
    (CH, {"model": MODEL, "messages": MSG, "n": "2"}, "n", ["expected an integer"]),
    ("/detokenize", {"tokens": [1.0]}, "tokens[0]", ["expected an integer", "a number (1.0)"]),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens",
     ["expected a boolean"]),
])
def test_wrong_json_types_are_invalid_type_naming_the_field(server, path, body, param, words):
    err = _error(_post(server, path, body), 400, param, "invalid_type")
    for w in words:
        assert w in err["message"], err


def test_an_integer_is_a_number(server):
    r = _post(server, C, {**OK, "temperature": 1, "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text


# ---- ranges --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 10**15])
def test_stop_token_ids_out_of_range(server, bad):
    err = _error(_post(server, C, {**OK, "stop_token_ids": [2, bad]}), 400, "stop_token_ids",
                 "invalid_value")
    assert f"token id {bad} is out of range [0, " in err["message"], err


def test_stop_token_ids_in_range_are_served(server):
    assert _post(server, C, {**OK, "stop_token_ids": [0, 2]}).status_code == 200


@pytest.mark.parametrize("key", ["max_load_tokens", "max_offload_tokens"])
def test_kv_token_counts_are_bounded_by_the_context(server, key):
    param = f"kv_transfer_params.{key}"
    err = _error(_post(server, C, {**OK, "kv_transfer_params": {key: 10**30}}), 400, param,
                 "invalid_value")
    assert "[0, 2048]" in err["message"] and "31 digits" in err["message"], err
    _error(_post(server, C, {**OK, "kv_transfer_params": {key: "5"}}), 400, param,
           "invalid_type")
    assert _post(server, C, {**OK, "kv_transfer_params": {key: 2048}}).status_code == 200


@pytest.mark.parametrize("value,word", [("none,cpu", "none"), ("cpu, all", "all")])
def test_none_and_all_stand_alone_in_a_tier_header(server, value, word):
    err = _error(_post(server, C, OK, headers={"X-KV-Load-Tiers": value}), 400,
                 "X-KV-Load-Tiers", "invalid_value")
    assert f"{word} cannot be combined with tier names" in err["message"], err
    assert "unknown tier" not in err["message"]


# ---- the body as a whole -------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"null"])
def test_an_empty_body_says_so(server, raw):
    err = _error(_post(server, C, raw=raw), 400, None, "invalid_json")
    assert err["message"].startswith("the request body is empty"), err
    assert "None" not in err["message"]


def test_a_body_that_is_not_an_object_says_so(server):
    err = _error(_post(server, C, raw=b"[1, 2]"), 400, None, "invalid_type")
    assert err["message"] == "the request body must be a JSON object, got an array"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded",
                                          "text/plain", "application/json; charset=utf-8"])
def test_a_json_body_is_json_whatever_the_content_type(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = _post(server, C, OK, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_names_the_content_type(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = _post(server, C, raw=b"model=smollm2-135m&prompt=Hello", headers=headers)
    err = _error(r, 400, "Content-Type", "invalid_content_type")
    assert "application/json" in err["message"], err


def _address(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _head(length: int) -> bytes:
    return (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_that_trickles_in_gets_408(server):
    """One byte every 0.25 s after a whole head: refused once header_timeout_s has passed, not
    held for as long as the client keeps sending."""
    body = json.dumps(OK).encode().ljust(400)
    with socket.create_connection(_address(server)) as s:
        s.sendall(_head(len(body)))
        s.settimeout(0.25)
        start, answer, sent = time.monotonic(), b"", 0
        while time.monotonic() - start < HEADER_TIMEOUT_S + 6:
            try:
                s.send(body[sent:sent + 1])
                sent += 1
                data = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            answer += data
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert HEADER_TIMEOUT_S - 0.5 < took < HEADER_TIMEOUT_S + 4, took
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and "request body" in error["message"], error
    assert _post(server, C, OK).status_code == 200  # and the server goes on


def test_a_body_that_comes_steadily_is_served(server):
    """A body in pieces over longer than header_timeout_s, at well over the minimum rate."""
    body = json.dumps({**OK, "pad": "x" * 6000}).encode()
    with socket.create_connection(_address(server)) as s:
        s.sendall(_head(len(body)))
        for i in range(0, len(body), 1000):
            s.sendall(body[i:i + 1000])
            time.sleep(0.4)  # 2,500 bytes/s for about 2.8 s
        s.settimeout(60)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


# ---- errors of the server's own ------------------------------------------------------------------


def test_unknown_route_and_method_have_codes(server):
    _error(_post(server, "/v1/nothing", OK), 404, None, "not_found")
    r = httpx.get(server.base_url + C, timeout=30)
    _error(r, 405, None, "method_not_allowed")


# ---- the kv_transfer_params echo, only when asked ------------------------------------------------


def test_kv_transfer_params_echo_only_for_a_request_that_sent_them(server):
    plain = _post(server, C, OK)
    assert plain.status_code == 200 and "kv_transfer_params" not in plain.json()
    assert plain.headers["x-kv-policy"].startswith("load=")  # the headers come either way
    asked = _post(server, C, {**OK, "kv_transfer_params": {}}).json()["kv_transfer_params"]
    assert asked["kv_policy"].startswith("load=") and "kv_hit_tokens" in asked
    chat = _post(server, CH, {"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert "kv_transfer_params" not in chat.json()


def _chunks(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as r:
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_a_stream_has_no_null_kv_transfer_params(server):
    body = {**OK, "max_tokens": 3, "stream": True}
    assert all("kv_transfer_params" not in c for c in _chunks(server, body))
    chunks = _chunks(server, {**body, "kv_transfer_params": {}})
    with_echo = [c for c in chunks if "kv_transfer_params" in c]
    assert len(with_echo) == 1 and with_echo[0]["choices"][0]["finish_reason"] is not None


# ---- docs match /metrics -------------------------------------------------------------------------


def test_speculative_doc_names_the_counters_as_exported(server):
    """Prometheus counters are scraped with `_total`; the docs name them that way (a counter
    with no sample yet, per position, still has its family)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    counters = {f.name + "_total" for f in text_string_to_metric_families(text)
                if f.type == "counter"}
    for page in ("speculative.md", "metrics.md"):
        named = set(re.findall(r"`(vllm:spec_decode_[a-z_]+)`", (ROOT / "docs" / page).read_text()))
        assert len(named) == 4 and named <= counters, (page, named - counters)
