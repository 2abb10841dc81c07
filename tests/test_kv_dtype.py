"""KV cache dtypes: names, bytes per value, fp8 and fp16 greedy agreement with an fp32 cache."""

from __future__ import annotations

import pytest
import torch

from tierserve.engine import LLM, SamplingParams
from tierserve.kernels.kv_dtype import canonical_kv_dtype, kv_elem_size, kv_torch_dtype


def test_names_and_bytes():
    assert canonical_kv_dtype("auto", "bfloat16") == "bfloat16"
    assert canonical_kv_dtype("fp16", "float32") == "float16"
    assert kv_torch_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert [kv_elem_size(n, "float32") for n in ("auto", "bf16", "fp16", "fp8_e4m3")] == [4, 2, 2, 1]
    assert kv_elem_size("auto", "float16") == 2
    with pytest.raises(ValueError, match="valid: auto, float32, float16, bfloat16, fp8_e4m3"):
        canonical_kv_dtype("int4", "float32")


PROMPTS = ["The capital of France is", "Once upon a time, there was a",
           "The best way to learn programming is", "Water boils at", "In 1969, astronauts",
           "My favorite food is", "The theory of relativity says that", "To make a cup of tea, you",
           "The largest planet in the solar system", "Dogs are popular pets because",
           "A computer is a machine that", "The weather today is",
           "Shakespeare wrote many plays, including", "Photosynthesis is the process by which",
           "The stock market", "Learning a new language can"]


@pytest.fixture(scope="module")
def fp8_llm() -> LLM:
    """One-token prefill chunks, so every position attends through the fp8 cache (a fresh prompt
    chunk would otherwise attend to its own unquantized K/V)."""
    return LLM(kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=1 << 28,
               long_prefill_token_threshold=1, quantization="gguf-exact")


def test_fp8_cache_is_one_byte_and_routes_off_cpu_native(fp8_llm):
    runner = fp8_llm.engine.executor.runner
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    assert runner.kv_bytes == sum(c.numel() for c in runner.kv_caches)
    # the same byte budget holds 4x the blocks of an fp32 cache
    mc = runner.model_cfg
    assert runner.num_blocks == (1 << 28) // (runner.block_size * mc.kv_bytes_per_token(1))
    for phase in ("prefill", "decode"):
        route = runner.routes[phase]
        assert route.backend == "torch_sdpa"
        assert route.rejected["cpu_native"].startswith("KV dtype fp8_e4m3 not in")


def _teacher_forced_agreement(llm: LLM, other: LLM) -> tuple[int, int]:
    """16 prompts x 32 greedy tokens of the fp32-KV engine `llm`, teacher-forced through `other`:
    (positions where other's greedy choice, rank 1, is the same token, positions)."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    forced = other.generate([p + r for p, r in zip(prompts, ref)],
                            SamplingParams(max_tokens=1, prompt_logprobs=0))
    ranks = [o.prompt_logprobs[i].rank for p, o in zip(prompts, forced)
             for i in range(len(p), len(o.prompt_token_ids))]
    return sum(r == 1 for r in ranks), len(ranks)


def test_fp8_greedy_agrees_with_fp32(llm, fp8_llm):
    """The fp8-KV engine's greedy choice matches the fp32 one at >= 95% of teacher-forced
    positions. (Free-running outputs compound the first disagreement, so they diverge much
    sooner: even a bf16 cache agrees on under 90% of free-running tokens with this 135M model.)"""
    agree, n = _teacher_forced_agreement(llm, fp8_llm)
    assert n == 512
    assert agree / n >= 0.95, f"fp8 KV agrees on {agree}/{n} greedy tokens"


@pytest.fixture(scope="module")
def fp16_llm() -> LLM:
    # the fp32 path's weights: the cache's rounding is then the only difference
    return LLM(kv_cache_dtype="float16", kv_cache_memory_bytes=1 << 28, quantization="gguf-exact")


def test_fp16_cache_is_two_bytes_on_cpu_native(fp16_llm, monkeypatch):
    """An fp16 cache stays on the native CPU kernels (they widen it as they read), decodes in the
    one-call stack, and holds twice the blocks of an fp32 cache in the same bytes."""
    runner = fp16_llm.engine.executor.runner
    assert all(c.dtype == torch.float16 for c in runner.kv_caches)
    mc = runner.model_cfg
    assert runner.num_blocks == (1 << 28) // (runner.block_size * mc.kv_bytes_per_token(2))
    if runner.routes["decode"].backend != "cpu_native":
        pytest.skip("the native extension is not built here")
    assert runner.routes["prefill"].backend == "cpu_native"
    model = runner.model
    calls = []
    real = model.ops.decode_forward
    monkeypatch.setattr(model.ops, "decode_forward",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    out = fp16_llm.generate(["The capital of France is"] * 3,
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(calls) == 7 and set(calls) == {3}  # every step after the prefill
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8, 8]


def test_fp16_greedy_agrees_with_fp32(llm, fp16_llm):
    """fp16 K/V (10-bit mantissa) keep the fp32 engine's greedy choice at >= 98% of teacher-forced
    positions."""
    agree, n = _teacher_forced_agreement(llm, fp16_llm)
    assert n == 512
    assert agree / n >= 0.98, f"fp16 KV agrees on {agree}/{n} greedy tokens"
