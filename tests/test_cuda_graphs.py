"""Decode CUDA graphs (engine/worker/cuda_graphs.py) on the CPU: which graphs exist and which steps
replay one, how a batch is padded to its bucket, the flag's plumbing, the CPU fallback, and the
replay path's inputs and metadata run uncaptured against the eager step (triton under
TRITON_INTERPRET=1, set before triton is first imported). Capture itself needs a GPU:
bench/gpu_check.py --graphs."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tierserve.engine.worker.batch_buffers import PAD_BLOCK, BatchBuffers  # noqa: E402
from tierserve.engine.config import ModelConfig  # noqa: E402
from tierserve.engine.worker.cuda_graphs import (DecodeGraphs, Staging, batch_buckets,  # noqa: E402
                                          graph_widths, graphs_refusal, smallest_at_least,
                                          stage_decode)
from tierserve.engine.worker.models.llama import LlamaForCausalLM  # noqa: E402
from tierserve.kernels import (BatchLayout, ForwardContext, create_backend,  # noqa: E402
                               forward_context)
from tierserve.kernels.composite import PhaseSplit  # noqa: E402

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None


# ---- which graphs -------------------------------------------------------------------------------

def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)  # the largest batch still has a graph
    assert batch_buckets(1) == (1,)
    buckets = batch_buckets(64)
    assert [smallest_at_least(n, buckets) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == \
        [1, 2, 4, 8, 8, 16, 64, 64]
    assert smallest_at_least(65, buckets) is None  # runs eagerly


def test_widths_are_what_batch_buffers_produce():
    assert graph_widths(512) == (8, 16, 32, 64, 128, 256, 512)  # 8K tokens of 16-token blocks
    assert graph_widths(125) == (8, 16, 32, 64, 125)  # capacity itself when not a power of two
    assert graph_widths(5) == (5,)  # narrower than the alignment: one width
    buffers = BatchBuffers(4, 16, 125, 1)
    produced = {buffers.table_view([tuple(range(n))]).shape[1] for n in range(1, 126)}
    assert produced == set(graph_widths(125))


def test_widths_past_the_limit_keep_both_ends_and_spread_in_log_scale():
    w = graph_widths(8192)  # 128K tokens: 11 powers of two from 8
    assert w == (8, 16, 64, 128, 512, 1024, 4096, 8192)
    assert max(b / a for a, b in zip(w, w[1:])) <= 4
    assert graph_widths(8192, limit=2) == (8, 8192) and graph_widths(8192, limit=1) == (8192,)


def _layout(tables: list[tuple[int, ...]], qlens: list[int], capacity: int = 16) -> BatchLayout:
    buf = BatchBuffers(64, 64, capacity, 1)
    view = buf.table_view(tables)
    nd = next((i for i, q in enumerate(qlens) if q != 1), len(qlens))
    return BatchLayout(nd, qlens, [4] * len(qlens), [0] * (len(qlens) + 1), view,
                       torch.zeros(sum(qlens), dtype=torch.long), 4)


def test_only_decode_steps_inside_the_buckets_replay():
    graphs = DecodeGraphs(torch.nn.Identity(), None, "cpu", max_num_seqs=8, capacity=64,
                          block_size=4, max_widths=3)
    assert graphs.widths == (8, 32, 64)
    graphs._entries = {(b, w): None for b in graphs.buckets for w in graphs.widths}
    assert graphs.graph_for(_layout([(1,)] * 5, [1] * 5)) == (8, 8)
    assert graphs.graph_for(_layout([tuple(range(12))], [1])) == (1, 32)  # width 16 -> 32
    assert graphs.graph_for(_layout([(1,), (2,)], [1, 3])) is None  # a prefill chunk: eager
    assert graphs.graph_for(_layout([(1,)] * 9, [1] * 9)) is None  # past max_num_seqs: eager
    assert graphs.graph_for(_layout([tuple(range(70))], [1], capacity=128)) is None  # too wide


def test_refusals_name_the_reason():
    assert "device is cpu" in graphs_refusal("cpu", None)
    sdpa = create_backend("torch_sdpa", 4, 2, 32, 0.2)
    assert "torch_sdpa builds its metadata on the host" in graphs_refusal("cuda", sdpa)
    if HAS_TRITON:
        tri = create_backend("triton", 4, 2, 32, 0.2)
        assert graphs_refusal("cuda", tri) is None  # sparse decode included (captured too)
        assert graphs_refusal("cuda", PhaseSplit(prefill=sdpa, decode=tri)) is None
        assert graphs_refusal("cuda", PhaseSplit(prefill=tri, decode=sdpa)) is not None


# ---- padding ------------------------------------------------------------------------------------

def test_padding_rows_use_only_the_scratch_block():
    lay = Staging(max_bucket=8, max_width=16)
    flat = np.full(lay.numel, 777, dtype=np.int64)
    tables = np.array([[3, 4, 5, PAD_BLOCK], [6, 7, 8, 9], [10, PAD_BLOCK, PAD_BLOCK, PAD_BLOCK]])
    real = dict(tokens=np.array([11, 12, 13]), positions=np.array([40, 60, 2]),
                slots=np.array([5 * 16 + 8, 9 * 16 + 12, 10 * 16 + 2]), lens=np.array([41, 61, 3]))
    scratch, bs = 31, 16
    stage_decode(flat, lay, 4, 8, real["tokens"], real["positions"], real["slots"], real["lens"],
                 tables, scratch, bs)
    tok, pos, slot, ctx, tab = lay.views(flat, 4, 8)
    # every row dense: a sparse step's real rows get their top-k on the device, the padded stays
    assert lay.topk(flat, 4).tolist() == [0, 0, 0, 0]
    assert tok.tolist() == [11, 12, 13, 0] and pos.tolist() == [40, 60, 2, 0]
    assert slot.tolist() == [5 * 16 + 8, 9 * 16 + 12, 10 * 16 + 2, scratch * bs]
    assert ctx.tolist() == [41, 61, 3, 1]  # the padded row attends to its own one token
    assert tab[:3, :4].tolist() == tables.tolist() and (tab[:3, 4:] == PAD_BLOCK).all()
    assert tab[3].tolist() == [scratch] + [PAD_BLOCK] * 7
    real_blocks = set(tables[tables >= 0].tolist())
    assert not real_blocks & set(tab[3].tolist())
    assert not {s // bs for s in slot[3:].tolist()} & real_blocks
    # what one step copies: the five row sections and the [bucket, width] table, nothing after
    assert lay.used(4, 8) == 5 * 8 + 32 and (flat[lay.used(4, 8):] == 777).all()


# ---- the flag ------------------------------------------------------------------------------------

def test_flag_reaches_the_engine_config():
    from tierserve.engine.llm import build_config
    from tierserve.server.cli import build_parser
    from tierserve.server.config import ServerConfig, load_config

    assert build_config(cuda_graphs=True).cuda_graphs is True
    assert build_config().cuda_graphs is False
    args = build_parser().parse_args(["serve", "--cuda-graphs"])
    cfg = load_config(None, {k: getattr(args, k) for k in ServerConfig.__dataclass_fields__}, {})
    assert cfg.cuda_graphs is True and build_config(**cfg.engine_kwargs()).cuda_graphs is True
    env = load_config(None, {}, {"TIERSERVE_CUDA_GRAPHS": "1"})
    assert env.cuda_graphs is True


def test_serve_help_lists_the_flag():
    exe = os.path.join(os.path.dirname(sys.executable), "tierserve")
    out = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--cuda-graphs" in out.stdout


def test_cpu_engine_warns_and_generates_the_same_tokens(caplog):
    from tierserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    with caplog.at_level(logging.WARNING, logger="tierserve.engine.worker.cuda_graphs"):
        graphs = LLM(kv_cache_memory_bytes=1 << 26, device="cpu", cuda_graphs=True)
    assert any("--cuda-graphs" in r.message and "device is cpu" in r.message
               for r in caplog.records)
    assert graphs.engine.executor.runner.graphs is None
    eager = LLM(kv_cache_memory_bytes=1 << 26, device="cpu")
    a, b = (llm.generate(prompts, params) for llm in (graphs, eager))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert graphs.engine.pool.num_blocks == eager.engine.pool.num_blocks  # nothing reserved


# ---- the replay path, uncaptured, against the eager step -----------------------------------------

def _tiny_model(cfg: ModelConfig) -> LlamaForCausalLM:
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg, 256)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def _eager(model, backend, caches, buffers: BatchBuffers, layout: BatchLayout) -> torch.Tensor:
    b = layout.num_seqs
    ctx = ForwardContext(backend, backend.build_metadata(layout), layout.slot_mapping, caches)
    with torch.inference_mode(), forward_context(ctx):
        return model(buffers.tokens[:b], buffers.positions[:b])


def _decode_step(buffers: BatchBuffers, rows: list[tuple[int, tuple[int, ...]]], bs: int,
                 vocab: int) -> BatchLayout:
    """Decodes of (context length, blocks) into the buffers, as BatchBuffers.write_step does."""
    b = len(rows)
    tables = buffers.table_view([blocks for _, blocks in rows])
    pos = np.array([n - 1 for n, _ in rows])
    buffers.tokens.numpy()[:b] = (7 * np.arange(b) + 3) % vocab
    buffers.positions.numpy()[:b] = pos
    buffers.slot_mapping.numpy()[:b] = tables.numpy()[np.arange(b), pos // bs] * bs + pos % bs
    buffers.context_lens.numpy()[:b] = [n for n, _ in rows]
    return BatchLayout(b, [1] * b, [n for n, _ in rows], list(range(b + 1)), tables,
                       buffers.slot_mapping[:b], bs)


BS, CAPACITY, NUM_BLOCKS = 4, 32, 48
"""The replay tests' cache: 4-token blocks, tables up to 32 wide, the last of 48 blocks scratch."""


def _graph_case(contexts: list[int], seed: int):
    """A 2-layer model, a triton backend, random caches and a decode step of `contexts` whose
    blocks are scattered over every block but the scratch one: (cfg, model, backend, caches,
    buffers, layout)."""
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    model = _tiny_model(cfg)
    backend = create_backend("triton", 4, 2, 32, 1 / math.sqrt(32))
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, 2, NUM_BLOCKS * BS, 32, generator=g) for _ in range(cfg.num_layers)]
    perm = torch.randperm(NUM_BLOCKS - 1, generator=g).tolist()  # anything but scratch
    rows, used = [], 0
    for n in contexts:
        k = -(-n // BS)
        rows.append((n, tuple(perm[used:used + k])))
        used += k
    buffers = BatchBuffers(8, 64, CAPACITY, 2)
    return cfg, model, backend, caches, buffers, _decode_step(buffers, rows, BS, cfg.vocab_size)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("contexts", [[5, 9, 13], [3], [70, 2, 33, 17, 9]],
                         ids=["bucket4-width8", "bucket1", "bucket8-width32"])
def test_replay_inputs_match_the_eager_step(contexts):
    """The graph's static inputs, padding and width-sized triton splits give the eager step's
    hidden states and K/V; the padded rows write only the scratch block."""
    cfg, model, backend, caches, buffers, layout = _graph_case(contexts, seed=1)
    bs, capacity, num_blocks, scratch = BS, CAPACITY, NUM_BLOCKS, NUM_BLOCKS - 1
    backend.target_programs = 16  # several splits, as a GPU runs small batches

    eager_caches = [c.clone() for c in caches]
    want = _eager(model, backend, eager_caches, buffers, layout)
    graphs = DecodeGraphs(model, backend, "cpu", max_num_seqs=8, capacity=capacity, block_size=bs)
    graph_caches = [c.clone() for c in caches]
    graphs.capture(graph_caches, scratch, pool_blocks=scratch, graphs=False)
    bucket, width = graphs.graph_for(layout)
    assert bucket == smallest_at_least(len(contexts), graphs.buckets) and width >= 8
    inputs = graphs.upload(layout, buffers)
    assert inputs.slots.tolist() == layout.slot_mapping.tolist()  # the summaries' update reads them
    got, nbytes = inputs.run(), inputs.nbytes
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert nbytes == 8 * graphs.layout.used(bucket, width)
    for before, eager, replayed in zip(caches, eager_caches, graph_caches):
        real = slice(0, scratch * bs)  # every slot but the scratch block's
        assert torch.allclose(replayed[:, :, real], eager[:, :, real], rtol=1e-5, atol=1e-5)
        touched = (replayed != before).view(2, 2, num_blocks, bs, 32).any(-1).any(0).any(0)
        written = {s // bs for s in layout.slot_mapping.tolist()}
        assert set(touched.nonzero()[:, 0].tolist()) <= written | {scratch}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_sparse_replay_matches_the_eager_sparse_step():
    """Sparse top-k decode inside the graphs: the step's top-k copied into the graph's input (0
    for a dense row; the padded rows staged 0), and the summaries and counter at their fixed
    addresses give the eager sparse step's hidden states and blocks attended."""
    from tierserve.engine.config import SparseConfig
    from tierserve.engine.worker.sparse import SparseDecoder
    from tierserve.kernels.sparse import block_summaries
    from tierserve.kernels.sparse_plan import SparseStep

    contexts, topk = [70, 2, 33, 17, 9], [3, 0, 2, 4, 3]
    cfg, model, backend, caches, buffers, layout = _graph_case(contexts, seed=2)
    bs, capacity, num_blocks, scratch = BS, CAPACITY, NUM_BLOCKS, NUM_BLOCKS - 1
    decoder = SparseDecoder(SparseConfig(topk_blocks=3, dense_layers=1), cfg.num_layers, 2, 32, bs,
                            torch.device("cpu"))
    decoder.allocate(num_blocks)
    for cache, summary in zip(caches, decoder.summaries):
        summary.copy_(block_summaries(cache, torch.arange(num_blocks), bs))

    eager_caches = [c.clone() for c in caches]
    eager_stats = torch.zeros(2, dtype=torch.float64)
    step = SparseStep(decoder.summaries, 1, torch.tensor(topk),
                      torch.full((5, 2, 4), -1, dtype=torch.int32), eager_stats)
    ctx = ForwardContext(backend, backend.build_metadata(layout), layout.slot_mapping,
                         eager_caches, step)
    with torch.inference_mode(), forward_context(ctx):
        want = model(buffers.tokens[:5], buffers.positions[:5])
    graphs = DecodeGraphs(model, backend, "cpu", max_num_seqs=8, capacity=capacity, block_size=bs,
                          sparse=decoder)
    graph_caches = [c.clone() for c in caches]
    graphs.capture(graph_caches, scratch, pool_blocks=scratch, graphs=False)
    decoder.accumulator.zero_()  # capture ran every graph once on padding rows (all dense)
    plan = SparseStep(decoder.summaries, 1, torch.tensor(topk), None, decoder.accumulator)
    got = graphs.upload(layout, buffers, plan).run()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    attended = sum(min(k, -(-n // bs)) for n, k in zip(contexts, topk) if k) * 2  # x KV heads
    assert eager_stats[0] == decoder.accumulator[0] == attended  # one sparse layer
    dense = graphs.upload(layout, buffers, None).run()  # no plan: every row dense
    assert not torch.allclose(dense, got, rtol=1e-3, atol=1e-3)


def test_capture_refuses_a_pool_that_holds_the_scratch_block():
    graphs = DecodeGraphs(torch.nn.Identity(), None, "cpu", max_num_seqs=2, capacity=8,
                          block_size=4)
    with pytest.raises(ValueError, match="keep 1 block out of the pool"):
        graphs.capture([], scratch_block=9, pool_blocks=10, graphs=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_gpu_check_fails_fast_without_a_gpu(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t0 = time.perf_counter()
    assert mod.main(["--serve", "--graphs"]) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert "no GPU visible to torch" in err and "--device cpu --tiny" in err
