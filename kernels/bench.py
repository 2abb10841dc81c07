"""Random paged attention inputs, and timing each valid backend on them (bench-backends).

Used by tests, `tierserve bench-backends` and bench/gpu_check.py."""

from __future__ import annotations

import math
import time

import torch

from tierserve.kernels.base import BatchLayout
from tierserve.kernels.kv_dtype import kv_torch_dtype
from tierserve.kernels.registry import create_backend


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, kv_dtype: str = "float32", dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0):
    """seqs: (query_len, context_len), decodes (query_len 1) first. Blocks are assigned in a
    shuffled order so no sequence's pages are contiguous. Returns q, k, v, cache, layout (host
    layout tensors, like the runner's); the step's own k/v are not yet written."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-ctx // block_size) for _, ctx in seqs]
    perm = torch.randperm(sum(blocks_per) + 3, generator=gen)[:sum(blocks_per)] + 1
    tables = torch.zeros(len(seqs), max(blocks_per), dtype=torch.long)
    num_blocks = sum(blocks_per) + 4
    cache = torch.randn(2, num_kv_heads, num_blocks * block_size, head_dim, generator=gen)
    cache = cache.to(device=device, dtype=kv_torch_dtype(kv_dtype, dtype))
    qstart, slots, used = [0], [], 0
    for i, ((ql, ctx), nb) in enumerate(zip(seqs, blocks_per)):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(ctx - ql, ctx)
        slots.append(tables[i, pos // block_size] * block_size + pos % block_size)
        qstart.append(qstart[-1] + ql)
    t = qstart[-1]
    q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(device=device, dtype=dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    num_decodes = next((i for i, (ql, _) in enumerate(seqs) if ql != 1), len(seqs))
    layout = BatchLayout(num_decodes, [s[0] for s in seqs], [s[1] for s in seqs], qstart, tables,
                         torch.cat(slots), block_size)
    return q, k, v, cache, layout


def run_backend(name_or_backend, q, k, v, cache, layout, kv_scale: float = 1.0):
    """Write the step's K/V into a copy of cache and run attention; returns [T, H * D]."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    be = (create_backend(name_or_backend, h, hkv, d, 1 / math.sqrt(d), kv_scale=kv_scale,
                         device=q.device, dtype=q.dtype, kv_dtype=cache.dtype)
          if isinstance(name_or_backend, str) else name_or_backend)
    cache = cache.clone()
    be.write_kv(k, v, cache, layout.slot_mapping)
    return be.forward(q, k, v, cache, be.build_metadata(layout))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# What bench-backends times: a decode step of 32 sequences at 1,024 context, and one 512-token
# prompt (a fresh prefill) plus a 256-token chunk after 768 cached tokens.
PHASE_BATCHES = {"decode": [(1, 1024)] * 32, "prefill": [(512, 512), (256, 1024)]}


def time_backend(name: str, phase: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, kv_dtype: str, dtype: torch.dtype, device: str,
                 repeats: int = 5) -> float:
    """Median ms of one layer's attention (metadata + forward) for the phase's batch."""
    q, k, v, cache, layout = make_batch(PHASE_BATCHES[phase], num_heads, num_kv_heads, head_dim,
                                        block_size, kv_dtype, dtype, device)
    be = create_backend(name, num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim),
                        device=device, dtype=dtype, kv_dtype=cache.dtype)
    be.write_kv(k, v, cache, layout.slot_mapping)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    times = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        be.forward(q, k, v, cache, be.build_metadata(layout))
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]  # the first run compiles / warms up
