"""Triton paged attention kernels over the [2, Hkv, slots, D] cache (imported only when used).

Both kernels find a context position's slot through the block table inside the kernel, so any
page size works and no K/V gather is ever materialized. fp8 caches are dequantized on load.

Decode (flash-decoding): one program per (sequence, KV head, split of the context). The GQA group
of query heads sharing the KV head is one [G, D] tile, so each K/V tile is read once per group.
Splits write partial (max, sum, acc) that `combine_splits` merges; with few sequences the splits
keep every SM busy.

Prefill: one program per (sequence, query head, tile of query rows); keys up to each row's own
position (bottom-right causal: the chunk's queries sit at the end of the context).

Sparse decode (Quest top-k blocks, kernels/sparse.py states the rule): `_block_bounds` scores every
block of each (sequence, KV head) from its min/max key summary, torch picks the top k per row with a
stable sort, and the same decode kernel runs over a block table of its own per KV head: the chosen
blocks in ascending order, the newest (partial) one last, so the attended context is one contiguous
run of `len - (blocks - chosen) * page_size` positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, K, V, table_row, pos, valid, mask, kvh, d, dm, m_i, l_i, acc,
                 stride_kh, stride_ks, sm_scale, kv_scale, page_size, PRECISION: tl.constexpr):
    """One tile of context positions: find their slots through the block table row, load K/V
    (dequantized), and fold the tile into the online softmax state (m_i, l_i, acc).
    `mask` [rows, N] says which scores count (validity, and causality for prefill)."""
    blk = tl.load(table_row + pos // page_size, mask=valid, other=0)
    slot = blk.to(tl.int64) * page_size + pos % page_size
    off = kvh * stride_kh + slot[:, None] * stride_ks + d[None, :]
    lm = valid[:, None] & dm[None, :]
    k = (tl.load(K + off, mask=lm, other=0.0).to(tl.float32) * kv_scale).to(q.dtype)
    v = (tl.load(V + off, mask=lm, other=0.0).to(tl.float32) * kv_scale).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale      # [rows, N]
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode(Q, K, V, Tables, Lens, Mo, Lo, Acco,
                  stride_qb, stride_qh, stride_kh, stride_ks, stride_tb, stride_th,
                  stride_mb, stride_mh, stride_ab, stride_ah, stride_as,
                  sm_scale, kv_scale, page_size, split_len,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(Lens + b)
    start = sp * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    heads = h * G + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        m_i, l_i, acc = _attend_tile(q, K, V, Tables + b * stride_tb + h * stride_th, pos, valid,
                                     valid[None, :],
                                     h, d, dm, m_i, l_i, acc, stride_kh, stride_ks, sm_scale,
                                     kv_scale, page_size, PRECISION)
    tl.store(Mo + b * stride_mb + heads * stride_mh + sp, m_i, mask=gm)
    tl.store(Lo + b * stride_mb + heads * stride_mh + sp, l_i, mask=gm)
    tl.store(Acco + b * stride_ab + heads[:, None] * stride_ah + sp * stride_as + d[None, :], acc,
             mask=gm[:, None] & dm[None, :])


@triton.jit
def _block_bounds(P, N, Summ, Tables, Lens, Scores,
                  stride_pb, stride_ph, stride_sk, stride_sh, stride_sb, stride_tb,
                  stride_ob, stride_oh, page_size, width,
                  D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """Quest's bound per block for one (sequence, KV head, tile of table columns):
    P.max + N.min, P and N the group's summed positive and negative query parts; -inf past the
    sequence's blocks."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    n = (tl.load(Lens + b) + page_size - 1) // page_size
    valid = j < n
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    p = tl.load(P + b * stride_pb + h * stride_ph + d, mask=dm, other=0.0)
    neg = tl.load(N + b * stride_pb + h * stride_ph + d, mask=dm, other=0.0)
    blk = tl.load(Tables + b * stride_tb + j, mask=valid, other=0).to(tl.int64)
    off = Summ + h * stride_sh + blk[:, None] * stride_sb + d[None, :]
    lm = valid[:, None] & dm[None, :]
    lo = tl.load(off, mask=lm, other=0.0)
    hi = tl.load(off + stride_sk, mask=lm, other=0.0)
    s = tl.sum(hi * p[None, :] + lo * neg[None, :], 1)
    tl.store(Scores + b * stride_ob + h * stride_oh + j, tl.where(valid, s, float("-inf")),
             mask=j < width)


@triton.jit
def _paged_prefill(Q, K, V, O, Tables, QStart, QLens, CtxLens,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_ks, stride_tb,
                   sm_scale, kv_scale, page_size,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    s_id = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q0 = tl.load(QStart + s_id)
    ql = tl.load(QLens + s_id)
    ctx = tl.load(CtxLens + s_id)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < ql
    qpos = ctx - ql + rows
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(Q + (q0 + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rm[:, None] & dm[None, :], other=0.0)
    kvh = h // G
    # keys this tile can see: up to its last row's position; none when the tile is past the chunk
    hi = tl.minimum(ctx, ctx - ql + mb * BLOCK_M + BLOCK_M)
    hi = tl.where(mb * BLOCK_M < ql, hi, 0)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        causal = valid[None, :] & (pos[None, :] <= qpos[:, None])
        m_i, l_i, acc = _attend_tile(q, K, V, Tables + s_id * stride_tb, pos, valid, causal,
                                     kvh, d, dm, m_i, l_i, acc, stride_kh, stride_ks, sm_scale,
                                     kv_scale, page_size, PRECISION)
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(O + (q0 + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def _precision(dtype: torch.dtype):
    """fp32 stays exact (IEEE); half types take the default tensor-core path."""
    return "ieee" if dtype == torch.float32 else None


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 page_size: int, split_len: int, num_splits: int, group: int, sm_scale: float,
                 kv_scale: float, block_n: int) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]. tables [B, W] (one row per sequence) or [B, Hkv, W] (a row per
    KV head: sparse decode's chosen blocks)."""
    b, h, d = q.shape
    hkv = h // group
    m = q.new_empty(b, h, num_splits, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = q.new_empty(b, h, num_splits, d, dtype=torch.float32)
    k, v = kv_cache[0], kv_cache[1]
    _paged_decode[(b, hkv, num_splits)](
        q, k, v, tables, lens, m, l_, acc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), tables.stride(0),
        tables.stride(1) if tables.dim() == 3 else 0,
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        sm_scale, kv_scale, page_size, split_len,
        G=group, D=d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, PRECISION=_precision(q.dtype))
    return combine_splits(m, l_, acc).to(q.dtype)


def combine_splits(m: torch.Tensor, l_: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Merge per-split softmax partials: m, l [B, H, S], acc [B, H, S, D] -> [B, H, D]."""
    if m.shape[-1] == 1:
        return acc[:, :, 0] / l_
    w = torch.exp(m - m.amax(-1, keepdim=True))                 # empty splits weigh 0
    return (acc * w[..., None]).sum(2) / (l_ * w).sum(-1, keepdim=True)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                  q_start: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                  max_q_len: int, page_size: int, group: int, sm_scale: float, kv_scale: float,
                  block_m: int, block_n: int) -> torch.Tensor:
    """q [T, H, D] of the prefill chunks -> [T, H, D]."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    k, v = kv_cache[0], kv_cache[1]
    grid = (q_lens.shape[0], h, triton.cdiv(max_q_len, block_m))
    _paged_prefill[grid](
        q, k, v, out, tables, q_start, q_lens, ctx_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1),
        tables.stride(0), sm_scale, kv_scale, page_size,
        G=group, D=d, BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=block_n, PRECISION=_precision(q.dtype))
    return out


def block_bounds(q: torch.Tensor, summary: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 page_size: int, block_w: int = 64) -> torch.Tensor:
    """q [B, H, D], summary [2, Hkv, blocks, D] fp32, tables [B, W] -> scores [B, Hkv, W] fp32."""
    b, h, d = q.shape
    hkv, width = summary.shape[1], tables.shape[1]
    qg = q.float().view(b, hkv, h // hkv, d)
    pos, neg = qg.clamp(min=0).sum(2), qg.clamp(max=0).sum(2)
    scores = torch.empty(b, hkv, width, dtype=torch.float32, device=q.device)
    _block_bounds[(b, hkv, triton.cdiv(width, block_w))](
        pos, neg, summary, tables, lens, scores,
        pos.stride(0), pos.stride(1), summary.stride(0), summary.stride(1), summary.stride(2),
        tables.stride(0), scores.stride(0), scores.stride(1), page_size, width,
        D=d, BLOCK_W=block_w, BLOCK_D=max(16, triton.next_power_of_2(d)))
    return scores


def choose_blocks(scores: torch.Tensor, lens: torch.Tensor, topk: torch.Tensor,
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each (sequence, KV head)'s blocks under its sequence's topk (0: all): the first and the
    newest always, then the highest scores (ties: the lower index); all on the device, no sync.
    Returns (chosen [B, Hkv, W] ascending, W past each row's count; count [B]; blocks n [B])."""
    b, hkv, width = scores.shape
    n = (lens.long() + page_size - 1) // page_size
    count = torch.where(topk > 0, torch.minimum(topk, n), n)
    col = torch.arange(width, device=scores.device)
    forced = (col == 0) | (col == (n - 1)[:, None])                      # [B, W]
    order = torch.sort(scores.masked_fill(forced[:, None, :], float("inf")), dim=-1,
                       descending=True, stable=True).indices
    keep = (col < count[:, None])[:, None, :]
    chosen = torch.where(keep, order, width).sort(dim=-1).values
    return chosen, count, n


def sparse_paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, summary: torch.Tensor,
                        tables: torch.Tensor, lens: torch.Tensor, topk: torch.Tensor,
                        page_size: int, split_len: int, num_splits: int, group: int,
                        sm_scale: float, kv_scale: float, block_n: int,
                        selected: torch.Tensor | None = None,
                        stats: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k block decode: q [B, H, D] -> [B, H, D]. topk [B] (0: dense). `selected`
    [B, Hkv, >= max topk] int32 receives each row's chosen logical blocks (-1 padded; a dense
    row all -1): the runner keeps it on q's device (engine/worker/batch_buffers.py), so this
    write is no blocking device-to-host copy. `stats` [2] float64 gains the blocks sparse rows attended
    (over KV heads)."""
    scores = block_bounds(q, summary, tables, lens, page_size)
    chosen, count, n = choose_blocks(scores, lens, topk, page_size)
    b, hkv, width = chosen.shape
    head_tables = torch.gather(tables, 1, chosen.clamp(max=width - 1).view(b, -1)).view(b, hkv, width)
    attended = (lens.long() - (n - count) * page_size).to(torch.int32)
    if selected is not None:
        w = min(selected.shape[-1], width)
        picks = chosen[:, :, :w].masked_fill(chosen[:, :, :w] >= width, -1)
        selected.fill_(-1)
        selected[:, :, :w] = picks.masked_fill((topk == 0)[:, None, None], -1)
    if stats is not None:
        stats[0] += (count * (topk > 0)).sum() * hkv
    return paged_decode(q, kv_cache, head_tables, attended, page_size, split_len, num_splits,
                        group, sm_scale, kv_scale, block_n)
