"""KV tiers through `tierserve serve`: a restarted server finds on disk what the last run stored,
two servers on one bucket share blocks, and /metrics and usage show the hits per tier."""

from __future__ import annotations

import time
import uuid

import httpx

from s3_fixtures import BUCKET
from server_fixtures import MODEL, run_server, scrape

PROMPT_LEN = 600  # past the policy's 512-token floor for remote tiers (s3)
HIT_TOKENS = (PROMPT_LEN - 1) // 16 * 16


def _complete(server, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _stored(server, tier: str, blocks: int, timeout: float = 30) -> dict:
    """/metrics once the tier holds `blocks` blocks and no write is queued."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        done = m.get(f"tierserve:kv_tier_stored_blocks_total{{tier={tier}}}", 0) >= blocks and \
            m.get(f"tierserve:kv_tier_queued_writes{{tier={tier}}}", 1) == 0
        if done or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_restarted_server_serves_the_prefix_from_disk(tmp_path, corpus_ids):
    prompt = corpus_ids[:PROMPT_LEN]
    flags = ("--kv-tiers", "disk", "--disk-tier-dir", str(tmp_path / "kv"))
    with run_server(tmp_path, *flags) as first:
        cold = _complete(first, prompt)
        m = _stored(first, "disk", PROMPT_LEN // 16)
        assert m["tierserve:kv_tier_stored_blocks_total{tier=disk}"] >= PROMPT_LEN // 16
        assert m["tierserve:kv_tier_used_bytes{tier=disk}"] > 0
    with run_server(tmp_path, *flags) as second:
        warm = _complete(second, prompt)
        m = scrape(second)
    assert _cached(cold) == 0 and _cached(warm) == HIT_TOKENS
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert m["tierserve:kv_tier_hit_blocks_total{tier=disk}"] == HIT_TOKENS // 16
    assert m["tierserve:kv_tier_loaded_blocks_total{tier=disk}"] == HIT_TOKENS // 16
    assert m["tierserve:kv_tier_load_latency_seconds_count{tier=disk}"] == HIT_TOKENS // 16


def test_two_servers_share_one_bucket(tmp_path, corpus_ids, weed, s3_creds):
    prompt = corpus_ids[300:300 + PROMPT_LEN]
    flags = ("--kv-tiers", "s3", "--s3-bucket", BUCKET, "--s3-endpoint-url", weed.endpoint_url,
             "--s3-region", "us-east-1", "--s3-prefix", f"share-{uuid.uuid4().hex[:8]}")
    with run_server(tmp_path, *flags) as a, run_server(tmp_path, *flags) as b:
        cold = _complete(a, prompt)
        _stored(a, "s3", PROMPT_LEN // 16)
        warm = _complete(b, prompt)
        m = scrape(b)
    assert _cached(cold) == 0 and _cached(warm) == HIT_TOKENS
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert m["tierserve:kv_tier_hit_blocks_total{tier=s3}"] == HIT_TOKENS // 16
    assert m["tierserve:kv_tier_breaker_state{state=closed,tier=s3}"] == 1
