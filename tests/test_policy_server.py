"""Per-request KV hints through the HTTP server: headers and vLLM's kv_transfer_params with the
official openai client (extra_headers, extra_body) and raw HTTP; the X-KV-Policy and
X-KV-Hit-Tokens response headers, the final chunk of a stream, the body echo, server defaults,
and a 400 naming the header or field for each bad value."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from server_fixtures import MODEL, run_server, scrape

PROMPT = "The history of the Roman Empire, told in one long paragraph: " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy")
    with run_server(tmp, "--kv-tiers", "cpu,disk", "--disk-tier-dir", str(tmp / "kv"),
                    "--default-kv-store-tiers", "disk") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def _raw_completion(client, **kw):
    return client.completions.with_raw_response.create(
        model=MODEL, prompt=kw.pop("prompt", PROMPT), max_tokens=4, temperature=0, **kw)


def test_headers_steer_the_tiers_and_the_response_says_so(client):
    """The headers always; the body's echo only for a request that sent kv_transfer_params
    (vLLM's rule: `{}` asks for it)."""
    headers = {"X-KV-Load-Tiers": "disk", "X-KV-Store-Tiers": "cpu,disk"}
    plain = _raw_completion(client, extra_headers=headers)
    assert plain.headers["x-kv-policy"] == "load=disk; store=cpu,disk"
    assert "kv_transfer_params" not in json.loads(plain.text)
    r = _raw_completion(client, extra_headers=headers, extra_body={"kv_transfer_params": {}})
    assert r.headers["x-kv-policy"] == "load=disk; store=cpu,disk"
    hits = dict(kv.split("=") for kv in r.headers["x-kv-hit-tokens"].split(","))
    assert set(hits) == {"device", "cpu", "disk"}
    body = r.parse()
    echo = body.model_extra["kv_transfer_params"]
    assert [m["name"] for m in echo["kv_load_tiers"]] == ["disk"]
    assert echo["kv_store_tiers"][0] == {"medium": "CPU", "locality": "LOCAL", "name": "cpu"}
    assert echo["kv_policy"] == r.headers["x-kv-policy"]


def test_server_defaults_apply_to_requests_that_send_no_hints(client):
    r = _raw_completion(client, prompt="defaults " * 40)
    assert r.headers["x-kv-policy"].startswith("load=cpu,disk; store=disk")


def test_each_header_not_sent_keeps_the_servers_default(server, client):
    """The defaults merge field by field: a budget alone keeps the default store tiers; an
    explicit X-KV-Store-Tiers: none stores nowhere (the disk tier's stored-block count stays)."""
    r = _raw_completion(client, prompt="budget only " * 40,
                        extra_headers={"X-SLO-TTFT-Ms": "5000"})
    assert r.headers["x-kv-policy"].split("; ")[1] == "store=disk"

    def stored() -> float:
        return scrape(server).get('tierserve:kv_tier_stored_blocks_total{tier=disk}', 0.0)
    before = stored()
    r = _raw_completion(client, prompt="stored nowhere " * 40,
                        extra_headers={"X-KV-Store-Tiers": "none"})
    assert r.headers["x-kv-policy"].split("; ")[1] == "store=none"
    time.sleep(0.5)  # stores are asynchronous: give one the time to show
    assert stored() == before


def test_a_server_with_no_flags_answers_the_readme_tier_example(plain_server, tmp_path):
    """No tier flags: cpu and disk run (README's example as written); --kv-tiers none: off."""
    headers = {"X-SLO-Class": "interactive", "X-SLO-TTFT-Ms": "500",
               "X-KV-Store-Tiers": "cpu,disk"}
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8}
    r = httpx.post(plain_server.v1 + "/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-policy"] == "load=cpu,disk; store=cpu,disk"
    assert r.headers["x-kv-hit-tokens"] == "device=0,cpu=0,disk=0"
    with run_server(tmp_path, "--kv-tiers", "none") as off:
        r = httpx.post(off.v1 + "/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-KV-Store-Tiers"


def test_vllm_body_matchers_with_the_openai_client(client):
    r = _raw_completion(client, extra_body={"kv_transfer_params": {
        "kv_load_tiers": [{"medium": "STORAGE"}], "kv_store_tiers": [],
        "max_load_tokens": 64, "max_offload_tokens": 0}})
    assert r.headers["x-kv-policy"].startswith("load=disk; store=none")
    echo = r.parse().model_extra["kv_transfer_params"]
    assert echo["max_load_tokens"] == 64 and echo["kv_store_tiers"] == []


def test_a_repeated_prompt_reports_its_device_hit(client):
    prompt = "A repeated prompt that no other test sends, " * 8
    first = _raw_completion(client, prompt=prompt)
    second = _raw_completion(client, prompt=prompt)
    usage = second.parse().usage
    hits = dict(kv.split("=") for kv in second.headers["x-kv-hit-tokens"].split(","))
    assert int(hits["device"]) == usage.prompt_tokens_details.cached_tokens > 0
    assert first.parse().usage.prompt_tokens_details.cached_tokens == 0


def _stream_chunks(server, body: dict, headers: dict) -> list[dict]:
    with httpx.stream("POST", server.v1 + "/completions", json=body, headers=headers,
                      timeout=60) as r:
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_a_stream_carries_the_facts_in_its_final_chunk(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0}
    headers = {"X-KV-Load-Tiers": "cpu", "X-SLO-Class": "batch"}
    assert all("kv_transfer_params" not in c for c in _stream_chunks(server, body, headers))
    chunks = _stream_chunks(server, body | {"kv_transfer_params": {}}, headers)
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and all("kv_transfer_params" not in c
                                   for c in chunks if c is not final[0])
    echo = final[0]["kv_transfer_params"]
    assert echo["kv_policy"].startswith("load=cpu; store=disk")  # the default store: disk
    assert set(echo["kv_hit_tokens"]) == {"device", "cpu", "disk"}


def test_chat_stream_with_the_openai_client(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=3,
        stream=True, extra_headers={"X-SLO-Class": "interactive", "X-SLO-TTFT-Ms": "2000"},
        extra_body={"kv_transfer_params": {}})
    chunks = list(stream)
    echo = [c.model_extra.get("kv_transfer_params") for c in chunks]
    assert echo[-1] is not None and echo[-1]["kv_policy"].startswith("load=cpu,disk; store=disk")
    assert all(e is None for e in echo[:-1])


@pytest.mark.parametrize("headers,extra_body,param", [
    ({"X-KV-Load-Tiers": "s3"}, None, "X-KV-Load-Tiers"),  # not configured here
    ({"X-KV-Store-Tiers": "cpu;disk"}, None, "X-KV-Store-Tiers"),
    ({"X-SLO-TTFT-Ms": "-1"}, None, "X-SLO-TTFT-Ms"),
    ({"X-SLO-Class": "realtime"}, None, "X-SLO-Class"),
    ({}, {"kv_transfer_params": {"max_load_tokens": -3}}, "kv_transfer_params.max_load_tokens"),
    ({}, {"kv_transfer_params": {"kv_load_tiers": [{"medium": "HBM"}]}},
     "kv_transfer_params.kv_load_tiers[0].medium"),
    ({"X-KV-Load-Tiers": "cpu"}, {"kv_transfer_params": {"kv_load_tiers": []}},
     "kv_transfer_params.kv_load_tiers"),
])
def test_bad_hints_are_400_naming_the_header_or_field(client, headers, extra_body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_headers=headers,
                                  extra_body=extra_body)
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_raw_http_bad_header_and_the_server_keeps_serving(server, client):
    r = httpx.post(server.v1 + "/chat/completions", headers={"X-SLO-TTFT-Ms": "soon"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-SLO-TTFT-Ms"
    assert "Traceback" not in r.text
    assert _raw_completion(client).parse().choices[0].text


def test_policy_decisions_are_counted_in_metrics(server, client):
    from server_fixtures import scrape

    before = scrape(server).get("tierserve:kv_policy_decisions_total{outcome=loads_chosen}", 0)
    _raw_completion(client, prompt="counted " * 50, extra_headers={"X-KV-Load-Tiers": "cpu"})
    after = scrape(server)
    assert after["tierserve:kv_policy_decisions_total{outcome=loads_chosen}"] == before + 1
    for outcome in ("skipped_budget", "skipped_cost", "skipped_short", "abandoned"):
        assert f"tierserve:kv_policy_decisions_total{{outcome={outcome}}}" in after
