"""Sparse top-k decode attention (Quest: Tang et al., 2024) in plain torch: the oracle for
csrc/sparse_decode.cpp, and the summary upkeep for backends without the native kernels.

Each KV block keeps, per KV head, the element-wise min and max of its keys:

    summary [2, Hkv, num_blocks, D] fp32   [0] min, [1] max (an fp16 cache's keys widened)

For a decode query q and any key k of block j, q.k <= sum_i max(q_i min_ji, q_i max_ji). Each
sequence has its own topk, in the kernels' encoding (kernels/sparse_plan.kernel_topk: 0 takes the
dense path); per (sequence, KV head) with n = ceil(context / block_size) blocks:

    topk 0 or n <= topk   every block (dense decode)
    otherwise             block 0 (attention sinks), block n-1 (the newest, partly filled) and the
                          topk - 2 others with the highest bound summed over the head's GQA group
                          (ties: the lower index), attended in ascending order

`selected` [B, Hkv, width >= max topk] holds the attended logical blocks (indices into the block
table row), ascending; entries past min(n, topk) are -1, as block table padding, and a dense
(topk 0) sequence's whole row is -1.
"""

from __future__ import annotations

import torch


def block_summaries(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """Min and max over every slot of each block's keys: [2, Hkv, len(block_ids), D] fp32."""
    hkv, slots, d = kv_cache.shape[1:]
    keys = kv_cache[0].view(hkv, slots // block_size, block_size, d)[:, block_ids].float()
    return torch.stack((keys.amin(2), keys.amax(2)))


def kv_summary_rebuild_(kv_cache: torch.Tensor, summary: torch.Tensor, block_ids: torch.Tensor,
                        block_size: int) -> None:
    """Recompute whole blocks' summaries (blocks written back from a KV tier are full)."""
    if len(block_ids):
        ids = block_ids.to(summary.device)
        summary.index_copy_(2, ids, block_summaries(kv_cache, ids, block_size))


def kv_summary_update(kv_caches: list[torch.Tensor], summaries: list[torch.Tensor],
                      slot_mapping: torch.Tensor, block_size: int) -> None:
    """Fold this step's keys (already stored at slot_mapping) into their blocks' summaries: a key
    at offset 0 starts its block afresh. A block's tokens arrive in order, so within a step the
    tokens of a restarted block all follow its offset-0 token and the reset may come first."""
    slots = slot_mapping.to(summaries[0].device) if summaries else slot_mapping
    blocks = slots // block_size
    restarted = blocks[slots % block_size == 0]
    for kv_cache, summary in zip(kv_caches, summaries):
        keys = kv_cache[0][:, slots].float()  # [Hkv, T, D]
        lo, hi = summary[0], summary[1]
        lo.index_fill_(1, restarted, float("inf"))
        hi.index_fill_(1, restarted, float("-inf"))
        index = blocks[None, :, None].expand_as(keys)
        lo.scatter_reduce_(1, index, keys, "amin")
        hi.scatter_reduce_(1, index, keys, "amax")


def num_blocks(context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    return (context_lens + block_size - 1) // block_size


def block_scores(q: torch.Tensor, summary: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, group: int) -> torch.Tensor:
    """Quest's bound of q.k per block, summed over each KV head's group of query heads:
    q [B, H, D] -> [B, Hkv, W] fp32; -inf past each sequence's blocks. (The native kernel computes
    the same sum as P.max + N.min, P and N the group's summed positive and negative parts of q.)"""
    b, h, d = q.shape
    qg = q.float().view(b, h // group, group, 1, d)
    tables = block_tables.clamp(min=0)
    lo = summary[0][:, tables].transpose(0, 1).unsqueeze(2)  # [B, Hkv, 1, W, D]
    hi = summary[1][:, tables].transpose(0, 1).unsqueeze(2)
    scores = torch.maximum(qg * lo, qg * hi).sum((2, 4))
    past = (torch.arange(tables.shape[1], device=tables.device)
            >= num_blocks(context_lens, block_size).to(tables.device)[:, None])
    return scores.masked_fill(past[:, None, :], float("-inf"))


def select_blocks(scores: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                  topk: list[int]) -> torch.Tensor:
    """The blocks each (sequence, KV head) attends under its sequence's topk (> 0), ascending:
    [B, Hkv, max(topk)] int64, -1 past min(n, topk)."""
    selected = torch.full((*scores.shape[:2], max(topk)), -1, dtype=torch.long)
    for i, n in enumerate(num_blocks(context_lens, block_size).tolist()):
        k = topk[i]
        if n <= k:
            selected[i, :, :n] = torch.arange(n)
            continue
        # a stable descending sort keeps the lower index first among equal scores
        order = torch.sort(scores[i, :, 1:n - 1], dim=-1, descending=True, stable=True).indices
        chosen = torch.cat((torch.zeros_like(order[:, :1]), order[:, :k - 2] + 1,
                            torch.full_like(order[:, :1], n - 1)), dim=-1)
        selected[i, :, :k] = chosen.sort(dim=-1).values
    return selected


def attend_blocks(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, block_size: int, scale: float,
                  selected: torch.Tensor) -> torch.Tensor:
    """Softmax attention of each KV head's group over the tokens of its selected blocks (the
    newest only up to the context length): [B, H * D] fp32."""
    b, h, d = q.shape
    hkv = kv_cache.shape[1]
    group = h // hkv
    out = torch.empty(b, h, d)
    for i, n in enumerate(context_lens.tolist()):
        for kvh in range(hkv):
            blocks = selected[i, kvh][selected[i, kvh] >= 0].long()
            offsets = torch.arange(block_size)
            slots = (block_tables[i, blocks, None] * block_size + offsets).flatten()
            valid = (blocks[:, None] * block_size + offsets).flatten() < n
            k = kv_cache[0, kvh, slots[valid]].float()
            v = kv_cache[1, kvh, slots[valid]].float()
            heads = slice(kvh * group, (kvh + 1) * group)
            weights = torch.softmax(q[i, heads].float() @ k.T * scale, dim=-1)
            out[i, heads] = weights @ v
    return out.view(b, h * d)


def sparse_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, summary: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                      scale: float, topk: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's sparse decode, topk for every sequence or one each, in the kernels' encoding
    (0: dense), as the kernels take it: (out [B, H * D], selected [B, Hkv, max(topk)] int64)."""
    ks = [topk] * q.shape[0] if isinstance(topk, int) else list(topk)
    group = q.shape[1] // kv_cache.shape[1]
    scores = block_scores(q, summary, block_tables, context_lens, block_size, group)
    dense = [k == 0 for k in ks]
    attended = select_blocks(scores, context_lens, block_size,
                             [n if d else k for n, k, d in zip(
                                 num_blocks(context_lens, block_size).tolist(), ks, dense)])
    out = attend_blocks(q, kv_cache, block_tables, context_lens, block_size, scale, attended)
    selected = torch.full((*attended.shape[:2], max(ks)), -1, dtype=torch.long)
    width = min(max(ks), attended.shape[2])
    selected[:, :, :width] = attended[:, :, :width]
    selected[torch.tensor(dense)] = -1
    return out, selected
