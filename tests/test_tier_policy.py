"""Per-request tier hints (headers and vLLM's body form) and the policy's decisions: plain Python,
no model. End-to-end tests on real tiers are in tests/test_policy_server.py."""

from __future__ import annotations

import pytest

from tierserve.engine.core.kv_hints import KVHints, SloClass
from tierserve.engine.core.tier_descriptor import Locality, Medium, TierDescriptor
from tierserve.engine.core.tier_policy import CostModel, SkipReason, TierPolicy
from tierserve.server.errors import ApiError
from tierserve.server.policy import parse_hints, policy_header

TIERS = [TierDescriptor("cpu", Medium.CPU, Locality.LOCAL),
         TierDescriptor("disk", Medium.STORAGE, Locality.LOCAL),
         TierDescriptor("s3", Medium.STORAGE, Locality.REMOTE)]


def hints(headers=None, body=None) -> KVHints:
    return parse_hints(headers or {}, body, TIERS)


# ---- headers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value,tiers", [("cpu,disk", ("cpu", "disk")), ("s3, cpu", ("cpu", "s3")),
                                         ("all", ("cpu", "disk", "s3")), ("none", ()),
                                         ("ALL", ("cpu", "disk", "s3"))])
def test_tier_list_headers(value, tiers):
    h = hints({"X-KV-Load-Tiers": value, "x-kv-store-tiers": value})
    assert h.load_tiers == tiers and h.store_tiers == tiers  # lookup order, not the header's


def test_slo_headers():
    h = hints({"X-SLO-TTFT-Ms": "500", "X-SLO-Class": "Interactive"})
    assert h.ttft_budget_ms == 500.0 and h.slo_class is SloClass.INTERACTIVE
    assert hints().empty


# ---- the body: vLLM's matchers -----------------------------------------------------------------


@pytest.mark.parametrize("matchers,tiers", [
    ([], ()),
    ([{}], ("cpu", "disk", "s3")),  # every field left out: matches anything
    ([{"medium": "STORAGE"}], ("disk", "s3")),
    ([{"locality": "LOCAL"}], ("cpu", "disk")),
    ([{"medium": "STORAGE", "locality": "REMOTE"}], ("s3",)),
    ([{"medium": "CPU"}, {"locality": "REMOTE"}], ("cpu", "s3")),  # any matcher passes a tier
])
def test_body_matchers(matchers, tiers):
    h = hints(body={"kv_load_tiers": matchers, "kv_store_tiers": matchers})
    assert h.load_tiers == tiers and h.store_tiers == tiers


def test_body_token_budgets():
    h = hints(body={"max_load_tokens": 0, "max_offload_tokens": 256})
    assert h.max_load_tokens == 0 and h.max_offload_tokens == 256


def test_header_and_body_that_agree_are_fine():
    h = hints({"X-KV-Load-Tiers": "disk,s3"}, {"kv_load_tiers": [{"medium": "STORAGE"}]})
    assert h.load_tiers == ("disk", "s3")


@pytest.mark.parametrize("headers,body,param", [
    ({"X-KV-Load-Tiers": "cpu,nvme"}, None, "X-KV-Load-Tiers"),
    ({"X-KV-Store-Tiers": "cpu,,disk"}, None, "X-KV-Store-Tiers"),
    ({"X-KV-Store-Tiers": ""}, None, "X-KV-Store-Tiers"),
    ({"X-SLO-TTFT-Ms": "-5"}, None, "X-SLO-TTFT-Ms"),
    ({"X-SLO-TTFT-Ms": "fast"}, None, "X-SLO-TTFT-Ms"),
    ({"X-SLO-TTFT-Ms": "nan"}, None, "X-SLO-TTFT-Ms"),
    ({"X-SLO-Class": "urgent"}, None, "X-SLO-Class"),
    ({}, {"kv_load_tiers": [{"medium": "GPU"}]}, "kv_transfer_params.kv_load_tiers[0].medium"),
    ({}, {"kv_store_tiers": [{"locality": "FAR"}]}, "kv_transfer_params.kv_store_tiers[0].locality"),
    ({}, {"kv_load_tiers": "cpu"}, "kv_transfer_params.kv_load_tiers"),
    ({}, {"kv_load_tiers": [{"tier": "cpu"}]}, "kv_transfer_params.kv_load_tiers[0].tier"),
    ({}, {"max_load_tokens": -1}, "kv_transfer_params.max_load_tokens"),
    ({}, {"max_offload_tokens": "10"}, "kv_transfer_params.max_offload_tokens"),
    ({}, {"do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill"),
    ({"X-KV-Load-Tiers": "cpu"}, {"kv_load_tiers": [{"medium": "STORAGE"}]},
     "kv_transfer_params.kv_load_tiers"),
])
def test_bad_values_are_400_naming_the_header_or_field(headers, body, param):
    with pytest.raises(ApiError) as e:
        hints(headers, body)
    assert e.value.status == 400 and e.value.param == param


def test_a_tier_this_server_lacks_is_unknown():
    with pytest.raises(ApiError) as e:
        parse_hints({"X-KV-Load-Tiers": "s3"}, None, TIERS[:1])
    assert "configured: cpu" in e.value.message


# ---- the policy --------------------------------------------------------------------------------

BLOCK = 737_280


def policy(s3_ms_per_block: float | None = None,
           prefill_tps: float | None = 500.0) -> TierPolicy:
    """cpu at 10 GB/s, disk at 2 GB/s; s3 with the given per-block time (None: unmeasured)."""
    cost = CostModel(BLOCK, 16, alpha=1.0, prefill_tokens_per_s=prefill_tps)
    for tier, bw in (("cpu", 10e9), ("disk", 2e9)):
        cost.observe_lookup(tier, 1e-4)
        cost.observe_load(tier, BLOCK, BLOCK / bw)
    if s3_ms_per_block is not None:
        cost.observe_lookup("s3", s3_ms_per_block / 1e3)
        cost.observe_load("s3", BLOCK, s3_ms_per_block / 1e3)
    return TierPolicy(TIERS, cost, 16, remote_min_tokens=512)


def test_explicit_tiers_win_over_the_cost_model():
    d = policy(s3_ms_per_block=10_000).decide(KVHints(load_tiers=("s3",), store_tiers=("disk",)),
                                              blocks=100, arrival=0.0, now=0.0)
    assert d.load_tiers == ("s3",) and d.store_tiers == ("disk",)


def test_interactive_skips_a_remote_load_that_cannot_fit_the_budget():
    # 125 blocks (2,000 tokens): recompute 4 s at 500 tok/s; s3 at 5 ms a block: ~0.6 s
    p = policy(s3_ms_per_block=5)
    tight = p.decide(KVHints(slo_class=SloClass.INTERACTIVE, ttft_budget_ms=500), 125, 0.0, 0.0)
    assert tight.load_tiers == ("cpu", "disk") and tight.skipped == {"s3": SkipReason.BUDGET}
    assert "s3 skipped: est" in policy_header(tight) and "500 ms budget" in policy_header(tight)
    assert tight.store_tiers == ("cpu", "disk")  # interactive: local tiers only
    roomy = p.decide(KVHints(slo_class=SloClass.INTERACTIVE, ttft_budget_ms=2000), 125, 0.0, 0.0)
    assert roomy.load_tiers == ("cpu", "disk", "s3")


def test_time_already_waited_comes_off_the_budget():
    p = policy(s3_ms_per_block=2)  # ~0.25 s for 125 blocks
    h = KVHints(slo_class=SloClass.INTERACTIVE, ttft_budget_ms=500)
    assert "s3" in p.decide(h, 125, arrival=0.0, now=0.1).load_tiers
    assert p.decide(h, 125, arrival=0.0, now=0.4).skipped["s3"] is SkipReason.BUDGET


def test_batch_loads_from_and_stores_to_every_tier_whatever_the_cost():
    d = policy(s3_ms_per_block=10_000).decide(KVHints(slo_class=SloClass.BATCH,
                                                      ttft_budget_ms=10), 125, 0.0, 0.0)
    assert d.load_tiers == d.store_tiers == ("cpu", "disk", "s3")


def test_a_load_slower_than_recompute_is_skipped_by_cost():
    d = policy(s3_ms_per_block=100).decide(KVHints(), 125, 0.0, 0.0)  # 12.5 s vs 4 s
    assert d.skipped == {"s3": SkipReason.COST} and d.load_tiers == ("cpu", "disk")


def test_a_tier_skipped_for_cost_is_measured_again_after_a_while():
    """Skipped for cost, a tier is never read, so its estimate cannot recover (one slow read of
    a corrupt block would keep it skipped): after 30 s without a sample one load goes through,
    once, and the skips resume until that load's sample is in."""
    import time

    p = policy(s3_ms_per_block=100)
    soon, later = time.monotonic() + 1, time.monotonic() + 31
    assert p.decide(KVHints(), 125, soon, soon).skipped == {"s3": SkipReason.COST}
    assert "s3" in p.decide(KVHints(), 125, later, later).load_tiers  # one re-probe
    assert p.decide(KVHints(), 125, later, later).skipped == {"s3": SkipReason.COST}
    p.cost.observe_load("s3", BLOCK, 1e-4)  # that load was fast: s3 is back
    assert "s3" in p.decide(KVHints(), 125, later, later).load_tiers


def test_no_load_is_skipped_for_cost_before_a_prefill_is_measured():
    # a restarted server: the probe measured a slow disk, no prefill step has run yet
    cold = policy(s3_ms_per_block=100, prefill_tps=None)
    d = cold.decide(KVHints(), 125, 0.0, 0.0)
    assert d.load_tiers == ("cpu", "disk", "s3") and d.skipped == {}
    cold.cost.observe_prefill(2000, 4.0)  # 500 tok/s: now 12.5 s of s3 loses to 4 s
    assert cold.decide(KVHints(), 125, 0.0, 0.0).skipped == {"s3": SkipReason.COST}
    assert cold.decide(KVHints(ttft_budget_ms=500), 125, 0.0, 0.0).skipped == {"s3": SkipReason.BUDGET}


def test_short_prompts_skip_remote_tiers_and_unmeasured_tiers_are_tried():
    p = policy(s3_ms_per_block=None)
    assert p.decide(KVHints(), 10, 0.0, 0.0).skipped == {"s3": SkipReason.SHORT_PROMPT}
    assert p.decide(KVHints(), 125, 0.0, 0.0).load_tiers == ("cpu", "disk", "s3")


def test_token_budgets_become_block_limits_and_zero_turns_a_side_off():
    p = policy()
    d = p.decide(KVHints(max_load_tokens=100, max_offload_tokens=0), 125, 0.0, 0.0)
    assert d.max_load_blocks == 6 and d.store_tiers == ()
    off = p.decide(KVHints(max_load_tokens=0), 125, 0.0, 0.0)
    assert off.load_tiers == () and "max_load_tokens=0" in policy_header(off)


def test_the_deadline_is_arrival_plus_budget():
    d = policy().decide(KVHints(ttft_budget_ms=500), 125, arrival=10.0, now=10.1)
    assert d.deadline == pytest.approx(10.5)
    assert policy().decide(KVHints(), 125, 10.0, 10.1).deadline is None


def test_hints_take_unset_fields_from_the_server_defaults():
    defaults = KVHints(slo_class=SloClass.BATCH, store_tiers=("disk",))
    h = KVHints(slo_class=SloClass.INTERACTIVE).over(defaults)
    assert h.slo_class is SloClass.INTERACTIVE and h.store_tiers == ("disk",)
