"""The per-request tier policy on real tiers (cpu, disk folder, SeaweedFS): store filters hold in
the tiers themselves, token budgets and explicit load tiers hold, and the cost model skips a slow
S3 for an interactive request, uses it for a batch one, and uses it again once it is fast."""

from __future__ import annotations

import re
import uuid

import boto3
import pytest

from delay_proxy import delay_proxy
from s3_fixtures import ACCESS_KEY, BUCKET, SECRET_KEY
from tierserve import LLM, KVHints, SamplingParams, SloClass, TierConfig
from tierserve.engine.core.tier_policy import SkipReason
from tierserve.server.policy import policy_header

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LEN = 600  # past the policy's 512-token floor for remote tiers (s3)
HIT = (PROMPT_LEN - 1) // 16 * 16


@pytest.fixture(scope="module")
def prompt(corpus_ids) -> list[int]:
    return corpus_ids[400:400 + PROMPT_LEN]


EXACT = dict(quantization="gguf-exact")
"""Loads from a tier are checked against the session's fp32 engine token for token: the default
gguf mode's int8 activations can turn a last-bit difference into another greedy token."""


@pytest.fixture(scope="module")
def cold(llm, prompt) -> list[int]:
    return llm.generate([prompt], GREEDY)[0].outputs[0].token_ids


def _s3_keys(endpoint: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
    out = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return [o["Key"] for o in out.get("Contents", [])]


def _run(llm: LLM, prompt, hints: KVHints | None = None, reset: bool = True):
    if reset:
        llm.engine.pool.reset_prefix_cache()
    out = llm.generate([prompt], GREEDY, kv_hints=hints)[0]
    assert llm.engine.kv_worker.manager.flush(30)
    return out


def test_store_filters_and_budgets_hold_in_the_tiers(tmp_path, weed, s3_creds, prompt, cold):
    prefix = f"pol-{uuid.uuid4().hex[:8]}"
    llm = LLM(kv_cache_memory_bytes=96 << 20, max_model_len=2048, **EXACT, kv_tiers=TierConfig(
        tiers=("cpu", "disk", "s3"), disk_dir=str(tmp_path / "kv"), s3_bucket=BUCKET,
        s3_endpoint_url=weed.endpoint_url, s3_region="us-east-1", s3_prefix=prefix))
    tiers = llm.engine.kv_worker.manager.tiers
    try:
        disk_only = _run(llm, prompt, KVHints(store_tiers=("disk",)))
        assert disk_only.outputs[0].token_ids == cold
        assert tiers["cpu"].keys() == [] and _s3_keys(weed.endpoint_url, prefix) == []
        assert len(tiers["disk"].keys()) == PROMPT_LEN // 16 + 0  # the prompt's full blocks
        assert disk_only.kv_decision.store_tiers == ("disk",)

        # explicit load tiers: only from disk, whatever else holds the blocks
        capped = _run(llm, prompt, KVHints(load_tiers=("disk",), max_load_tokens=160,
                                           max_offload_tokens=80, store_tiers=("cpu", "s3")))
        assert capped.outputs[0].token_ids == cold
        assert capped.num_cached_tokens == 160 and capped.kv_hit_tokens["disk"] == 160
        assert capped.kv_decision.max_load_blocks == 10
        # max_offload_tokens=80: 5 blocks at most were stored (of the 15 computed), to cpu and s3
        assert len(tiers["cpu"].keys()) == 5 and len(_s3_keys(weed.endpoint_url, prefix)) == 5

        nothing = _run(llm, prompt, KVHints(load_tiers=()))
        assert nothing.num_cached_tokens == 0 and nothing.outputs[0].token_ids == cold
    finally:
        llm.engine.close()


def test_the_cost_model_skips_a_slow_s3_for_interactive_and_recovers(weed, s3_creds, prompt,
                                                                      cold):
    batch = KVHints(slo_class=SloClass.BATCH)
    with delay_proxy(weed.endpoint_url) as proxy:
        llm = LLM(kv_cache_memory_bytes=96 << 20, max_model_len=2048, **EXACT,
                  kv_tiers=TierConfig(tiers=("s3",), s3_bucket=BUCKET,
                                      s3_endpoint_url=proxy.url, s3_region="us-east-1",
                                      s3_prefix=f"cost-{uuid.uuid4().hex[:8]}",
                                      s3_read_timeout_s=10.0))
        counters = llm.engine.kv.counters
        try:
            assert _run(llm, prompt, batch).outputs[0].token_ids == cold  # stores to s3
            fast = _run(llm, prompt, batch)  # a fast load: the cost model learns s3
            assert fast.kv_hit_tokens["s3"] == HIT
            # The budget sits 400 ms above what the cost model now expects a load to take (its
            # estimate, read off a request whose 1 ms budget skips s3): a fast box's s3 fits in
            # 800 ms, a busy 2-core one's may not, and the test is about the change, not the box.
            probe = _run(llm, prompt, KVHints(slo_class=SloClass.INTERACTIVE, ttft_budget_ms=1))
            est_ms = int(re.search(r"s3 skipped: est (\d+) ms", policy_header(
                probe.kv_decision)).group(1))
            interactive = KVHints(slo_class=SloClass.INTERACTIVE, ttft_budget_ms=est_ms + 400)

            proxy.delay_s = 0.3  # every S3 call now takes 300 ms more
            tries = []
            for _ in range(6):  # believed fast at first: tried, abandoned at the deadline,
                out = _run(llm, prompt, interactive)  # until the averages learn the delay
                assert out.outputs[0].token_ids == cold
                tries.append(out)
                if out.kv_decision.skipped:
                    break
            assert counters.abandoned >= 1 and tries[0].kv_hit_tokens["s3"] < HIT
            skipped = tries[-1]
            assert skipped.kv_decision.skipped == {"s3": SkipReason.BUDGET}
            assert skipped.kv_hit_tokens["s3"] == 0
            assert "s3 skipped: est" in policy_header(skipped.kv_decision)

            used = _run(llm, prompt, batch)  # batch loads from every tier, slow or not
            assert used.kv_hit_tokens["s3"] == HIT and used.outputs[0].token_ids == cold

            proxy.delay_s = 0.0
            for _ in range(30):  # batch loads feed the averages until s3 fits the budget again
                again = _run(llm, prompt, interactive)
                if again.kv_hit_tokens["s3"] == HIT:
                    break
                _run(llm, prompt, batch)
            assert again.kv_hit_tokens["s3"] == HIT and again.outputs[0].token_ids == cold
            assert "s3" in again.kv_decision.load_tiers
        finally:
            llm.engine.close()
