"""Gemma 3 (issue 45): a small synthetic GGUF in llama.cpp's layout (five windowed layers and one
whole-context layer, a window of 8, Q8_0 / Q5_0 / Q4_0 / Q4_K / Q6_K / F16 / F32 tensors) and a
Hugging Face directory, served by the engine and compared with transformers' Gemma3ForCausalLM
reading the same weights (transformers' own GGUF loader for the file): greedy tokens, their
logprobs, the prompt logprobs, with prompts well past the window, batched, chunked, and with
prefix-cache hits. Then the window bound itself in the torch backends, and the options a
windowed model refuses."""

from __future__ import annotations

import pytest
import torch

import gemma3_fixtures as gf
from tierserve.engine import LLM, SamplingParams
from tierserve.engine.worker.loaders import load_model_source
from tierserve.kernels.base import BatchLayout
from tierserve.kernels.native import load_extension
from tierserve.kernels.router import RouteQuery, route
from tierserve.kernels.torch_ref import TorchRefBackend
from tierserve.kernels.torch_sdpa import TorchSdpaBackend

NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0)
ATOL = 1e-4
"""fp32 on both sides: the fused q/k/v and gate/up GEMMs and the native kernels differ from
transformers' in the last bits only (measured: a few 1e-6)."""


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory) -> gf.GemmaFile:
    return gf.write_gemma3_gguf(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def reference(gemma_file):
    return gf.transformers_model(gemma_file)


def _prompts(*lens: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, gf.VOCAB, (n,), generator=g).tolist() for n in lens]


def _assert_matches(model, prompts, outs, prompt_lps: bool = True) -> None:
    for prompt, out in zip(prompts, outs):
        tokens, lps, plps = gf.greedy(model, prompt, NEW)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens diverges"
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(lps, abs=ATOL)
        if prompt_lps:
            assert [lp.logprob for lp in out.prompt_logprobs[1:]] == pytest.approx(plps, abs=ATOL)


def test_the_loader_reads_llama_cpps_gemma3(gemma_file):
    src = load_model_source(gemma_file.path)
    c = src.config
    assert (c.architecture, c.sliding_window, c.sliding_layers) == ("gemma3", 8, (0, 1, 2, 3, 4))
    assert (c.rope_theta, c.rope_local_base_freq, c.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert c.qk_norm and c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
    assert {b.kind for b in src.blocks.values()} == {"Q8_0", "Q5_0", "Q4_K", "Q4_0", "Q6_K"}
    assert "model.layers.5.post_feedforward_layernorm.weight" in src.weights


@pytest.mark.parametrize("backend", [None, "torch_sdpa", "torch_ref"])
def test_batched_greedy_matches_transformers(gemma_file, reference, backend):
    """Four prompts in one batch, three of them past the window of 8 (the router's choice is
    cpu_native, whose windowed layers run its torch SDPA path)."""
    llm = LLM(model=gemma_file.path, kv_cache_memory_bytes=1 << 24, attention_backend=backend)
    prompts = _prompts(40, 33, 21, 5)
    _assert_matches(reference, prompts, llm.generate(prompts, PARAMS))


def test_chunked_prefill_and_prefix_cache_hits_match_transformers(gemma_file, reference):
    """Prefill in chunks of at most 16 tokens (windowed chunks after cached tokens), then
    prompts that share two full blocks with the first: their prefill starts at token 32."""
    llm = LLM(model=gemma_file.path, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=16)
    first = _prompts(40)[0]
    _assert_matches(reference, [first], llm.generate([first], PARAMS))
    shared = [first[:32] + tail for tail in _prompts(9, 14, seed=2)]
    outs = llm.generate(shared, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                                               logprobs=0))
    assert [o.num_cached_tokens for o in outs] == [32, 32]
    _assert_matches(reference, shared, outs, prompt_lps=False)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_hf_directory_matches_transformers(tmp_path):
    """config.json's layer_types, a query_pre_attn_scalar apart from head_dim and linear RoPE
    scaling on the whole-context layer reach the model."""
    reference = gf.write_hf_dir(tmp_path)
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=1 << 24)
    assert llm.engine.model_config.sliding_layers == (0, 2)
    prompts = _prompts(30, 11)
    _assert_matches(reference, prompts, llm.generate(prompts, PARAMS))


def test_kept_blocks_match_transformers(tmp_path):
    """Every linear block-quantized as in a real Q4_K_M Gemma 3 (Q5_0 q/k, Q8_0 v, Q4_K, Q6_K;
    Q4_0 too): gguf-exact keeps the file's blocks (and the Q8_0 embedding), the fp32 path's
    results."""
    types = {**gf.TYPES, "attn_k": "Q5_0", "ffn_up": "Q5_0"}
    f = gf.write_gemma3_gguf(tmp_path, seed=3, types=types)
    llm = LLM(model=f.path, kv_cache_memory_bytes=1 << 24, quantization="gguf-exact")
    assert llm.engine.config.quantization == "gguf-exact"
    prompts = _prompts(36, 17)
    _assert_matches(gf.transformers_model(f), prompts, llm.generate(prompts, PARAMS))


# ---- the window in the backends ---------------------------------------------------------------

def _windowed_step(seed: int = 0):
    """One step over a random paged cache: a decode at context 20, a chunk of 5 after 25 cached
    tokens, a fresh prompt of 12; block size 4. q/k/v of the new tokens are the cache's own."""
    g = torch.Generator().manual_seed(seed)
    h, hkv, d, bs = 4, 2, 16, 4
    qlens, ctxs = [1, 5, 12], [20, 30, 12]
    tables = torch.zeros(3, 8, dtype=torch.long)
    starts, slots, nxt = [0], [], 0
    for s, (ql, ctx) in enumerate(zip(qlens, ctxs)):
        n = -(-ctx // bs)
        tables[s, :n] = torch.arange(nxt, nxt + n)
        nxt += n
        pos = torch.arange(ctx - ql, ctx)
        slots.append(tables[s, pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + ql)
    layout = BatchLayout(1, qlens, ctxs, starts, tables, torch.cat(slots), bs)
    cache = torch.randn(2, hkv, nxt * bs, d, generator=g)
    q = torch.randn(starts[-1], h, d, generator=g)
    return layout, cache, q, (h, hkv, d)


def _attend(backend_cls, layout, cache, q, shape, window):
    be = backend_cls(*shape, shape[2] ** -0.5)
    k, v = (cache[i][:, layout.slot_mapping].transpose(0, 1) for i in (0, 1))
    return be.forward(q, k, v, cache, be.build_metadata(layout), window)


@pytest.mark.parametrize("backend_cls", [TorchSdpaBackend, TorchRefBackend])
def test_a_key_outside_the_window_changes_nothing(backend_cls):
    """A query at position p sees keys at (p - 4, p]: rewriting the key and value at position 3
    of every sequence changes exactly the rows of queries at positions 3 to 6."""
    layout, cache, q, shape = _windowed_step()
    before = _attend(backend_cls, layout, cache, q, shape, window=4)
    changed = cache.clone()
    for s in range(layout.num_seqs):
        slot = layout.block_tables[s, 0] * layout.block_size + 3
        changed[:, :, slot] = torch.randn(2, shape[1], shape[2])
    after = _attend(backend_cls, layout, changed, q, shape, window=4)
    positions = torch.cat([torch.arange(c - n, c) for n, c in
                           zip(layout.query_lens, layout.context_lens)])
    seen = (positions >= 3) & (positions < 3 + 4)
    assert seen.sum() == 4  # the fresh prompt's rows at positions 3..6
    assert torch.equal(after[~seen], before[~seen])
    assert not torch.isclose(after[seen], before[seen]).all(dim=-1).any()
    whole = _attend(backend_cls, layout, changed, q, shape, window=None)
    cut = positions >= 4  # rows whose window leaves keys out
    assert not torch.isclose(whole[cut], after[cut]).all(dim=-1).any()


def test_sdpa_window_matches_the_reference():
    layout, cache, q, shape = _windowed_step(seed=1)
    for window in (1, 4, 7, 64):
        got = _attend(TorchSdpaBackend, layout, cache, q, shape, window)
        want = _attend(TorchRefBackend, layout, cache, q, shape, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hd", [(4, 1, 256), (6, 2, 64)])  # the generic kernel, a compiled one
def test_native_decode_takes_the_window_bounds(hd):
    """cpu_native's decode kernel with a window (a decode-only step: windowed layers read only
    the blocks their window reaches) against the reference, at windows inside one block, across
    blocks and wider than every context; contexts 1 to 45 (some shorter than the window)."""
    from tierserve.kernels.cpu_native import CpuNativeBackend

    if load_extension() is None:
        pytest.skip("the native extension is not built")
    h, hkv, d = hd
    g = torch.Generator().manual_seed(h)
    ctxs, bs = [45, 1, 17, 33, 8], 16
    tables = torch.zeros(len(ctxs), 3, dtype=torch.long)
    nxt = 0
    for s, ctx in enumerate(ctxs):
        n = -(-ctx // bs)
        tables[s, :n] = torch.randperm(8, generator=g)[:n] + nxt
        nxt += 8
    slots = torch.stack([tables[s, (c - 1) // bs] * bs + (c - 1) % bs for s, c in enumerate(ctxs)])
    layout = BatchLayout(len(ctxs), [1] * len(ctxs), ctxs, list(range(len(ctxs) + 1)), tables,
                         slots, bs)
    cache = torch.randn(2, hkv, nxt * bs, d, generator=g)
    q = torch.randn(len(ctxs), h, d, generator=g)
    k, v = (cache[i][:, slots].transpose(0, 1) for i in (0, 1))
    for dtype in (torch.float32, torch.float16):
        c = cache.to(dtype)
        native = CpuNativeBackend(h, hkv, d, d ** -0.5, kv_dtype=dtype)
        ref = TorchRefBackend(h, hkv, d, d ** -0.5)
        for window in (3, 16, 20, 64, None):
            got = native.forward(q, k, v, c, native.build_metadata(layout), window)
            want = ref.forward(q, k, v, c.float(), ref.build_metadata(layout), window)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- what a windowed model refuses -------------------------------------------------------------

def test_gpu_backends_are_refused_for_windowed_models_with_the_reason():
    q = RouteQuery("cuda", torch.bfloat16, "auto", 256, 4, 1, 16, capability=(9, 0),
                   sliding_window=True)
    r = route(q, installed=lambda _: True)
    assert r.backend == "torch_sdpa"
    for name in ("flashinfer", "triton"):
        assert "sliding-window" in r.rejected[name]
    with pytest.raises(ValueError, match="flashinfer cannot run decode here: no sliding-window"):
        route(q, "flashinfer", installed=lambda _: True)
    plain = route(RouteQuery("cuda", torch.bfloat16, "auto", 256, 4, 1, 16, capability=(9, 0)),
                  installed=lambda _: True)
    assert plain.backend == "flashinfer"


@pytest.mark.parametrize("option, why", [
    (dict(sparse_topk_blocks=4), "sparse top-k decode"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding"),
    (dict(tensor_parallel_size=2), "gemma3 has no tensor-parallel path"),
])
def test_options_a_windowed_model_cannot_take_are_refused(gemma_file, option, why):
    with pytest.raises(ValueError, match=why):
        LLM(model=gemma_file.path, kv_cache_memory_bytes=1 << 24, **option)
