"""The native CPU extension's fused element-wise ops against the torch code they replace, and the
model with them on against the model with them off."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from tierserve.engine import SamplingParams
from tierserve.engine.worker.models.layers import RotaryEmbedding, rope_inv_freq
from tierserve.kernels.native import load_extension

ext = load_extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the native extension could not be built here")


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows split across threads
def test_add_rms_norm_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    want_res = res + x
    want = F.rms_norm(want_res, (576,), w, 1e-5)
    ext.add_rms_norm_(x, res, w, 1e-5)
    assert torch.equal(res, want_res)  # the residual stream is exact
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 40, 1024])
def test_silu_and_mul_matches_torch(rows):
    gu = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 6
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ext.silu_and_mul(gu), F.silu(gate) * up, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 7, 1024])
def test_silu_and_mul_in_bf16_rounds_once(rows):
    """--prefill-bf16's MLP: bf16 in and out, fp32 math, one rounding (torch's bf16 silu then
    mul round twice); widths that leave a scalar tail included."""
    gu = (torch.randn(rows, 2 * 1539, generator=torch.Generator().manual_seed(rows)) * 6).bfloat16()
    gate, up = gu.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).bfloat16()
    got = ext.silu_and_mul(gu)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got == want).float().mean() > 0.999  # fast_exp may move a last bit, rarely
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-30)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_store_kv_is_bit_identical_to_torch(kv_dtype):
    """An fp16 cache gets K/V rounded as tensor.to(torch.float16) rounds (nearest-even)."""
    h, hkv, d, t, slots = 9, 3, 64, 37, 128
    rope = RotaryEmbedding(rope_inv_freq(d, 100000.0, None), 4096)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    pos = torch.randint(0, 4096, (t,), generator=g)
    slot = torch.randperm(slots, generator=g)[:t]
    view = qkv.view(t, h + 2 * hkv, d)
    want_qk = rope(pos, view[:, :h + hkv])
    want_cache = torch.zeros(2, hkv, slots, d)
    want_cache[0][:, slot] = want_qk[:, h:].transpose(0, 1)
    want_cache[1][:, slot] = view[:, h + hkv:].transpose(0, 1)
    cache = torch.zeros(2, hkv, slots, d, dtype=kv_dtype)
    ext.rope_store_kv_(qkv, pos, rope.cos, rope.sin, cache, slot, h, hkv)
    assert torch.equal(view[:, :h + hkv], want_qk)
    assert torch.equal(cache, want_cache.to(kv_dtype))


def test_argmax_rows_takes_the_first_maximum():
    x = torch.randn(6, 49152, generator=torch.Generator().manual_seed(1))
    x[2, 10] = x[2, 20] = 100.0  # a tie: the first index, as torch.argmax
    x[3] = 0.0
    got = ext.argmax_rows(x)
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got[2] == 10 and got[3] == 0


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (6, 576, 49152), (7, 33, 17), (64, 1536, 576),
                                   (8, 64, 49), (9, 64, 16), (13, 64, 40), (24, 100, 40),
                                   (25, 64, 33), (47, 576, 960), (65, 200, 50), (300, 576, 3072),
                                   (1024, 64, 97)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(m, k, n, bias):
    """Every row-tile height (the 6x16 tile's 1..6; the AVX-512 wide tiles' 1..8, over groups of
    1, 2 or 3 panels), N not a multiple of the 16-column panel or of a 3-panel group, a bias,
    threads."""
    g = torch.Generator().manual_seed(m * n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = ext.packed_linear(x, ext.pack_linear_weight(w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * k ** 0.5)


def test_packed_linear_rows_do_not_depend_on_the_batch():
    """A decode-sized product and a prefill-sized one give the same rows bit for bit, whatever
    row tiles they split into: the engine's outputs do not depend on the batch."""
    g = torch.Generator().manual_seed(11)
    w, b, x = torch.randn(200, 576, generator=g), torch.randn(200, generator=g), torch.randn(300, 576, generator=g)
    panels = ext.pack_linear_weight(w)
    full = ext.packed_linear(x, panels, 200, b)
    for m in (1, 5, 8, 9, 17, 24, 40, 64, 65, 299):
        assert torch.equal(ext.packed_linear(x[:m], panels, 200, b), full[:m]), m


def test_packed_linear_reads_strided_rows():
    """x may be a view whose rows are wider than K (a slice of a fused projection)."""
    g = torch.Generator().manual_seed(5)
    wide, w = torch.randn(9, 100, generator=g), torch.randn(24, 64, generator=g)
    x = wide[:, 10:74]
    torch.testing.assert_close(ext.packed_linear(x, ext.pack_linear_weight(w), 24), x @ w.T)


def test_packed_linear_keeps_one_copy_and_gives_its_weight_back():
    """Once packed for the native kernel, a linear keeps its fp32 weight only in the panels (the
    dense tensor is emptied: no second copy in memory), reads them back exactly, and packed again
    for oneDNN (the extension off) it has its dense weight again; under --prefill-bf16 the dense
    weight stays (that path casts it every batch)."""
    from tierserve.engine.worker.models.layers import Linear

    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(50, 64, generator=g), torch.randn(50, generator=g), torch.randn(7, 64, generator=g)
    lin = Linear(64, 50, bias=True)
    lin.weight.data, lin.bias.data = w.clone(), b.clone()
    lin.ops = ext
    lin.pack(64)
    assert lin.weight.numel() == 0 and torch.equal(lin.dense_weight(), w)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    lin.ops = None
    lin.pack(64)
    assert torch.equal(lin.weight, w) and lin._panels is None
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    lin.ops, lin.bf16_min_rows = ext, 8
    lin.pack(64)
    assert torch.equal(lin.weight, w) and lin._panels is not None


def _greedy(engine, prompts, salt: str) -> list[list[int]]:
    """Run to completion; a cache salt of its own keeps the prefix cache from serving a prompt."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = engine.stats.computed_tokens
    for i, p in enumerate(prompts):
        engine.add_request(f"{salt}-{i}", p, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    # every prompt token and every output token but the last ran through the model: no cache hit
    assert engine.stats.computed_tokens - before == sum(len(p) + 23 for p in prompts)
    return [done[f"{salt}-{i}"] for i in range(len(prompts))]


def test_model_gives_the_same_tokens_with_native_ops_off(llm, varied_prompts):
    engine, runner = llm.engine, llm.engine.executor.runner
    assert runner.native is ext  # CPU fp32: the engine uses the extension
    prompts = [varied_prompts[i] for i in (3, 9, 10)]  # 17, 333 and 512 tokens
    before = engine.stats.computed_tokens
    fused = _greedy(engine, prompts, "fused")
    computed = engine.stats.computed_tokens - before
    runner.model.use_native_ops(None)
    try:
        plain = _greedy(engine, prompts, "plain")
    finally:
        runner.model.use_native_ops(ext)
    assert engine.stats.computed_tokens - before == 2 * computed  # both ran the whole prompts
    assert fused == plain


@pytest.mark.parametrize("spin_us", [0, 1000])
def test_worker_pool_results_do_not_depend_on_spin_or_threads(spin_us):
    """The extension's own workers (csrc/thread_pool.h): asleep at once or spinning, 1 to 3
    threads, every row and column of a split product is computed once and the same way."""
    g = torch.Generator().manual_seed(spin_us)
    w, x = torch.randn(1000, 576, generator=g), torch.randn(37, 576, generator=g)
    panels = ext.pack_linear_weight(w)
    threads, spin = torch.get_num_threads(), ext.spin_us()
    try:
        ext.set_spin_us(spin_us)
        torch.set_num_threads(1)
        want = ext.packed_linear(x, panels, 1000)
        for n in (2, 3):
            torch.set_num_threads(n)
            for _ in range(3):  # back-to-back loops find the workers awake (or asleep)
                assert torch.equal(ext.packed_linear(x, panels, 1000), want)
    finally:
        torch.set_num_threads(threads)
        ext.set_spin_us(spin)
    torch.testing.assert_close(want, x @ w.T, rtol=1e-5, atol=1e-3)


def test_worker_pool_serves_two_calling_threads():
    """Two Python threads in the extension at once: one loop runs on the pool, the other inline;
    both results are right."""

    g = torch.Generator().manual_seed(9)
    w = torch.randn(2048, 576, generator=g)
    panels = ext.pack_linear_weight(w)
    xs = [torch.randn(64, 576, generator=g) for _ in range(8)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda x: ext.packed_linear(x, panels, 2048), xs))
    for x, y in zip(xs, got):
        torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-3)


class _CountingOps:
    """The extension, counting the model's one-call decode steps and the team sizes they ask for
    (decode_forward's last argument)."""

    def __init__(self, ops):
        self.ops, self.calls, self.teams = ops, 0, set()

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def decode_forward(self, *args, **kwargs):
        self.calls += 1
        self.teams.add(args[-1])
        return self.ops.decode_forward(*args, **kwargs)


def _greedy_logprobs(engine, prompts, salt: str, run: str = ""):
    """Greedy tokens and logprobs; prompts under one cache salt share their cached blocks (a
    second run with another `run` name decodes again from the prompts' cached KV)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ids = [f"{salt}{run}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return [(done[rid].token_ids, done[rid].logprobs) for rid in ids]


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_stack_in_one_call_is_bit_identical(llm, varied_prompts, monkeypatch, threads):
    """csrc/decode_forward.cpp: decode-only steps run every layer in one native call by a team of
    torch's threads (each GEMM's panels and the attention rows split between them, down to a batch
    of 1 on two threads); tokens and logprobs equal layer by layer's to the bit, for contexts of 1
    to 1,500 tokens. The second run decodes from the first's cached prompts (prefill is not what
    differs)."""
    model = llm.engine.executor.runner.model
    counting = _CountingOps(model.ops)
    monkeypatch.setattr(model, "ops", counting)
    prompts = [varied_prompts[i] for i in (0, 2, 7, 11, 15)]
    assert min(map(len, prompts)) <= 2 and max(map(len, prompts)) >= 1000
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setattr(model, "stack_decode_min_batch", 1)
        one_call = _greedy_logprobs(llm.engine, prompts, f"stack-{threads}")
        assert counting.calls >= 8  # the steps after the last prefill chunk
        assert counting.teams == {threads}
        monkeypatch.setattr(model, "stack_decode_min_batch", 0)
        calls = counting.calls
        by_layer = _greedy_logprobs(llm.engine, prompts, f"stack-{threads}", "layers")
        assert counting.calls == calls
    finally:
        torch.set_num_threads(old)
    assert one_call == by_layer


def test_decode_stack_team_from_two_calling_threads(llm):
    """Two threads call decode_forward at once: one gets the worker pool, the other's team runs
    inline on its own thread, without barriers (thread_pool.h); both give what one call alone
    gives. (A team waiting at a barrier for a member that never runs would hang here.)"""
    model = llm.engine.executor.runner.model
    cfg, rope = model.config, model.layers[0].self_attn.rope
    B, bs, ctx = 6, 16, 40
    nb = -(-(ctx + 1) // bs)
    tables = torch.arange(1, B * nb + 1).view(B, nb)
    lens = torch.full((B,), ctx + 1, dtype=torch.long)
    pos = torch.full((B,), ctx, dtype=torch.long)
    slots = tables[:, ctx // bs] * bs + ctx % bs
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, cfg.hidden_size, generator=g)
    # one cache set per calling thread; a call stores the same K/V at the same slots every time
    caches = [[torch.randn(2, cfg.num_kv_heads, (B * nb + 1) * bs, cfg.head_dim, generator=g)
               for _ in model.layers]]
    caches.append([c.clone() for c in caches[0]])

    def call(team, which):
        x = x0.clone()
        h = model.layers[0].input_layernorm(x0)
        return model.ops.decode_forward(h, x, pos, slots, model._stack, model.norm.weight,
                                        caches[which], rope.cos, rope.sin, tables, lens, bs,
                                        cfg.head_dim ** -0.5, model.norm.eps, cfg.num_heads,
                                        cfg.num_kv_heads, team)

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = call(1, 0)
        got = [[], []]
        # daemon threads: a hung team fails the test instead of hanging the run
        threads = [threading.Thread(target=lambda w: got[w].extend(call(2, w) for _ in range(100)),
                                    args=(w,), daemon=True) for w in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a decode_forward team hung"
    finally:
        torch.set_num_threads(old)
    assert len(got[0]) == len(got[1]) == 100
    assert all(torch.equal(y, want) for y in got[0] + got[1])


def test_a_finished_build_is_imported_from_anywhere_without_compiling(tmp_path):
    """The build folder is keyed by the sources' contents and compiled from a copy of them, so a
    finished build serves every checkout and venv of the same version: here this build's folder
    copied to a fresh cache, with a stale torch build lock beside it (a killed build leaves one),
    is imported by a new process at once, and nothing is compiled."""
    import os
    import shutil
    import subprocess
    import sys

    from tierserve.kernels.native import _tag
    from tierserve.paths import cache_dir

    name = f"tierserve_native_{_tag()}"
    copy = tmp_path / "ext" / name
    shutil.copytree(cache_dir("ext", name), copy,
                    ignore=shutil.ignore_patterns("lock", "tierserve.flock", "*.o", "src"))
    (copy / "lock").write_text("")
    env = dict(os.environ, TIERSERVE_CACHE=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(level=20)\n"
                          "from tierserve.kernels.native import load_extension\n"
                          "assert load_extension() is not None"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "native CPU kernels loaded from" in run.stderr
    assert "building" not in run.stderr and not list(copy.glob("*.o"))
