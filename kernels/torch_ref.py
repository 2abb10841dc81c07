"""Reference attention: plain matmul and softmax per sequence, any shape. The oracle in tests."""

from __future__ import annotations

import torch

from tierserve.kernels.base import AttentionBackend, BatchLayout, Capabilities
from tierserve.kernels.torch_sdpa import context_slots


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    capabilities = Capabilities(
        device_types=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_dtypes=("auto", "float32", "float16", "bfloat16", "fp8_e4m3"),
        sliding_window=True,
    )

    def build_metadata(self, layout: BatchLayout) -> list[tuple[int, int, torch.Tensor]]:
        return [(layout.query_start[s], layout.query_lens[s],
                 context_slots(layout, s, layout.context_lens[s]).to(self.device))
                for s in range(layout.num_seqs)]

    def forward(self, q, k, v, kv_cache, meta, window: int | None = None):
        g = self.num_heads // self.num_kv_heads
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for q0, ql, slots in meta:
            ctx = slots.numel()
            kk = self.read_kv(kv_cache[0][:, slots], torch.float32).repeat_interleave(g, 0)  # [H, ctx, D]
            vv = self.read_kv(kv_cache[1][:, slots], torch.float32).repeat_interleave(g, 0)
            qq = q[q0:q0 + ql].float().transpose(0, 1)                    # [H, ql, D]
            scores = qq @ kk.transpose(1, 2) * self.scale                  # [H, ql, ctx]
            pos = torch.arange(ctx, device=scores.device)
            allowed = pos[None, :] <= pos[ctx - ql:, None]
            if window is not None:  # a query at p sees (p - window, p]
                allowed &= pos[None, :] > pos[ctx - ql:, None] - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ vv                         # [H, ql, D]
            out[q0:q0 + ql] = o.transpose(0, 1).reshape(ql, -1).to(q.dtype)
        return out
