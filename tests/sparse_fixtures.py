"""Random sparse-decode batches and the selection check shared by the native and Triton sparse
kernel tests (tests/test_sparse_kernel.py, tests/test_sparse_triton.py)."""

from __future__ import annotations

import torch

from tierserve.kernels import sparse


def random_batch(lens, shape, block_size, kv_dtype, seed=0, pad_columns=0,
                 lens_dtype=torch.long):
    """Random q, cache and summaries; each sequence's blocks scattered over the cache, block
    tables padded with -1 (pad_columns more than the longest needs, as the runner's views)."""
    h, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    total = sum(counts) + 3
    perm = torch.randperm(total, generator=g)
    tables = torch.full((len(lens), max(counts) + pad_columns), -1, dtype=torch.long)
    start = 0
    for i, c in enumerate(counts):
        tables[i, :c] = perm[start:start + c]
        start += c
    kv = torch.randn(2, hkv, total * block_size, d, generator=g).to(kv_dtype)
    q = torch.randn(len(lens), h, d, generator=g)
    summary = sparse.block_summaries(kv, torch.arange(total), block_size)
    return q, kv, summary, tables, torch.tensor(lens, dtype=lens_dtype)


def assert_valid_choice(got, want, scores, lens, block_size):
    """Selections equal the oracle's, except where two blocks' bounds tie to rounding (a kernel
    sums them in another order): there the choice must still be a top-k within tolerance."""
    differ = (got.long() != want).any(-1).nonzero().tolist()
    for b, h in differ:
        n = -(-int(lens[b]) // block_size)
        s = scores[b, h]
        chosen = set(got[b, h].tolist()[1:-1])
        others = [j for j in range(1, n - 1) if j not in chosen]
        assert min(s[j] for j in chosen) >= max(s[j] for j in others) - 1e-4 * s[:n].abs().max()
    assert len(differ) <= max(1, got.shape[0] * got.shape[1] // 10)
