"""Security and settings: API keys (flag, file, environment) on every route but the probes, no
secret in a log line or a response, settings from TIERSERVE_* variables, and cache_salt keeping
requests' KV blocks apart in every tier (cpu, disk and a real S3 server)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import httpx
import openai
import pytest

from s3_fixtures import ACCESS_KEY, BUCKET, CREDENTIALS, SECRET_KEY
from server_fixtures import MODEL, free_port, run_server, serve_in_process
from tierserve.server.cli import build_parser
from tierserve.server.config import FIELDS, ServerConfig, load_config

ENV_KEYS = ("sk-env-one-7f3c2a91", "sk-env-two-b84d10e6")
FILE_KEY = "sk-file-three-5c0e9d27"
KEYS = (*ENV_KEYS, FILE_KEY)


def _parse(*argv: str, environ: dict[str, str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(["serve", *argv])
    return load_config(args.config, {k: getattr(args, k) for k in FIELDS}, environ or {})


# ---- settings from the environment (no model, milliseconds) --------------------------------------


def test_environment_settings_sit_between_yaml_and_flags(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("port: 9000\nmax_queue: 3\nmax_n: 4\n")
    env = {"TIERSERVE_CONFIG": str(yaml_file), "TIERSERVE_MAX_QUEUE": "5",
           "TIERSERVE_MAX_N": "6", "TIERSERVE_ENABLE_PREFIX_CACHING": "no",
           "TIERSERVE_CPU_TIER_BYTES": "512MiB", "TIERSERVE_MAX_BODY_BYTES": "64KiB",
           "TIERSERVE_DEFAULT_SLO_TTFT_MS": "250", "TIERSERVE_SERVED_MODEL_NAME": "",
           # not settings: the kernels' and caches' own variables, and a typo, are left alone
           "TIERSERVE_CACHE": "/nowhere", "TIERSERVE_SPIN_US": "0", "TIERSERVE_NATIVE_OPS": "0",
           "TIERSERVE_STACK_DECODE_MIN_BATCH": "0", "TIERSERVE_MAX_QEUE": "x"}
    cfg = _parse("--max-n", "8", environ=env)
    assert cfg.port == 9000  # YAML over the default
    assert cfg.max_queue == 5  # environment over YAML
    assert cfg.max_n == 8  # flag over environment
    assert cfg.enable_prefix_caching is False and cfg.cpu_tier_bytes == 512 << 20
    assert cfg.max_body_bytes == 64 << 10 and cfg.default_slo_ttft_ms == 250.0
    assert cfg.served_model_name == ()  # an empty variable is unset
    assert _parse("--config", "default", environ=env).port == 8000  # --config beats the variable
    for word, value in [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("false", False)]:
        assert _parse(environ={"TIERSERVE_AUTH_HEALTH_METRICS": word}).auth_health_metrics is value


def test_api_keys_from_flags_file_and_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated monthly\n\n  {FILE_KEY}  \n# old: sk-revoked\n")
    env = {"TIERSERVE_API_KEY": ",".join(ENV_KEYS)}
    assert _parse(environ=env).api_key == ENV_KEYS
    assert _parse("--api-key-file", str(key_file), environ=env).api_key == KEYS
    flags = _parse("--api-key", "f1,f2", "--api-key", "f3", environ=env)
    assert flags.api_key == ("f1", "f2", "f3")  # the flag replaces the variable's keys
    assert ServerConfig(api_key="x, y").api_key == ("x", "y")  # never the characters of "x, y"
    assert "sk-" not in _parse(environ=env).describe() and "api_key=<2 keys>" in \
        _parse(environ=env).describe()
    (tmp_path / "empty").write_text("# nothing yet\n")
    for argv in (["--api-key", ","], ["--api-key-file", str(tmp_path / "empty")],
                 ["--api-key-file", str(tmp_path / "missing")]):
        with pytest.raises(ValueError, match="api_key"):  # never an open server by mistake
            _parse(*argv)


@pytest.mark.parametrize("var,value,words", [
    ("TIERSERVE_PORT", "eighty", "expected an integer, got 'eighty'"),
    ("TIERSERVE_ENABLE_PREFIX_CACHING", "maybe", "expected one of 1/true/yes/0/false/no"),
    ("TIERSERVE_KV_CACHE_MEMORY_BYTES", "lots", "not a byte size"),
    ("TIERSERVE_MAX_TOKENS_LIMIT", "0", "max_tokens_limit must be at least 1"),
])
def test_bad_environment_value_is_a_one_line_start_up_error(var, value, words):
    env = dict(os.environ, **{var: value})
    r = subprocess.run([sys.executable, "-m", "tierserve.server.cli", "serve"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{var}: " in lines[0] and words in lines[0], r.stderr


# ---- keys on a running server, and no secret in its log or its answers ---------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, weed):
    """Keys from TIERSERVE_API_KEY and --api-key-file, the s3 tier's secret in AWS_*, info logs
    (uvicorn's access log included)."""
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "keys").write_text(f"# tierserve keys\n{FILE_KEY}\n")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**CREDENTIALS, "TIERSERVE_API_KEY": ",".join(ENV_KEYS)}.items():
            mp.setenv(k, v)
        with run_server(tmp, "--api-key-file", str(tmp / "keys"), "--log-level", "info",
                        "--kv-tiers", "s3", "--s3-bucket", BUCKET, "--s3-endpoint-url",
                        weed.endpoint_url, "--s3-region", "us-east-1", "--s3-prefix",
                        f"keyed-{uuid.uuid4().hex[:8]}") as s:
            yield s


def test_every_route_but_the_probes_needs_a_key(keyed):
    for path in ("/v1/models", "/v1/models/smollm2-135m", "/version", "/v1/backends", "/docs",
                 "/openapi.json", "/v1/kv/events", "/v1/no-such-route", "/metrics/", "/healthz"):
        r = httpx.get(keyed.base_url + path, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(keyed.base_url + path, json=body, timeout=30).status_code == 401
        r = httpx.post(keyed.base_url + path, json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200, r.text
    for path in ("/health", "/metrics"):
        assert httpx.get(keyed.base_url + path, timeout=30).status_code == 200


def test_no_key_in_any_log_line_or_response(keyed):
    bodies = []
    for key in KEYS:  # each configured key works, with the real client
        client = openai.OpenAI(base_url=keyed.v1, api_key=key, max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello there",
                                                          max_tokens=2)
        assert raw.status_code == 200
        bodies.append(raw.text)
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=keyed.v1, api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.body["code"] == "invalid_api_key"
    bodies.append(e.value.response.text)

    url, ok = keyed.v1 + "/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    k = KEYS[0]
    denied = [
        {"Authorization": f"Bearer {k}x"}, {"Authorization": f"Bearer {k[:-1]}"},
        {"Authorization": f"Basic {k}"}, {"Authorization": k},  # a key, but not as a bearer
        {"X-Api-Key": k}, {"Api-Key": k}, {"Cookie": f"api_key={k}"},  # the wrong header
    ]
    for headers in denied:
        r = httpx.post(url, json=ok, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["message"].startswith("API key incorrect") or \
            "Authorization" not in headers
        bodies.append(r.text)
    r = httpx.post(url + f"?api_key={k}", json=ok, timeout=30)  # in the query: the access log
    assert r.status_code == 401 and "API key missing" in r.text
    bodies.append(r.text)

    auth = {"Authorization": f"Bearer {k}"}  # authorized, with another key where a name goes
    for method, target, body, status in [
        ("POST", url, {**ok, "model": KEYS[1]}, 404),
        ("POST", url, {**ok, "max_tokens": KEYS[1]}, 400),
        ("POST", url, {**ok, "logit_bias": {KEYS[2]: 1}}, 400),
        ("GET", keyed.v1 + f"/{KEYS[2]}", None, 404),
    ]:
        r = httpx.request(method, target, json=body, headers=auth, timeout=30)
        assert r.status_code == status, r.text
        bodies.append(r.text)
    assert sum("***" in b for b in bodies) >= 2  # the messages still say where the key was

    log = keyed.log()
    assert "settings: " in log and "api_key_file=" in log  # the start-up line is there...
    assert '"POST /v1/completions?api_key=*** HTTP/1.1" 401' in log  # ...and the access log
    for secret in (*KEYS, SECRET_KEY):
        assert secret not in log, f"{secret} in the server log"
        for b in bodies:
            assert secret not in b, f"{secret} in a response: {b}"


# ---- cache_salt: no block shared across salts, in any tier ---------------------------------------

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
             "one hundred and twelve steps aloud, trimming the wick, polishing the great lens, "
             "and writing the weather, the ships and the state of the sea into a leather log "
             "that his grandfather had started sixty years before.")


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, weed):
    """cpu, disk and s3 tiers under a device cache of 17 blocks (so two filler prompts push a
    prompt out of it); /health and /metrics need the key too."""
    tmp = tmp_path_factory.mktemp("tiered")
    cfg = ServerConfig(port=free_port(), api_key=(KEYS[0],), auth_health_metrics=True,
                       kv_cache_memory_bytes=12 << 20, max_model_len=272, kv_tiers="cpu,disk,s3",
                       disk_tier_dir=str(tmp / "kv"), s3_bucket=BUCKET,
                       s3_endpoint_url=weed.endpoint_url, s3_region="us-east-1",
                       s3_prefix=f"salt-{uuid.uuid4().hex[:8]}")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        with serve_in_process(cfg) as engine:
            yield cfg, engine


def _tier_keys(cfg: ServerConfig, engine) -> dict[str, set[str]]:
    """What each tier holds, read from the tier itself: the cpu tier's dict, the files in the disk
    tier's folder, the objects in the bucket."""
    manager = engine.engine.kv_worker.manager
    assert manager.flush(60)
    disk = {p.name.split(".")[0] for p in Path(cfg.disk_tier_dir).rglob("*.safetensors")}
    s3 = boto3.client("s3", endpoint_url=cfg.s3_endpoint_url, region_name="us-east-1",
                      aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=cfg.s3_prefix + "/")
    objects = {o["Key"].rsplit("/", 1)[1] for page in pages for o in page.get("Contents", [])}
    return {"cpu": {k.hex() for k in manager.tiers["cpu"].keys()}, "disk": disk, "s3": objects}


def _complete(client: openai.OpenAI, prompt, salt: str | None, load: str = "all"):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})},
        extra_headers={"X-KV-Load-Tiers": load})
    hits = dict(kv.split("=") for kv in raw.headers["x-kv-hit-tokens"].split(","))
    return raw.parse(), {k: int(v) for k, v in hits.items()}


def test_cache_salts_never_share_a_block_in_any_tier(tiered):
    cfg, engine = tiered
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key=KEYS[0],
                           max_retries=0, timeout=120)
    held, new = _tier_keys(cfg, engine), {}
    for salt in ("a", "b", None):
        first, hits = _complete(client, PARAGRAPH, salt)
        assert first.usage.prompt_tokens_details.cached_tokens == 0 and not any(hits.values())
        now = _tier_keys(cfg, engine)
        new[salt] = {tier: now[tier] - held[tier] for tier in now}
        held = now
    prompt_tokens = first.usage.prompt_tokens
    for salt, added in new.items():
        assert added["cpu"] == added["disk"] == added["s3"], salt  # one key per block, everywhere
        assert len(added["cpu"]) >= prompt_tokens // 16, (salt, len(added["cpu"]))
    for tier in ("cpu", "disk", "s3"):
        a, b, none = new["a"][tier], new["b"][tier], new[None][tier]
        assert not (a & b) and not (a & none) and not (b & none), tier

    for filler in (list(range(1000, 1200)), list(range(3000, 3200))):  # evict from the device
        _complete(client, filler, None)
    hit_tokens = (prompt_tokens - 1) // 16 * 16
    # Each salt finds its own blocks in the one tier it may load from...
    for salt, tier in (("a", "cpu"), ("b", "disk"), (None, "s3")):
        again, hits = _complete(client, PARAGRAPH, salt, load=tier)
        assert hits == {"device": 0, "cpu": 0, "disk": 0, "s3": 0, tier: hit_tokens}, (salt, hits)
        assert again.usage.prompt_tokens_details.cached_tokens == hit_tokens
    # ...and a salt of its own finds nothing anywhere, though every tier holds the same prompt.
    _, hits = _complete(client, PARAGRAPH, "c")
    assert not any(hits.values()), hits


def test_auth_health_metrics_protects_the_probes(tiered):
    cfg, _ = tiered
    base = f"http://127.0.0.1:{cfg.port}"
    for path in ("/health", "/metrics"):
        r = httpx.get(base + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(base + path, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
        assert r.status_code == 200


def test_the_image_healthcheck_sends_the_key_the_server_reads(tiered, tmp_path):
    """The Docker HEALTHCHECK (python3 -m tierserve.server.healthcheck) against a server whose
    /health needs a key: it passes with the key in TIERSERVE_API_KEY (first of a comma list) or
    in TIERSERVE_API_KEY_FILE, fails without one or with a wrong one."""
    cfg, _ = tiered
    key_file = tmp_path / "keys"
    key_file.write_text(f"# the probe's key\n\n{KEYS[0]}\nsk-other\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_API_KEY")}
    base["TIERSERVE_PORT"] = str(cfg.port)

    def probe(**env) -> int:
        return subprocess.run([sys.executable, "-m", "tierserve.server.healthcheck"],
                              env={**base, **env}, capture_output=True, timeout=60).returncode
    assert probe(TIERSERVE_API_KEY=f"{KEYS[0]}, sk-unused") == 0
    assert probe(TIERSERVE_API_KEY_FILE=str(key_file)) == 0
    assert probe() == 1
    assert probe(TIERSERVE_API_KEY="sk-wrong") == 1
