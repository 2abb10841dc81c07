"""The Triton backend's sparse top-k decode (kernels/triton_kernels.py: block bounds, the choice on
the device, decode over per-KV-head block tables) against the torch oracle (kernels/sparse.py) and
its own dense decode. On this CPU the kernels run under TRITON_INTERPRET=1 (set before triton is
first imported); bench/gpu_check.py --sparse runs the same checks and the timing on a GPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tierserve.kernels import sparse  # noqa: E402
from tierserve.kernels.base import BatchLayout  # noqa: E402
from tierserve.kernels.registry import create_backend  # noqa: E402
from tierserve.kernels.sparse_plan import SparseStep  # noqa: E402
from sparse_fixtures import assert_valid_choice, random_batch  # noqa: E402

pytest.importorskip("triton")
from tierserve.kernels import triton_kernels as tk  # noqa: E402

SHAPES = [(9, 3, 64), (4, 4, 64), (16, 4, 32)]  # SmolLM2's G=3, G=1, G=4 with another D
TILES = [32, 64]
"""The kernels' tile (block_n, block_m): 32 is this CPU's, 64 a GPU's for heads up to 128
(kernels/triton_attn.default_tile); both run interpreted here."""


def _batch(lens, shape, block_size, kv_dtype, seed=0):
    """A random batch with int32 lengths and two -1 columns past the longest table row."""
    return random_batch(lens, shape, block_size, kv_dtype, seed, pad_columns=2,
                        lens_dtype=torch.int32)


def _run(q, kv, summary, tables, lens, bs, topk, split_len=64, splits=None, stats=None, tile=32):
    """The Triton sparse decode, topk one per sequence, at tile `tile`; `selected` a view of a
    larger scratch, as the runner passes it."""
    b, h, d = q.shape
    hkv = kv.shape[1]
    k = torch.tensor(topk, dtype=torch.long)
    width = max(topk) or 1
    scratch = torch.full((b + 2, hkv, width + 3), 99, dtype=torch.int32)
    selected = scratch[:b, :, :width]
    splits = splits or -(-int(lens.max()) // split_len)
    out = tk.sparse_paged_decode(q, kv, summary, tables, lens, k, bs, split_len, splits, h // hkv,
                                 d ** -0.5, 1.0, tile, selected, stats)
    return out.view(b, -1), selected



REFERENCE_CASES = ([(shape, kv, bs, 32) for shape in SHAPES
                    for kv in (torch.float32, torch.float16) for bs in (16, 32)]
                   + [(shape, kv, 16, 64) for shape in SHAPES for kv in (torch.float32, torch.float16)])
"""Every shape, KV dtype and page size at the CPU's tile; at the GPU's, every shape and KV dtype
at pages of 16 (the longest row then spans five 64-position tiles, the last one partial)."""


@pytest.mark.parametrize("shape, kv_dtype, block_size, tile", REFERENCE_CASES)
def test_matches_reference(shape, kv_dtype, block_size, tile):
    """One token, exactly topk blocks, topk + 1, partial newest blocks, long: the chosen blocks
    are the oracle's and the output is attention over them."""
    topk = 4
    lens = [1, 4 * block_size, 4 * block_size + 1, 7 * block_size + 5, 19 * block_size + 13]
    q, kv, summary, tables, ctx = _batch(lens, shape, block_size, kv_dtype)
    out, selected = _run(q, kv, summary, tables, ctx, block_size, [topk] * len(lens), tile=tile)
    want_out, want_sel = sparse.sparse_decode_ref(q, kv, summary, tables, ctx.long(), block_size,
                                                  shape[2] ** -0.5, topk)
    scores = sparse.block_scores(q, summary, tables, ctx.long(), block_size, shape[0] // shape[1])
    assert_valid_choice(selected, want_sel, scores, ctx, block_size)
    got_ref = sparse.attend_blocks(q, kv, tables, ctx.long(), block_size, shape[2] ** -0.5,
                                   selected)
    torch.testing.assert_close(out, got_ref, rtol=1e-4, atol=1e-4)


def test_block_bounds_equal_the_oracle():
    """The kernel's bound (P.max + N.min) is Quest's sum over the group, -inf past each
    sequence's blocks and in the table's padding."""
    bs, lens = 16, [5, 90, 300]
    q, kv, summary, tables, ctx = _batch(lens, (9, 3, 64), bs, torch.float32, seed=2)
    got = tk.block_bounds(q, summary, tables, ctx, bs, block_w=8)
    want = sparse.block_scores(q, summary, tables, ctx.long(), bs, 3)
    assert got.shape == want.shape == (3, 3, tables.shape[1])
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kv_dtype, tile", [(torch.float32, 32), (torch.float16, 32),
                                            (torch.float16, 64)])
def test_topk_covering_every_block_is_dense_decode(kv_dtype, tile):
    """Where every block fits in topk (or topk is 0), the result is the backend's dense decode to
    the bit, at either tile: the per-head tables hold the sequence's own blocks in order."""
    bs, lens = 16, [1, 16, 17, 100, 160, 200]
    q, kv, summary, tables, ctx = _batch(lens, (9, 3, 64), bs, kv_dtype, seed=3)
    blocks = -(-max(lens) // bs)
    splits = -(-max(lens) // 64)
    dense = tk.paged_decode(q, kv, tables, ctx, bs, 64, splits, 3, 0.125, 1.0, tile)
    for topk in ([blocks] * len(lens), [blocks + 5] * len(lens), [0] * len(lens)):
        stats = torch.zeros(2, dtype=torch.float64)
        out, selected = _run(q, kv, summary, tables, ctx, bs, topk, stats=stats, tile=tile)
        assert torch.equal(out, dense.view(len(lens), -1))
        if topk[0]:
            for b, n in enumerate(lens):
                want = list(range(-(-n // bs)))
                assert all(selected[b, h, :len(want)].tolist() == want for h in range(3))
                assert (selected[b, :, len(want):] == -1).all()
            assert stats[0] == 3 * sum(-(-n // bs) for n in lens)
        else:
            assert (selected == -1).all() and stats[0] == 0


def test_topk_per_sequence():
    """Each sequence its own topk; 0 attends every block (dense rows to the bit) and records no
    selection; only sequences with a topk count in stats."""
    bs, lens, topk = 16, [300, 300, 45, 500, 17], [4, 0, 6, 9, 0]
    q, kv, summary, tables, ctx = _batch(lens, (9, 3, 64), bs, torch.float32, seed=9)
    stats = torch.zeros(2, dtype=torch.float64)
    out, selected = _run(q, kv, summary, tables, ctx, bs, topk, stats=stats)
    want_out, want_sel = sparse.sparse_decode_ref(q, kv, summary, tables, ctx.long(), bs, 0.125,
                                                  topk)
    scores = sparse.block_scores(q, summary, tables, ctx.long(), bs, 3)
    assert_valid_choice(selected, want_sel, scores, ctx, bs)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    dense = tk.paged_decode(q, kv, tables, ctx, bs, 64, 8, 3, 0.125, 1.0, 32).view(5, -1)
    torch.testing.assert_close(out[[1, 4]], dense[[1, 4]], rtol=0, atol=0)
    assert (selected[[1, 4]] == -1).all()
    assert selected[2, :, :3].tolist() == [[0, 1, 2]] * 3 and (selected[2, :, 3:] == -1).all()
    assert stats[0] == 3 * (4 + 3 + 9)


@pytest.mark.parametrize("tile", TILES)
def test_backend_forward_sparse_with_prefill_in_the_step(tile):
    """TritonBackend.forward_sparse on a step of decodes and a prefill chunk, at either tile:
    decode rows are sparse attention over the chosen blocks, prefill rows equal forward()'s; the
    splits follow the widest sparse row (max_blocks), and the result does not depend on them."""
    bs, (h, hkv, d) = 16, (9, 3, 64)
    dec_lens, topk = [400, 200, 33], [5, 3, 0]
    pre_len, pre_new = 70, 6
    q_dec, kv, summary, tables, ctx = _batch(dec_lens + [pre_len], (h, hkv, d), bs,
                                             torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.cat((q_dec[:3], torch.randn(pre_new, h, d, generator=g)))
    kvn = torch.randn(2, 3 + pre_new, hkv, d, generator=g)  # the step's own K/V (already stored)
    lay = BatchLayout(3, [1, 1, 1, pre_new], dec_lens + [pre_len], [0, 1, 2, 3, 3 + pre_new],
                      tables, torch.zeros(3 + pre_new, dtype=torch.long), bs)
    be = create_backend("triton", h, hkv, d, d ** -0.5, tile=tile)
    assert be.block_n == be.block_m == tile
    meta = be.build_metadata(lay)
    widest = max(min(-(-n // bs), k) if k else -(-n // bs) for n, k in zip(dec_lens, topk))
    outs = []
    for max_blocks in (widest, 0):
        selected = torch.full((3, hkv, max(topk)), 7, dtype=torch.int32)
        stats = torch.zeros(2, dtype=torch.float64)
        step = SparseStep([None] * 3 + [summary], 2, torch.tensor(topk), selected, stats, max_blocks)
        outs.append(be.forward_sparse(q, kvn[0], kvn[1], kv, meta, step, layer=3))
        assert stats[0] == hkv * (5 + 3)
    dense = be.forward(q, kvn[0], kvn[1], kv, meta)
    for out in outs:
        assert out.shape == (3 + pre_new, h * d)
        torch.testing.assert_close(out[3:], dense[3:], rtol=0, atol=0)
        torch.testing.assert_close(out[2], dense[2], rtol=1e-5, atol=1e-5)  # topk 0: dense
        want = sparse.attend_blocks(q[:3], kv, tables[:3], ctx[:3].long(), bs, d ** -0.5,
                                    selected)
        torch.testing.assert_close(out[:2], want[:2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_router_sends_sparse_decode_to_triton_on_cuda():
    """On a GPU with sparse decode configured, decode routes to triton (flashinfer has no sparse
    path, and says so) while prefill keeps flashinfer; an explicit decode override wins; with
    no sparse-capable decode backend the dense route stands."""
    from tierserve.kernels.router import RouteQuery, route_phases
    q = RouteQuery("cuda", torch.bfloat16, "auto", 128, 32, 8, 16, capability=(9, 0))
    routes = route_phases(q, installed=lambda p: True, sparse_decode=True)
    assert routes["prefill"].backend == "flashinfer"
    assert routes["decode"].backend == "triton"
    assert routes["decode"].rejected["flashinfer"] == "no sparse attention support"
    assert route_phases(q, installed=lambda p: True)["decode"].backend == "flashinfer"
    forced = route_phases(q, "decode=flashinfer", installed=lambda p: True, sparse_decode=True)
    assert forced["decode"].backend == "flashinfer"
    no_triton = route_phases(q, installed=lambda p: p != "triton", sparse_decode=True)
    assert no_triton["decode"].backend == "flashinfer"


def test_gpu_check_sparse_dry_run(capsys):
    """bench/gpu_check.py --sparse's logic on the CPU with tiny shapes (the GPU run is separate):
    its own checks pass and the engine rows are there."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--device", "cpu", "--tiny", "--sparse"]) == 0
    out = capsys.readouterr().out
    assert "| h4/kv2/d32 | [40, 100, 7] | 3 | 1.000 |" in out and "| bit-equal | yes |" in out
    assert "| greedy tokens, K covering every block = dense | 1 |" in out
    assert "decode tok/s, K = 1/8 (cpu_native)" in out


def test_engine_decoding_on_triton_gives_the_native_sparse_tokens(monkeypatch):
    """The real model and runner with decode on the Triton backend (under the interpreter: the
    CPU admitted to its device types for this test), prefill on cpu_native: with K = 4 blocks the
    greedy tokens and the blocks attended equal the native sparse kernel's, through the runner's
    plan, views and per-layer summaries."""
    import dataclasses
    from pathlib import Path

    from tierserve.engine.llm import LLM
    from tierserve.engine.sampling_params import SamplingParams
    from tierserve.kernels.triton_attn import TritonBackend

    caps = dataclasses.replace(TritonBackend.capabilities, device_types=("cuda", "cpu"))
    monkeypatch.setattr(TritonBackend, "capabilities", caps)
    text = (Path(__file__).parent / "data" / "long_text.md").read_text()
    kw = dict(sparse_topk_blocks=4, sparse_min_context=0, max_model_len=512, num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0)
    outs, stats = [], []
    for backend in ("prefill=cpu_native,decode=triton", None):
        llm = LLM(attention_backend=backend, **kw)
        prompt = llm.get_tokenizer().encode(text)[:300]
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        stats.append(llm.engine.executor.sparse_stats())
    assert outs[0] == outs[1] and len(outs[0]) == 4
    assert stats[0].blocks_attended == stats[1].blocks_attended == 4 * 3 * 28 * 3
    assert stats[0].steps == stats[1].steps == 3
