"""Engine behaviour on the real model: prefix cache, preemption, seeds, stops, abort."""

from __future__ import annotations

from tierserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
EXACT = dict(quantization="gguf-exact")
"""Tokens compared across paths (cached or not, preempted or not) need numerics that carry a
last-bit difference in attention as a last-bit difference: the default gguf mode rounds each
linear's input to int8, which can turn one into a different greedy token (docs/quantization.md)."""


def test_prefix_cache_computes_only_new_tokens(corpus_ids):
    llm = LLM(kv_cache_memory_bytes=1 << 29, **EXACT)
    eng = llm.engine
    prefix = corpus_ids[:500]
    first = prefix + corpus_ids[2000:2010]
    second = prefix + corpus_ids[3000:3013]
    llm.generate([first], GREEDY)
    before = eng.stats.computed_tokens
    out = llm.generate([second], GREEDY)[0]
    computed = eng.stats.computed_tokens - before
    cached = (500 // 16) * 16  # full blocks of the shared prefix
    assert out.num_cached_tokens == cached
    # new prompt tokens past the cached blocks, plus one step per output token after the first
    assert computed == len(second) - cached + GREEDY.max_tokens - 1
    cold = LLM(kv_cache_memory_bytes=1 << 29, enable_prefix_caching=False, **EXACT)
    assert out.outputs[0].token_ids == cold.generate([second], GREEDY)[0].outputs[0].token_ids


def test_preemption_recomputes_and_frees_everything(llm, varied_prompts):
    prompts = varied_prompts[4:11]  # 31 .. 512 tokens
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 50 blocks = 800 tokens: far less than the ~1,540 the prompts need at once.
    tight = LLM(num_blocks=50, max_num_batched_tokens=128, **EXACT)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    pool = tight.engine.pool
    assert pool.num_free == pool.num_blocks


def test_seeded_sampling_is_independent_of_batch(llm, corpus_ids):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    target = corpus_ids[100:140]
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = [corpus_ids[500:520], corpus_ids[900:1100], corpus_ids[40:45]]
    mixed = llm.generate([others[0], target, others[1], others[2]],
                         [SamplingParams(temperature=1.0, max_tokens=30)] + [params] +
                         [SamplingParams(temperature=0.5, max_tokens=10, seed=7)] * 2)
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, ignore_eos=True)
    draws = {tuple(llm.generate([target], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1, "sampling without a seed should vary"


def test_n_outputs_and_stop_string(llm):
    tok = llm.get_tokenizer()
    prompt = "List the numbers from one to ten: one, two, three,"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert " five" in full
    # a stop string spanning two tokens, excluded from the text
    stop = full[full.index(" five") - 2: full.index(" five") + 3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[:full.index(stop)]
    assert len(tok.encode(stop)) >= 2
    two = llm.generate([prompt], SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=8))[0]
    assert [c.index for c in two.outputs] == [0, 1]


def test_abort_frees_blocks(llm, corpus_ids):
    eng = llm.engine
    eng.add_request("a", corpus_ids[:300], SamplingParams(max_tokens=100))
    eng.add_request("b", corpus_ids[300:400], SamplingParams(max_tokens=100))
    eng.step()
    assert eng.pool.num_free < eng.pool.num_blocks
    eng.abort_request(["a", "b"])
    assert not eng.has_unfinished_requests()
    assert eng.pool.num_free == eng.pool.num_blocks


def test_max_tokens_min_tokens_and_logprobs(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                 prompt_logprobs=2))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    assert len(c.logprobs) == 5 and all(len(lp.top) == 3 for lp in c.logprobs)
    assert all(lp.rank == 1 and lp.token_id == t for lp, t in zip(c.logprobs, c.token_ids))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    eos = llm.engine.model_config.eos_token_ids[0]
    forced = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                 logit_bias={eos: 100.0}))[0].outputs[0]
    assert len(forced.token_ids) == 12 and eos not in forced.token_ids
    biased = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3,
                                                 logit_bias={eos: 100.0}))[0].outputs[0]
    assert biased.token_ids == [eos] and biased.finish_reason == "stop"
