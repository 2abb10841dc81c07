"""Tenants stay apart: two API keys and an admin key against a real server.

- KV events are an operator route (the admin key; an ordinary key gets 403) and carry block
  hashes, never token ids, unless the operator opts in.
- Each key's blocks hash under a scope of its own: another key sending the same prompt, with or
  without a forged cache_salt, hits nothing in the device cache, the cpu tier or the disk tier;
  the same key still hits; `--cache-scope shared` brings cross-key hits back.
- Bad input of every kind (soak_traffic's table) is a 4xx naming the field, never a 5xx, leaves
  no key and no traceback in the log, and 300 refusals leave the engine holding nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import MODEL, free_port, run_server, scrape, serve_in_process
from tierserve.server.config import ServerConfig

KEY_A, KEY_B, ADMIN = "sk-alpha-0d5e91", "sk-beta-77c2a4", "sk-admin-5f10b3"
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
             "one hundred and twelve steps aloud, trimming the wick, polishing the great lens, "
             "and writing the weather, the ships and the state of the sea into a leather log "
             "that his grandfather had started sixty years before.")


def _bench(name: str):
    """A bench module by path (bench/ is no package), once per process (test_soak loads it too)."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


traffic = _bench("soak_traffic")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- cache scope and KV events: cpu and disk tiers, in process (to read the tiers) -------------


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """cpu and disk tiers under a device cache of 17 blocks (two filler prompts push a prompt out
    of it); events without token ids (the default)."""
    tmp = tmp_path_factory.mktemp("tenants")
    cfg = ServerConfig(port=free_port(), api_key=(KEY_A, KEY_B), admin_api_key=(ADMIN,),
                       kv_cache_memory_bytes=12 << 20, max_model_len=272, kv_tiers="cpu,disk",
                       disk_tier_dir=str(tmp / "kv"))
    with serve_in_process(cfg) as engine:
        yield cfg, engine


def _complete(cfg: ServerConfig, key: str, prompt, salt: str | None = None, load: str = "all"):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key=key,
                           max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
        extra_body={"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})},
        extra_headers={"X-KV-Load-Tiers": load})
    hits = dict(kv.split("=") for kv in raw.headers["x-kv-hit-tokens"].split(","))
    return raw.parse().usage.prompt_tokens_details.cached_tokens, \
        {k: int(v) for k, v in hits.items()}


def _tier_keys(cfg: ServerConfig, engine) -> dict[str, set[str]]:
    """What the cpu and disk tiers hold, read from the tiers themselves."""
    manager = engine.engine.kv_worker.manager
    assert manager.flush(60)
    disk = {p.name.split(".")[0] for p in Path(cfg.disk_tier_dir).rglob("*.safetensors")}
    return {"cpu": {k.hex() for k in manager.tiers["cpu"].keys()}, "disk": disk}


def _added(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, set[str]]:
    return {tier: after[tier] - before[tier] for tier in after}


def _evict_device(cfg: ServerConfig) -> None:
    for filler in (list(range(1000, 1200)), list(range(3000, 3200))):
        _complete(cfg, KEY_A, filler, salt=uuid.uuid4().hex)


def test_one_key_never_hits_another_keys_blocks_in_any_tier(tenants):
    cfg, engine = tenants
    held = _tier_keys(cfg, engine)
    cached, _ = _complete(cfg, KEY_A, PARAGRAPH)
    assert cached == 0
    a_plain = _added(held, held := _tier_keys(cfg, engine))
    _complete(cfg, KEY_A, PARAGRAPH, salt="tenantA")
    a_salted = _added(held, held := _tier_keys(cfg, engine))
    assert all(len(a_plain[t]) >= 3 and len(a_salted[t]) >= 3 for t in ("cpu", "disk"))

    # The same key repeating its prompt hits (the cache still works)...
    cached, hits = _complete(cfg, KEY_A, PARAGRAPH)
    assert cached > 0 and hits["device"] == cached
    hit_tokens = cached
    # ...another key sending it, with no salt or with key A's salt, hits nothing on the device,
    _, hits = _complete(cfg, KEY_B, PARAGRAPH, salt="tenantA")
    assert not any(hits.values()), hits
    b_salted = _added(held, held := _tier_keys(cfg, engine))
    # ...nor in the cpu tier or on disk, which hold key A's blocks for the same prompt,
    _evict_device(cfg)
    held = _tier_keys(cfg, engine)
    cached, hits = _complete(cfg, KEY_B, PARAGRAPH, load="cpu")
    assert cached == 0 and not any(hits.values()), hits
    b_plain = _added(held, held := _tier_keys(cfg, engine))
    for tier in ("cpu", "disk"):  # and the blocks key B stored are its own
        assert b_plain[tier] and b_salted[tier], tier
        assert not (b_plain[tier] & a_plain[tier]) and not (b_salted[tier] & a_salted[tier])
    _evict_device(cfg)
    _, hits = _complete(cfg, KEY_B, PARAGRAPH, salt="tenantA", load="disk")
    assert hits["disk"] == hit_tokens and hits["cpu"] == 0  # key B's own salted blocks
    # Key A still finds its own blocks in each tier.
    for salt, tier in ((None, "cpu"), ("tenantA", "disk")):
        cached, hits = _complete(cfg, KEY_A, PARAGRAPH, salt=salt, load=tier)
        assert hits[tier] == hit_tokens and cached == hit_tokens, (salt, tier, hits)


def read_events(url: str, headers: dict[str, str], want, timeout: float = 20.0) -> list[dict]:
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", url, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if want(events):
                    return events
            assert time.monotonic() < deadline, f"stream timed out with {events}"
    raise AssertionError(f"stream ended early with {events}")


def test_compiled_grammars_are_not_shared_across_keys(tenants):
    """Key B sending key A's schema compiles it anew (a cache hit would tell B what A sent);
    the same key sending it again is a hit."""
    cfg, engine = tenants
    schema = {"type": "object", "properties": {f"k{uuid.uuid4().hex[:8]}": {"type": "integer"}}}

    def hits_after(key: str) -> float:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key=key,
                               max_retries=0, timeout=120)
        client.completions.create(model=MODEL, prompt="JSON:", max_tokens=8, extra_body={
            "guided_json": schema})
        return engine.engine.grammar_stats().cache_hits

    first = hits_after(KEY_A)
    assert hits_after(KEY_B) == first  # compiled again for B: no hit
    assert hits_after(KEY_B) == first + 1 and hits_after(KEY_A) == first + 2


def test_kv_events_are_the_operators_and_carry_no_token_ids(tenants):
    cfg, engine = tenants
    base = f"http://127.0.0.1:{cfg.port}"
    prompt = list(range(5000, 5040))  # 2 full blocks, token ids easy to look for
    _complete(cfg, KEY_A, prompt)
    engine.engine.kv_worker.manager.flush(60)
    url = base + "/v1/kv/events?since=0"
    for key in (KEY_A, KEY_B):
        r = httpx.get(url, headers=auth(key), timeout=10)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "admin_key_required"
    r = httpx.get(url, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    last = engine.engine.kv_worker.manager.events.last_seq
    events = read_events(url, auth(ADMIN), lambda evs: evs[-1]["seq"] >= last)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and all(e["token_ids"] == [] and e["block_hashes"] for e in stored)
    text = json.dumps(events)
    assert "5000, 5001" not in text and "5000,5001" not in text
    # nor do the metrics, open to every key, say anything of the prompt
    metrics = httpx.get(base + "/metrics", headers=auth(KEY_B), timeout=10).text
    assert "5000,5001" not in metrics and "lighthouse" not in metrics


def test_shared_scope_restores_cross_key_hits(tmp_path):
    with run_server(tmp_path, "--api-key", f"{KEY_A},{KEY_B}", "--cache-scope", "shared",
                    "--kv-events-token-ids", "--kv-tiers", "cpu") as server:
        def cached(key: str, salt: str | None = None) -> int:
            body = {"model": MODEL, "prompt": PARAGRAPH, "max_tokens": 1,
                    **({"cache_salt": salt} if salt else {})}
            r = httpx.post(server.v1 + "/completions", json=body, headers=auth(key), timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached(KEY_A) == 0 and cached(KEY_B) > 0
        assert cached(KEY_A, "s") == 0 and cached(KEY_B, "s") > 0  # a salt is shared too
        # no admin key configured: the events route is closed to every key
        r = httpx.get(server.v1 + "/kv/events", headers=auth(KEY_A), timeout=10)
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]


# ---- bad input: a 4xx naming the field, nothing left behind -------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed-input")
    with run_server(tmp, "--api-key", f"{KEY_A},{KEY_B}", "--admin-api-key", ADMIN,
                    "--log-level", "info", "--max-header-bytes", "16KiB") as server:
        yield server


def test_bad_input_is_a_4xx_naming_the_field(keyed):
    cases = traffic.unicode_and_type_cases(16 << 10)
    problems = [f"{c.name}: {p}" for c in cases
                if (p := traffic.send_bad(keyed.base_url, c, auth(KEY_A))) is not None]
    assert not problems, "\n".join(problems)
    # a key in the URL, percent-encoded, is refused and never written down
    encoded = KEY_A.replace("-", "%2D")
    for target, status in ((f"/v1/completions?api_key={encoded}", 401),
                           (f"/v1/{encoded.lower()}", 404)):
        headers = auth(KEY_B) if status == 404 else {}
        r = httpx.post(keyed.base_url + target, json={"model": MODEL, "prompt": "hi"},
                       headers=headers, timeout=30)
        assert r.status_code == status, (target, r.text)
        assert KEY_A not in r.text
    assert httpx.get(keyed.v1 + "/models", headers=auth(KEY_A), timeout=10).status_code == 200
    log = keyed.log()
    for secret in (KEY_A, KEY_B, ADMIN, encoded, encoded.lower()):
        assert secret not in log, f"{secret} in the server log"
    assert "Traceback" not in log and '" 500' not in log
    assert "api_key=***" in log


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_refused_requests_leave_nothing_behind(keyed):
    """Requests refused at every depth (the edge, the server's checks, the engine's prompt
    check), 8,000-token prompts among them: the engine tracks none afterwards and RSS stays."""
    url = keyed.v1 + "/completions"
    long_prompt = [42] * 8000
    bodies = [
        {"model": MODEL, "prompt": long_prompt, "cache_salt": "\ud800"},
        {"model": MODEL, "prompt": long_prompt, "max_tokens": 4},  # over the context
        {"model": MODEL, "prompt": long_prompt[:1000], "min_tokens": 10 ** 12},
        {"model": MODEL, "prompt": long_prompt[:1000], "cache_salt": ""},
        {"model": MODEL, "prompt": long_prompt[:1000], "max_tokens": True},
    ]
    with httpx.Client(headers=auth(KEY_A), timeout=60) as client:
        def refuse(count: int) -> None:
            for i in range(count):
                r = client.post(url, content=json.dumps(bodies[i % len(bodies)]),
                                headers={"content-type": "application/json"})
                assert r.status_code == 400, r.text
        refuse(60)  # warm-up: first-use allocations
        before = _rss_mib(keyed.proc.pid)
        refuse(300)
        after = _rss_mib(keyed.proc.pid)
    metrics = scrape(keyed)
    assert metrics["tierserve:engine_requests_tracked"] == 0
    assert metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
    assert after - before < 10, (before, after)
    assert httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      headers=auth(KEY_A), timeout=60).status_code == 200
