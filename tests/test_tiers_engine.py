"""KV tiers under the real engine and model: a prefix that sits only in one tier gives the tokens
a cold run gives, a slow load stalls no running request, and tier faults only ever cost a
recompute. Real files on disk and a real S3-compatible server (SeaweedFS) on loopback."""

from __future__ import annotations

import time
import uuid

import pytest

from s3_fixtures import BUCKET, free_port, hanging_endpoint
from tierserve import LLM, SamplingParams
from tierserve.engine.core.kv_hints import KVHints
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.core.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LEN = 600  # past the policy's 512-token floor for remote tiers (s3)
HIT_TOKENS = (PROMPT_LEN - 1) // 16 * 16  # every full block but the one with the last token


@pytest.fixture(scope="module")
def long_prompt(corpus_ids) -> list[int]:
    return corpus_ids[200:200 + PROMPT_LEN]


@pytest.fixture(scope="module")
def cold(llm, long_prompt) -> list[int]:
    """The tokens of the prompt computed from scratch (the session engine has no tiers)."""
    return llm.generate([long_prompt], GREEDY)[0].outputs[0].token_ids


def _llm(tiers: TierConfig) -> LLM:
    return LLM(kv_cache_memory_bytes=96 << 20, max_model_len=2048, kv_tiers=tiers)


def _s3(endpoint: str, **kw) -> TierConfig:
    return TierConfig(tiers=("s3",), s3_bucket=BUCKET, s3_endpoint_url=endpoint,
                      s3_region="us-east-1", s3_prefix=f"t-{uuid.uuid4().hex[:8]}", **kw)


def _tier_config(tier: str, tmp_path, request) -> TierConfig:
    if tier == "cpu":
        return TierConfig(tiers=("cpu",), cpu_bytes=256 << 20)
    if tier == "disk":
        return TierConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"), disk_bytes=256 << 20)
    request.getfixturevalue("s3_creds")
    return _s3(request.getfixturevalue("weed").endpoint_url)


def _warm_then_from_tier(llm: LLM, prompt: list[int]):
    """Run once (the blocks go to the tiers), forget the device cache, run again."""
    first = llm.generate([prompt], GREEDY)[0]
    assert llm.engine.kv_worker.manager.flush(30)
    llm.engine.pool.reset_prefix_cache()
    return first, llm.generate([prompt], GREEDY)[0]


@pytest.mark.parametrize("tier", ["cpu", "disk", "s3"])
def test_prefix_only_in_one_tier_gives_cold_tokens(tier, tmp_path, request, long_prompt, cold):
    llm = _llm(_tier_config(tier, tmp_path, request))
    try:
        first, again = _warm_then_from_tier(llm, long_prompt)
        stats = llm.engine.kv_worker.manager.stats()[tier]
    finally:
        llm.engine.close()
    assert first.outputs[0].token_ids == cold and first.num_cached_tokens == 0
    assert again.outputs[0].token_ids == cold
    assert again.num_cached_tokens == HIT_TOKENS
    assert stats.hit_blocks == stats.loaded_blocks == HIT_TOKENS // 16
    assert stats.stored_blocks >= PROMPT_LEN // 16


def test_a_slow_load_stalls_no_running_request(long_prompt, cold):
    """While one request loads its prefix from a tier slowed on purpose, a running request keeps
    producing tokens: counted, step by step, while the loader is LOADING."""
    llm = _llm(TierConfig(tiers=("cpu",), cpu_bytes=256 << 20))
    eng = llm.engine
    try:
        llm.generate([long_prompt], GREEDY)
        assert eng.kv_worker.manager.flush(30)
        eng.pool.reset_prefix_cache()
        eng.kv_worker.manager.tiers["cpu"].delay_s = 0.02  # per block: ~0.3 s for 62 blocks
        eng.add_request("runner", "Count to one hundred:", SamplingParams(
            temperature=0, max_tokens=2000, ignore_eos=True))
        eng.step()
        eng.add_request("loader", long_prompt, GREEDY)
        during, loader_out, seen_loading = 0, None, False
        while loader_out is None:
            outs = {o.request_id: o for o in eng.step()}
            loader = eng.scheduler.requests.get("loader")
            if loader is not None and loader.status is RequestStatus.LOADING:
                seen_loading = True
                during += "runner" in outs
            if "loader" in outs and outs["loader"].finished:
                loader_out = outs["loader"]
        eng.abort_request("runner")
    finally:
        eng.close()
    assert seen_loading
    assert during >= 5, during
    assert loader_out.outputs[0].token_ids == cold
    assert loader_out.num_cached_tokens == HIT_TOKENS


def test_s3_down_at_start_then_up_hanging_and_killed(weed, s3_creds, long_prompt, cold):
    """Every request gets the cold tokens whatever S3 does: down (the breaker opens, lookups are
    misses at once), back up (the breaker closes after its back-off, hits resume)."""
    dead = f"http://127.0.0.1:{free_port()}"
    llm = _llm(_s3(dead, breaker_threshold=1, breaker_backoff_s=0.5, s3_connect_timeout_s=0.5))
    try:
        first, again = _warm_then_from_tier(llm, long_prompt)
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == cold
        assert again.num_cached_tokens == 0
        s3 = llm.engine.kv_worker.manager.tiers["s3"]
        assert s3.breaker_state == "open"
    finally:
        llm.engine.close()

    llm = _llm(_s3(weed.endpoint_url, breaker_threshold=1, breaker_backoff_s=0.5,
                   s3_connect_timeout_s=0.5, s3_read_timeout_s=1.0))
    try:
        _, warm = _warm_then_from_tier(llm, long_prompt)
        assert warm.outputs[0].token_ids == cold and warm.num_cached_tokens == HIT_TOKENS
        weed.kill()
        llm.engine.pool.reset_prefix_cache()
        down = llm.generate([long_prompt], GREEDY)[0]
        assert down.outputs[0].token_ids == cold and down.num_cached_tokens == 0
        assert llm.engine.kv_worker.manager.tiers["s3"].breaker_state == "open"
        weed.start()
        time.sleep(1.5)  # past the breaker's back-off: the next lookup is its probe
        llm.engine.pool.reset_prefix_cache()
        back = llm.generate([long_prompt], GREEDY)[0]
        assert back.outputs[0].token_ids == cold and back.num_cached_tokens == HIT_TOKENS
        assert llm.engine.kv_worker.manager.tiers["s3"].breaker_state == "closed"
    finally:
        llm.engine.close()
        if weed.proc is None or weed.proc.poll() is not None:
            weed.start()


def test_hanging_s3_costs_a_recompute_not_a_hang(s3_creds, long_prompt, cold):
    with hanging_endpoint() as url:
        llm = _llm(_s3(url, s3_connect_timeout_s=0.5, s3_read_timeout_s=1.0, s3_max_attempts=1))
        try:
            t0 = time.monotonic()
            out = llm.generate([long_prompt], GREEDY)[0]
            took = time.monotonic() - t0
        finally:
            llm.engine.close()
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 0
    assert took < 30


def test_corrupt_and_truncated_disk_blocks_are_misses_and_removed(tmp_path, long_prompt, cold):
    llm = _llm(TierConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"), disk_bytes=256 << 20))
    try:
        llm.generate([long_prompt], GREEDY)
        assert llm.engine.kv_worker.manager.flush(30)
        by_key = {f.name.split(".")[0]: f for f in (tmp_path / "kv").rglob("*.safetensors")}
        ordered = _prompt_block_files(llm, long_prompt, by_key)
        assert len(ordered) == PROMPT_LEN // 16
        # the 11th block of the prompt is corrupted, the 21st truncated: the hit ends at block 10
        data = bytearray(ordered[10].read_bytes())
        data[len(data) // 2] ^= 0xFF
        ordered[10].write_bytes(bytes(data))
        ordered[20].write_bytes(ordered[20].read_bytes()[:1000])
        # explicit load tiers: this test is about the payload checks, not the cost policy
        # (which, after the corrupt read's slow fetch, may skip a slow-looking disk)
        disk = KVHints(load_tiers=("disk",))
        llm.engine.pool.reset_prefix_cache()
        out = llm.generate([long_prompt], GREEDY, kv_hints=disk)[0]
        assert llm.engine.kv_worker.manager.flush(30)
        errors = llm.engine.kv_worker.manager.stats()["disk"].errors
        llm.engine.pool.reset_prefix_cache()
        healed = llm.generate([long_prompt], GREEDY, kv_hints=disk)[0]
    finally:
        llm.engine.close()
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 10 * 16  # the run of good blocks before the corrupt one
    assert errors.get("corrupt", 0) >= 1
    # the corrupt file was removed, and the recomputed block stored again in its place
    assert ordered[10].exists() and bytes(data) != ordered[10].read_bytes()
    # block 10 is good again. The truncated block 20 was either read in parallel during the
    # second run (found corrupt, removed, recomputed and stored again: a full hit now) or not
    # read then (the run ended at 10), and now ends the run at block 20 as a miss.
    assert healed.outputs[0].token_ids == cold
    assert healed.num_cached_tokens in (20 * 16, HIT_TOKENS)


def _prompt_block_files(llm: LLM, prompt: list[int], by_key: dict) -> list:
    """The disk files of the prompt's blocks, in prompt order."""
    from tierserve.engine.core.block_hash import extend_hashes

    hashes: list = []
    extend_hashes(hashes, prompt, 16, llm.engine.fingerprint)
    return [by_key[h.hex()] for h in hashes if h.hex() in by_key]


def test_blocks_the_device_evicts_are_demoted_to_cpu(corpus_ids):
    """A prompt's cached blocks, missing from the cpu tier, land there when the device pool
    takes them for another prompt."""
    llm = LLM(kv_cache_memory_bytes=64 << 20, max_model_len=1400,
              kv_tiers=TierConfig(tiers=("cpu",), cpu_bytes=256 << 20))
    eng = llm.engine
    try:
        a, b = corpus_ids[:500], corpus_ids[1000:2200]
        llm.generate([a], GREEDY)
        assert eng.kv_worker.manager.flush(30)
        cpu = eng.kv_worker.manager.tiers["cpu"]
        for key in cpu.keys():
            cpu.remove(key)
        a_keys = {b.hash for b in eng.pool.blocks if b.hash is not None}
        assert len(a_keys) == 500 // 16 and eng.pool.num_blocks < 500 // 16 + 1200 // 16
        llm.generate([b], GREEDY)  # needs more blocks than are free: A's cached ones go
        assert eng.kv_worker.manager.flush(30)
        evicted = a_keys - {b.hash for b in eng.pool.blocks if b.hash is not None}
        held = set(cpu.keys())
    finally:
        eng.close()
    assert evicted and evicted <= held


def test_blocks_loaded_from_s3_are_promoted_to_disk(weed, s3_creds, tmp_path, long_prompt, cold):
    """A prefix only s3 holds is loaded from s3 and written to disk on the way, so the next load
    is local; a request that may not store to disk promotes nothing. Tokens stay cold's."""
    from tierserve.engine.core.kv_hints import KVHints
    hit = HIT_TOKENS // 16
    tiers = TierConfig(tiers=("disk", "s3"), disk_dir=str(tmp_path / "kv"), disk_bytes=256 << 20,
                       s3_bucket=BUCKET, s3_endpoint_url=weed.endpoint_url, s3_region="us-east-1",
                       s3_prefix=f"t-{uuid.uuid4().hex[:8]}")
    llm = _llm(tiers)
    manager, counters = llm.engine.kv_worker.manager, llm.engine.kv.counters
    disk = manager.tiers["disk"]

    def again(**kw):
        assert manager.flush(30)
        llm.engine.pool.reset_prefix_cache()
        return llm.generate([long_prompt], GREEDY, **kw)[0]
    try:
        outs = [llm.generate([long_prompt], GREEDY)[0]]
        assert manager.flush(30) and len(disk.keys()) >= hit
        manager.clear(("disk",))
        outs.append(again())  # from s3, promoted to disk
        s3_loaded = manager.stats()["s3"].loaded_blocks
        assert manager.flush(30)
        promoted, on_disk = counters.promoted, len(disk.keys())
        outs.append(again())  # from disk
        stats = manager.stats()
        manager.clear(("disk",))
        outs.append(again(kv_hints=KVHints(store_tiers=("s3",))))  # from s3, no promotion
        assert manager.flush(30)
        after_no_store = len(disk.keys())
    finally:
        llm.engine.close()
    assert all(o.outputs[0].token_ids == cold for o in outs)
    assert [o.num_cached_tokens for o in outs] == [0, HIT_TOKENS, HIT_TOKENS, HIT_TOKENS]
    assert s3_loaded == hit and promoted == hit <= on_disk  # + the newly full blocks it computed
    assert stats["disk"].loaded_blocks == hit and stats["s3"].loaded_blocks == s3_loaded
    assert after_no_store == 0 and counters.promoted == hit


def test_a_full_then_read_only_disk_tier_never_costs_a_token(tmp_path, long_prompt, cold):
    """The disk tier on a real 20 MiB tmpfs: the prompt's 62 blocks (45 MB) do not fit, stores
    fail as no_space; then the disk is remounted read-only: stores fail as read_only. Every
    request still gets the cold tokens and loads go on from what the disk holds."""
    import subprocess

    from test_kv_tiers import tmpfs

    root = tmp_path / "small"
    with tmpfs(root, "20m") as mounted:
        if not mounted:
            pytest.skip("this box cannot mount a tmpfs")
        llm = _llm(TierConfig(tiers=("disk",), disk_dir=str(root), disk_bytes=1 << 30,
                              disk_error_backoff_s=0.2))
        disk = llm.engine.kv_worker.manager.tiers["disk"]
        try:
            first, again = _warm_then_from_tier(llm, long_prompt)
            full_errors = disk.stats().errors.get("no_space", 0)
            held = len(disk.keys())
            subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
            time.sleep(0.3)  # past the back-off: the next store is tried, and fails
            llm.engine.pool.reset_prefix_cache()
            ro = llm.generate([long_prompt[:500] + long_prompt[600:]], GREEDY)[0]
            assert llm.engine.kv_worker.manager.flush(30)
            llm.engine.pool.reset_prefix_cache()
            after = llm.generate([long_prompt], GREEDY)[0]
            errors = disk.stats().errors
        finally:
            llm.engine.close()
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == cold
    assert full_errors >= 1 and 0 < held < PROMPT_LEN // 16
    assert again.num_cached_tokens == held * 16  # the leading blocks that fit were served
    assert ro.outputs[0].token_ids and errors.get("read_only", 0) >= 1
    assert after.outputs[0].token_ids == cold and after.num_cached_tokens == held * 16
