"""Per-phase routing as a thin composite: decodes to one backend, prefill chunks to another.

Each inner backend builds its own metadata from its part of the same BatchLayout (decodes lead
the flat batch, so the split is one offset). Both share the cache layout and write_kv."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierserve.kernels.base import AttentionBackend, BatchLayout


@dataclass
class SplitMeta:
    num_decode_tokens: int
    decode: Any | None
    prefill: Any | None


class PhaseSplit(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        super().__init__(decode.num_heads, decode.num_kv_heads, decode.head_dim, decode.scale,
                         decode.kv_scale, decode.device, decode.dtype,
                         decode.kv_dtype)
        self.prefill, self.decode = prefill, decode
        self.name = f"prefill={prefill.name},decode={decode.name}"
        self.capabilities = decode.capabilities

    def build_metadata(self, layout: BatchLayout) -> SplitMeta:
        nd = layout.num_decodes
        dec = self.decode.build_metadata(layout.decode_part()) if nd else None
        pre = self.prefill.build_metadata(layout.prefill_part()) if nd < layout.num_seqs else None
        return SplitMeta(layout.query_start[nd], dec, pre)

    def forward(self, q, k, v, kv_cache, meta: SplitMeta,
                window: int | None = None) -> torch.Tensor:
        n = meta.num_decode_tokens
        if meta.prefill is None:
            return self.decode.forward(q, k, v, kv_cache, meta.decode, window)
        if meta.decode is None:
            return self.prefill.forward(q, k, v, kv_cache, meta.prefill, window)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        out[:n] = self.decode.forward(q[:n], k[:n], v[:n], kv_cache, meta.decode, window)
        out[n:] = self.prefill.forward(q[n:], k[n:], v[n:], kv_cache, meta.prefill, window)
        return out

    def forward_sparse(self, q, k, v, kv_cache, meta: SplitMeta, sparse, layer) -> torch.Tensor:
        n = meta.num_decode_tokens
        if meta.decode is None:
            return self.prefill.forward(q, k, v, kv_cache, meta.prefill)
        dec = self.decode.forward_sparse(q[:n], k[:n], v[:n], kv_cache, meta.decode, sparse, layer)
        if meta.prefill is None:
            return dec
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        out[:n] = dec
        out[n:] = self.prefill.forward(q[n:], k[n:], v[n:], kv_cache, meta.prefill)
        return out
