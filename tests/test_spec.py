"""Speculative decoding (engine/spec/): proposals verified in the step give the tokens, logprobs
and stops of decoding without them; sampled rows keep their distribution; rejected positions never
reach the prefix cache; bad configs stop start-up with one line."""

from __future__ import annotations

import json
import math

import pytest

from tierserve.engine import LLM
from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import Scheduler
from tierserve.engine.config import SchedulerConfig
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.spec.config import SpeculativeConfig
from tierserve.engine.spec.ngram import NgramProposer
from tierserve.engine.spec.verify import accepted_prefix, kept_tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4, "compute_bound_batch": 0}
"""Every decode may speculate whatever the batch (the tests check batches full of verified rows)."""
ENGINE = dict(kv_cache_memory_bytes=1 << 30, quantization="none")


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(speculative_config=NGRAM, **ENGINE)


@pytest.fixture(scope="module")
def copy_prompts(corpus_ids) -> list[list[int]]:
    """Prompts whose continuation copies from themselves: a passage, then its start again."""
    return [corpus_ids[s:s + n] + corpus_ids[s:s + 8] for s, n in ((0, 120), (400, 300), (900, 60))]


def _run(llm: LLM, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params)]


# ---- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, words", [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "unknown method 'medusa'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key 'lookahead'"),
    ('{"method": "ngram"', "not valid JSON"),
])
def test_bad_config_is_one_line(value, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_config_stops_the_server_config():
    from tierserve.server.config import load_config

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        load_config(None, {"speculative_config": '{"method": "ngram", "num_speculative_tokens": -1}'},
                    environ={})
    cfg = load_config(None, {"speculative_config": NGRAM}, environ={})  # a YAML mapping
    assert SpeculativeConfig.parse(cfg.speculative_config).num_speculative_tokens == 4


# ---- the parts ----------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert p.propose([7, 1, 2, 8, 1, 2, 9, 6, 1, 2], 3) == [9, 6, 1]  # the latest match wins
    assert p.propose([1, 2, 3], 4) == []
    assert NgramProposer(2, 3).propose([5, 1, 7, 1], 2) == []  # only 1-grams would match


def test_acceptance_keeps_the_confirmed_prefix_and_the_target_draw():
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 8]) == 2
    assert kept_tokens([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]
    assert kept_tokens([4, 5, 6], [4, 5, 6, 8]) == [4, 5, 6, 8]
    assert kept_tokens([4, 5, 6], [9, 5, 6, 8]) == [9]


def test_scheduler_reserves_proposals_and_rolls_back_rejected_ones():
    pool = BlockPool(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), pool,
                      lambda r: b"")
    req = Request(RequestId("a"), [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), 20)
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, {req.request_id: [7]})  # prefill: 6 computed, 7 tokens
    assert (req.num_computed_tokens, len(req.block_ids)) == (6, 2)
    req.spec_token_ids = [8, 9, 10, 11, 12]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.spec_token_ids, s.samples) == (6, 6, (8, 9, 10, 11, 12), True)
    assert len(req.block_ids) == 3  # positions 6..11
    free_before = pool.num_free
    sched.update(out, {req.request_id: [8, 13]})  # one proposal accepted, then the target's 13
    assert req.output_token_ids == [7, 8, 13] and req.spec_token_ids == []
    assert req.num_computed_tokens == 8  # 7 and 8 computed; 13's KV comes next step
    assert len(req.block_ids) == 2 and pool.num_free == free_before + 1
    # only the full block of verified tokens is published: positions 4..7 = 5, 6, 7, 8
    assert req.num_published_blocks == 2
    assert pool.blocks[req.block_ids[1]].token_ids == (5, 6, 7, 8)


def test_budget_trims_proposals():
    pool = BlockPool(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=4), pool, lambda r: b"")
    req = Request(RequestId("a"), [1, 2], SamplingParams(max_tokens=20), 20)
    sched.add_request(req)
    sched.update(sched.schedule(), {req.request_id: [3]})
    req.spec_token_ids = [4, 5, 6, 7]
    (s,) = sched.schedule().scheduled
    assert s.spec_token_ids == (4, 5) and s.num_new_tokens == 3


class _Fixed:
    """A proposer that proposes k copies of token 7 for every request."""

    def propose(self, rows):
        return {req.request_id: [7] * k for req, k in rows}

    def release(self, request_id):
        pass


def _decoding(n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(RequestId(str(i)), [1, 2, 3], SamplingParams(max_tokens=50), 50)
        r.output_token_ids, r.num_computed_tokens = [4], 3
        reqs.append(r)
    return reqs


def test_proposals_fill_the_step_up_to_the_row_budget():
    from tierserve.engine.spec.speculator import Speculator

    spec = Speculator(SpeculativeConfig("ngram", 4), _Fixed(), 1000, row_budget=8)
    one = _decoding(1)
    spec.propose(one)
    assert one[0].spec_token_ids == [7] * 4
    three = _decoding(3)
    spec.propose(three)
    assert sorted(len(r.spec_token_ids) for r in three) == [0, 1, 4]  # 3 decodes + 5
    full = _decoding(8)
    spec.propose(full)
    assert all(r.spec_token_ids == [] for r in full)  # a compute-bound batch proposes nothing


def test_a_failing_request_holds_off_and_tries_again():
    from tierserve.engine.spec.speculator import Speculator

    spec = Speculator(SpeculativeConfig("ngram", 4), _Fixed(), 1000, row_budget=0)
    (req,) = _decoding(1)
    waits = []
    for failures in (4, 1, 1):  # the rate 1 -> 0.7 -> ... -> 0.24: a hold of 2; then 4, then 8
        for _ in range(failures):
            spec.observe(req.request_id, 4, 0)
        n = 0
        while spec.propose([req]) or not req.spec_token_ids:
            n += 1
        waits.append(n)
    assert waits == [2, 4, 8]
    spec.observe(req.request_id, 4, 4)  # a good verification ends the back-off: 0.51
    spec.observe(req.request_id, 4, 0)  # 0.357
    spec.observe(req.request_id, 4, 0)  # 0.25: held again, from 2 steps
    n = 0
    while spec.propose([req]) or not req.spec_token_ids:
        n += 1
    assert n == 2


# ---- the engine: the same tokens --------------------------------------------------------------

def test_greedy_tokens_equal_without_speculation(llm, spec_llm, copy_prompts, varied_prompts):
    prompts = copy_prompts + varied_prompts[1::4]  # a quarter of the parity prompts: 2 to 1,100
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in _run(llm, prompts, params)]
    before = spec_llm.engine.spec_stats()
    got = [o.token_ids for o in _run(spec_llm, prompts, params)]
    assert got == want
    stats = spec_llm.engine.spec_stats()
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert accepted >= 40, stats  # the copy prompts make proposals worth keeping


@pytest.fixture(scope="module")
def mixed(llm, copy_prompts, corpus_ids) -> tuple[list, list, list]:
    """32 mixed-length requests (copy prompts, plain text of 5 to 284 tokens; 4 to 20 tokens
    out) and their tokens without speculation."""
    prompts = [(copy_prompts[i % 3] if i % 2 else corpus_ids[50 * i:50 * i + 5 + 9 * i])
               for i in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (i * 5) % 17, ignore_eos=True)
              for i in range(32)]
    return prompts, params, [o.token_ids for o in _run(llm, prompts, params)]


def test_32_mixed_requests_served_together(spec_llm, mixed):
    prompts, params, want = mixed
    before = spec_llm.engine.spec_stats().num_drafts
    assert [o.token_ids for o in _run(spec_llm, prompts, params)] == want
    assert spec_llm.engine.spec_stats().num_drafts - before >= 32


def test_stops_lengths_and_logprobs_hold_at_accepted_positions(llm, spec_llm, copy_prompts):
    tok = llm.get_tokenizer()
    plain = _run(llm, copy_prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    # a stop string from inside each greedy output, and a length that ends inside a verified run
    cases = [SamplingParams(temperature=0.0, max_tokens=30, stop=[o.text[12:18]], logprobs=2)
             for o in plain] + [SamplingParams(temperature=0.0, max_tokens=n, logprobs=1,
                                               stop_token_ids=[plain[0].token_ids[9]])
                                for n in (3, 7)]
    prompts = copy_prompts + copy_prompts[:2]
    for p, prompt in zip(cases, prompts):
        (a,), (b,) = _run(llm, [prompt], p), _run(spec_llm, [prompt], p)
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
            (a.text, a.token_ids, a.finish_reason, a.stop_reason)
        assert [(x.token_id, x.rank, [t for t, _ in x.top]) for x in b.logprobs] == \
            [(x.token_id, x.rank, [t for t, _ in x.top]) for x in a.logprobs]
        assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
                   for x, y in zip(a.logprobs, b.logprobs))
    assert tok.decode(plain[0].token_ids)


def test_seeded_samples_are_the_same_tokens(llm, spec_llm, copy_prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=30,
                             ignore_eos=True, repetition_penalty=1.05) for i in range(3)]
    want = [o.token_ids for o in _run(llm, copy_prompts, params)]
    assert [o.token_ids for o in _run(spec_llm, copy_prompts, params)] == want


def test_rejected_positions_never_reach_the_prefix_cache(spec_llm, llm, copy_prompts):
    """A verified request's published blocks are reused by a later request: what that request
    generates equals a cold run's tokens, so the cached KV is the verified tokens' KV."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    (first,) = spec_llm.generate([copy_prompts[1]], params)
    follow = copy_prompts[1] + list(first.outputs[0].token_ids)
    (warm,) = spec_llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=12,
                                                          ignore_eos=True))
    assert warm.num_cached_tokens >= len(copy_prompts[1]) + 32
    cold = LLM(enable_prefix_caching=False, **ENGINE)
    (ref,) = cold.generate([follow], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert warm.outputs[0].token_ids == ref.outputs[0].token_ids


def test_blocks_come_back_after_speculation(spec_llm, copy_prompts):
    pool = spec_llm.engine.pool
    free = pool.num_free
    _run(spec_llm, copy_prompts, SamplingParams(temperature=0.0, max_tokens=20))
    assert pool.num_free == free and spec_llm.engine.num_tracked == 0


def test_structured_outputs_do_not_speculate_and_keep_their_grammar(llm, spec_llm):
    from tierserve.engine.sampling_params import StructuredOutput

    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutput
                            .choice(["alpha beta alpha beta", "gamma"]))
    prompt = "Say alpha beta alpha beta:"
    before = spec_llm.engine.spec_stats().num_drafts
    (a,), (b,) = _run(llm, [prompt], params), _run(spec_llm, [prompt], params)
    assert b.text == a.text and b.text in ("alpha beta alpha beta", "gamma")
    assert spec_llm.engine.spec_stats().num_drafts == before


def test_opt_out_proposes_nothing(spec_llm, copy_prompts):
    from tierserve.engine.core.kv_hints import KVHints

    before = spec_llm.engine.spec_stats().num_drafts
    spec_llm.generate(copy_prompts, SamplingParams(temperature=0.0, max_tokens=20),
                      kv_hints=KVHints(speculative=False))
    assert spec_llm.engine.spec_stats().num_drafts == before


# ---- sampled rows: the same distribution -----------------------------------------------------

LETTERS = 4


def _first_tokens(llm: LLM, prompt: list[int], ids: list[int], n: int,
                  seeded: bool = False) -> list[tuple[int, ...]]:
    """Tokens 2..4 of n requests (seeds 0..n-1, or none) that may only write the ids
    (logit_bias)."""
    bias = {t: 100.0 for t in ids}
    params = [SamplingParams(temperature=1.0, max_tokens=4, logit_bias=bias, ignore_eos=True,
                             seed=i if seeded else None) for i in range(n)]
    return [tuple(o.outputs[0].token_ids[1:4]) for o in llm.generate([prompt] * n, params)]


def _chi_square_p(a: list, b: list) -> float:
    """p-value of Pearson's chi-square test that two samples of categories share one distribution
    (categories seen fewer than 5 times in all are pooled)."""
    import torch

    counts = {c: (a.count(c), b.count(c)) for c in set(a) | set(b)}
    rare = [c for c, (x, y) in counts.items() if x + y < 5]
    table = [v for c, v in counts.items() if c not in rare]
    if rare:
        table.append((sum(counts[c][0] for c in rare), sum(counts[c][1] for c in rare)))
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in table:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(table) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def letters(llm) -> tuple[list[int], list[int]]:
    """A prompt that repeats a cycle of LETTERS tokens (so n-grams propose its continuation): 35
    tokens, two full blocks that the prefix cache keeps, so each request computes 3 of them."""
    ids = [llm.get_tokenizer().encode(c, add_special_tokens=False)[0] for c in " a b c d".split(" ")[1:]]
    assert len(set(ids)) == LETTERS
    return (ids * 9)[:-1], ids


@pytest.fixture(scope="module")
def plain_seeded(llm, letters) -> list[tuple[int, ...]]:
    """300 seeded samples without speculation (the same tokens each time: computed once)."""
    prompt, ids = letters
    return _first_tokens(llm, prompt, ids, 300, seeded=True)


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_distribution_is_the_same(llm, spec_llm, letters, plain_seeded, seeded):
    prompt, ids = letters
    n = 300
    plain = [t[0] for t in (plain_seeded if seeded else _first_tokens(llm, prompt, ids, n))]
    before = spec_llm.engine.spec_stats()
    spec = [t[0] for t in _first_tokens(spec_llm, prompt, ids, n, seeded)]
    after = spec_llm.engine.spec_stats()
    assert after.num_draft_tokens - before.num_draft_tokens >= n  # proposals were verified
    assert _chi_square_p(plain, spec) > 0.01


def test_a_wrong_acceptance_rule_is_caught(spec_llm, letters, plain_seeded):
    """Keeping the first proposal unverified (a plausible bug) shifts the distribution far
    enough for the same test to see it."""
    prompt, ids = letters
    n = 300
    plain = [t[0] for t in plain_seeded]
    runner = spec_llm.engine.executor.runner
    runner.accept = lambda proposals, draws: max(1, accepted_prefix(proposals, draws))
    try:
        wrong = [t[0] for t in _first_tokens(spec_llm, prompt, ids, n, seeded=True)]
    finally:
        runner.accept = accepted_prefix
    assert _chi_square_p(plain, wrong) < 0.01


# ---- the draft model ------------------------------------------------------------------------------

def test_embedded_model_as_its_own_draft_accepts_everything(mixed):
    draft = LLM(speculative_config={"method": "draft_model", "model": "smollm2-135m",
                                    "num_speculative_tokens": 3, "compute_bound_batch": 0},
                **ENGINE)
    # the first 16 of the mixed requests (prompts of 5 to 140 tokens) served together: the draft
    # prefills every prompt too, and all 32 took 18 s of prefill on 2 cores for the same check
    prompts, params, want = (part[:16] for part in mixed)
    assert [o.token_ids for o in _run(draft, prompts, params)] == want
    s = draft.engine.spec_stats()
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens >= 0.97 * s.num_draft_tokens, s
    assert draft.engine.speculator.proposer.pool.num_free == draft.engine.speculator.proposer.pool.num_blocks


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    import shutil

    import torch
    import transformers

    from tierserve.engine.worker.loaders import load_model_source

    src = load_model_source("smollm2-135m")
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    src.tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="another vocabulary") as e:
        LLM(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2}, **ENGINE)
    assert "\n" not in str(e.value)
    shutil.rmtree(tmp_path)


# ---- the server ---------------------------------------------------------------------------------

def test_server_header_metrics_and_stream(tmp_path, copy_prompts, llm):
    import httpx
    import openai

    from server_fixtures import run_server, scrape

    prompt = llm.get_tokenizer().decode(copy_prompts[1])
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    with run_server(tmp_path, "--speculative-config", json.dumps(NGRAM)) as srv:
        assert httpx.get(srv.base_url + "/v1/backends", timeout=10).json()["speculative"] == \
            "ngram k=4 lookup 1..4"
        bad = httpx.post(srv.base_url + "/v1/completions", headers={"X-Speculative": "maybe"},
                         json=body, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Speculative"
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")

        def drafts() -> float:
            return scrape(srv).get("vllm:spec_decode_num_drafts_total", 0.0)

        before = drafts()
        off = client.completions.create(**body, extra_headers={"X-Speculative": "off"})
        assert drafts() == before
        stream = client.completions.create(**body, stream=True)
        text = "".join(c.choices[0].text for c in stream)
        assert text == off.choices[0].text  # greedy: the same text either way
        m = scrape(srv)
        assert m["vllm:spec_decode_num_drafts_total"] > before
        assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= \
            m["vllm:spec_decode_num_draft_tokens_total"]
        assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] >= \
            m["vllm:spec_decode_num_accepted_tokens_per_pos_total{position=3}"]


def test_header_on_without_speculation_is_400(plain_server):
    import httpx

    srv = plain_server
    r = httpx.post(srv.base_url + "/v1/completions", headers={"X-Speculative": "on"},
                   json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "X-Speculative" and "--speculative-config" in err["message"]
