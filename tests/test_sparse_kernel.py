"""Sparse top-k decode attention (csrc/sparse_decode.cpp) against the torch oracle
(kernels/sparse.py), against dense paged_decode where every block fits in topk, and the block
summaries it selects by, kept up step by step. The timing of dense against sparse attention is a
benchmark: bench/sparse.py --kernel."""

from __future__ import annotations

import pytest
import torch

from tierserve.kernels import sparse
from sparse_fixtures import assert_valid_choice, random_batch
from tierserve.kernels.native import load_extension

ext = load_extension()
native = pytest.mark.skipif(ext is None, reason="the native extension could not be built here")

SHAPES = [(9, 3, 64), (4, 4, 64), (16, 4, 64), (6, 2, 40)]  # SmolLM2's G=3, G=1, G=4, generic D



def _sparse(q, kv, summary, tables, lens, block_size, topk, stats=None):
    """The native op, topk one int or one per sequence (a tensor), with `selected` a view of a
    larger scratch, as the runner passes it."""
    b, hkv = q.shape[0], kv.shape[1]
    width = topk if isinstance(topk, int) else max(topk)
    scratch = torch.full((b + 2, hkv, width + 3), 99, dtype=torch.int32)
    selected = scratch[:b, :, :width]
    stats = torch.zeros(2, dtype=torch.float64) if stats is None else stats
    k = topk if isinstance(topk, int) else torch.tensor(topk, dtype=torch.long)
    out = ext.sparse_paged_decode(q, kv, summary, tables, lens, block_size, q.shape[2] ** -0.5,
                                  k, selected, stats)
    return out, selected



@native
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens_in_blocks", [
    [(1, 0)],                                                     # one token
    [(4, 0)],                                                     # exactly topk full blocks
    [(0, 1), (1, 0), (4, 0), (4, 1), (7, 5), (13, 0), (19, 13)],  # partial, one block, topk+1
])
def test_native_matches_reference(shape, kv_dtype, block_size, lens_in_blocks):
    topk = 4
    lens = [blocks * block_size + extra for blocks, extra in lens_in_blocks]
    q, kv, summary, tables, ctx = random_batch(lens, shape, block_size, kv_dtype)
    out, selected = _sparse(q, kv, summary, tables, ctx, block_size, topk)
    want_out, want_sel = sparse.sparse_decode_ref(q, kv, summary, tables, ctx, block_size,
                                                  shape[2] ** -0.5, topk)
    scores = sparse.block_scores(q, summary, tables, ctx, block_size, shape[0] // shape[1])
    assert_valid_choice(selected, want_sel, scores, ctx, block_size)
    got_ref = sparse.attend_blocks(q, kv, tables, ctx, block_size, shape[2] ** -0.5, selected)
    torch.testing.assert_close(out, got_ref, rtol=1e-4, atol=1e-4)
    if torch.equal(selected.long(), want_sel):
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)


@native
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("extra_topk", [0, 5])
def test_topk_covering_every_block_is_dense_decode(shape, kv_dtype, extra_topk):
    """Where a sequence's blocks fit in topk, sparse decode is paged_decode to the bit."""
    bs = 16
    lens = [1, 16, 17, 100, 160, 200]
    topk = -(-max(lens) // bs) + extra_topk
    q, kv, summary, tables, ctx = random_batch(lens, shape, bs, kv_dtype, seed=3)
    stats = torch.zeros(2, dtype=torch.float64)
    out, selected = _sparse(q, kv, summary, tables, ctx, bs, topk, stats)
    dense = ext.paged_decode(q, kv, tables, ctx, bs, shape[2] ** -0.5)
    assert torch.equal(out, dense.view(len(lens), -1))
    for b, n in enumerate(lens):
        blocks = -(-n // bs)
        want = list(range(blocks)) + [-1] * (topk - blocks)
        assert all(selected[b, h].tolist() == want for h in range(shape[1]))
    assert stats[0] == shape[1] * sum(-(-n // bs) for n in lens)


@native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_topk_per_sequence(kv_dtype):
    """Each sequence its own topk; 0 attends every block (paged_decode's rows to the bit) and
    records no selection; only sequences with a topk count in stats."""
    bs, lens, topk = 16, [300, 300, 45, 500, 17], [4, 0, 6, 9, 0]
    q, kv, summary, tables, ctx = random_batch(lens, (9, 3, 64), bs, kv_dtype, seed=9)
    stats = torch.zeros(2, dtype=torch.float64)
    out, selected = _sparse(q, kv, summary, tables, ctx, bs, topk, stats)
    want_out, want_sel = sparse.sparse_decode_ref(q, kv, summary, tables, ctx, bs, 0.125, topk)
    scores = sparse.block_scores(q, summary, tables, ctx, bs, 3)
    assert_valid_choice(selected, want_sel, scores, ctx, bs)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    dense = ext.paged_decode(q, kv, tables, ctx, bs, 0.125).view(len(lens), -1)
    assert torch.equal(out[[1, 4]], dense[[1, 4]])
    assert (selected[[1, 4]] == -1).all()
    assert selected[2, :, :3].tolist() == [[0, 1, 2]] * 3 and (selected[2, :, 3:] == -1).all()
    assert stats[0] == 3 * (4 + 3 + 9)


@native
def test_stats_count_the_attended_blocks():
    """stats[0] sums min(n, topk) over every (sequence, KV head), across calls; stats[1] the
    selection time."""
    bs, topk, lens = 16, 5, [3, 80, 81, 400, 1000]
    q, kv, summary, tables, ctx = random_batch(lens, (9, 3, 64), bs, torch.float32, seed=4)
    stats = torch.zeros(2, dtype=torch.float64)
    for _ in range(2):
        _sparse(q, kv, summary, tables, ctx, bs, topk, stats)
    assert stats[0] == 2 * 3 * sum(min(-(-n // bs), topk) for n in lens)
    assert stats[1] > 0


@native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_planted_block_is_selected(kv_dtype):
    """One block whose keys align with a head group's queries is found among 30, with one free
    choice (topk 3: block 0, the newest and one more), and dominates that group's output."""
    bs, j = 16, 11
    q, kv, _, tables, ctx = random_batch([30 * bs - 7, 30 * bs], (9, 3, 64), bs, kv_dtype, seed=5)
    kv = kv * 0.1
    key = q[1, 6:9].mean(0)  # KV head 2 serves query heads 6..8
    slots = tables[1, j] * bs + torch.arange(bs)
    kv[0, 2, slots] = (key / key.norm() * 8).to(kv_dtype)
    kv[1, 2, slots] = 1.0
    summary = sparse.block_summaries(kv, torch.arange(kv.shape[2] // bs), bs)
    out, selected = _sparse(q, kv, summary, tables, ctx, bs, 3)
    assert selected[1, 2].tolist() == [0, j, 29]
    assert (out.view(2, 9, 64)[1, 6:9] > 0.9).all()
    _, want = sparse.sparse_decode_ref(q, kv, summary, tables, ctx, bs, 0.125, 3)
    assert want[1, 2].tolist() == [0, j, 29]


def _update_native(kv_caches, summaries, slots, bs):
    ext.kv_summary_update_(kv_caches, summaries, slots, bs)


@pytest.mark.parametrize("update", [
    pytest.param(_update_native, id="native", marks=native),
    pytest.param(sparse.kv_summary_update, id="torch"),
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_summaries_kept_up_step_by_step(update, kv_dtype):
    """A prefill chunk, then decodes across a block boundary, then a freed block reused by
    another sequence (its first token at offset 0 restarts it): every written block's summary is
    the min and max of exactly the keys written since its start, and full blocks' equal
    block_summaries from scratch."""
    bs, hkv, d, layers, num_blocks = 16, 3, 64, 2, 12
    g = torch.Generator().manual_seed(6)
    caches = [torch.randn(2, hkv, num_blocks * bs, d, generator=g).to(kv_dtype) * 5
              for _ in range(layers)]
    summaries = [torch.zeros(2, hkv, num_blocks, d) for _ in range(layers)]
    since_start: dict[int, list[int]] = {}

    def step(*token_slots: list[int]):
        slots = torch.tensor([s for part in token_slots for s in part], dtype=torch.long)
        for c in caches:
            c[:, :, slots] = torch.randn(2, hkv, len(slots), d, generator=g).to(kv_dtype)
        update(caches, summaries, slots, bs)
        for s in slots.tolist():
            since_start.setdefault(s // bs, [])
            if s % bs == 0:
                since_start[s // bs] = []
            since_start[s // bs].append(s)

    def slots_of(table, first, n):
        return [table[t // bs] * bs + t % bs for t in range(first, first + n)]

    a, b, c = [4, 9, 2, 7], [5, 1], [9, 4]
    step(slots_of(a, 0, 37), slots_of(b, 0, 5))  # two prefill chunks in one step
    for t in range(25):  # decodes; a crosses into block 7, b into block 1
        step(slots_of(a, 37 + t, 1), slots_of(b, 5 + t, 1))
    step(slots_of(c, 0, 20), slots_of(b, 30, 1))  # a finished: c reuses its blocks 9 and 4
    for t in range(5):
        step(slots_of(c, 20 + t, 1))
    assert since_start[9][0] == 9 * bs and len(since_start[9]) == bs
    for cache, summary in zip(caches, summaries):
        for block, slots in since_start.items():
            keys = cache[0][:, slots].float()
            assert torch.equal(summary[0][:, block], keys.amin(1)), block
            assert torch.equal(summary[1][:, block], keys.amax(1)), block
        full = torch.tensor([blk for blk, s in since_start.items() if len(s) == bs])
        assert torch.equal(summary[:, :, full], sparse.block_summaries(cache, full, bs))


def test_summary_rebuild_recomputes_whole_blocks():
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 3, 8 * 16, 64, generator=g)
    summary = torch.zeros(2, 3, 8, 64)
    sparse.kv_summary_rebuild_(kv, summary, torch.tensor([5, 2]), 16)
    assert torch.equal(summary[:, :, [2, 5]], sparse.block_summaries(kv, torch.tensor([2, 5]), 16))
    assert not summary[:, :, [0, 1, 3, 4, 6, 7]].any()


# ---- the one-call decode stack with sparse layers (csrc/decode_forward.cpp) ------------------


def _stack_inputs(model, B=3, ctx=200, bs=16):
    cfg = model.config
    nb = -(-(ctx + 1) // bs)
    tables = torch.arange(1, B * nb + 1).view(B, nb).flip(1).contiguous()  # blocks out of order
    g = torch.Generator().manual_seed(8)
    caches = [torch.randn(2, cfg.num_kv_heads, (B * nb + 1) * bs, cfg.head_dim, generator=g)
              for _ in model.layers]
    summaries = [sparse.block_summaries(c, torch.arange(B * nb + 1), bs) for c in caches]
    lens = torch.tensor([ctx + 1 - 37 * i for i in range(B)], dtype=torch.long)
    pos = lens - 1
    slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
    x0 = torch.randn(B, cfg.hidden_size, generator=g)
    return x0, pos, slots, caches, summaries, tables, lens


def _stack_by_layer(model, x0, pos, slots, caches, summaries, tables, lens, bs, topk, dense):
    """The same step op by op (the layer-by-layer path's kernels), sparse from layer `dense`."""
    cfg, ops = model.config, model.ops
    rope = model.layers[0].self_attn.rope
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x, res = model.layers[0].input_layernorm(x0), x0.clone()
    stats = torch.zeros(2, dtype=torch.float64)
    selected = torch.empty(len(lens), hkv, topk, dtype=torch.int32)
    for l in range(len(model.layers)):
        w = model._stack[7 * l: 7 * l + 7]
        if l > 0:
            ops.add_rms_norm_(x, res, w[0], model.norm.eps)
        qkv = ops.packed_linear(x, w[1], (h + 2 * hkv) * d, w[2] if w[2].numel() else None)
        ops.rope_store_kv_(qkv, pos, rope.cos, rope.sin, caches[l], slots, h, hkv)
        q = qkv.view(len(lens), h + 2 * hkv, d)[:, :h]
        attn = (ops.sparse_paged_decode(q, caches[l], summaries[l], tables, lens, bs, d ** -0.5,
                                        topk, selected, stats) if l >= dense
                else ops.paged_decode(q, caches[l], tables, lens, bs, d ** -0.5))
        o = ops.packed_linear(attn.reshape(len(lens), -1), w[3], cfg.hidden_size)
        ops.add_rms_norm_(o, res, w[4], model.norm.eps)
        act = ops.silu_and_mul(ops.packed_linear(o, w[5], w[6].shape[1] * 2))
        x = ops.packed_linear(act, w[6], cfg.hidden_size)
    ops.add_rms_norm_(x, res, model.norm.weight, model.norm.eps)
    return x, stats


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_stack_with_sparse_layers(llm, threads):
    """decode_forward_sparse: with topk covering every block it is decode_forward to the bit;
    with topk 4 from layer 2 on it is the op-by-op sparse step to the bit, and counts
    min(n, topk) blocks per sparse layer, sequence and KV head."""
    model = llm.engine.executor.runner.model
    cfg, rope, bs = model.config, model.layers[0].self_attn.rope, 16
    x0, pos, slots, caches, summaries, tables, lens = _stack_inputs(model)
    hkv = cfg.num_kv_heads

    def stack(topk, dense, sparse_layers=True):
        x = x0.clone()
        h = model.layers[0].input_layernorm(x0)
        args = (h, x, pos, slots, model._stack, model.norm.weight, caches, rope.cos, rope.sin,
                tables, lens, bs, cfg.head_dim ** -0.5, model.norm.eps, cfg.num_heads, hkv,
                threads)
        if not sparse_layers:
            return model.ops.decode_forward(*args), None
        stats = torch.zeros(2, dtype=torch.float64)
        selected = torch.empty(len(lens), hkv, topk, dtype=torch.int32)
        out = model.ops.decode_forward_sparse(*args, summaries, torch.full((len(lens),), topk),
                                              dense, selected, stats)
        return out, stats

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dense, _ = stack(0, 0, sparse_layers=False)
        covering, _ = stack(tables.shape[1], 0)
        one_call, stats = stack(4, 2)
        by_layer, by_layer_stats = _stack_by_layer(model, x0, pos, slots, caches, summaries,
                                                   tables, lens, bs, 4, 2)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(covering, dense)
    assert torch.equal(one_call, by_layer)
    assert not torch.equal(one_call, dense)
    assert stats[0] == by_layer_stats[0] == (len(model.layers) - 2) * hkv * len(lens) * 4
