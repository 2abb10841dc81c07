"""FlashInfer's paged prefill and decode wrappers (CUDA), imported only when this backend is built.

Our per-layer cache [2, Hkv, blocks * page, D] is viewed as FlashInfer's HND pages
[blocks, Hkv, page, D] (a permuted view, no copy). plan() runs once per step in build_metadata;
run() once per layer. fp8 caches pass the dequantization scale as k_scale / v_scale.
Not exercised in CI (no GPU there, and FlashInfer is not installed on the GPU check machine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.kernels.base import AttentionBackend, BatchLayout, Capabilities

WORKSPACE_BYTES = 128 << 20


@dataclass
class FlashInferMeta:
    num_decode_tokens: int
    page_size: int
    decode: bool
    prefill: bool


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    capabilities = Capabilities(  # FlashInfer's documented prebuilt head dims and dtypes
        device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        kv_dtypes=("auto", "float16", "bfloat16", "fp8_e4m3"),
        head_dims=(64, 128, 256),
        gqa_groups=(1, 2, 3, 4, 8),
        min_capability=(7, 5),
        requires=("flashinfer",),
        min_capability_for=(("bfloat16", (8, 0)), ("fp8_e4m3", (8, 9))),
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import flashinfer
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")

    def _pages(self, lay: BatchLayout):
        blocks = [-(-c // lay.block_size) for c in lay.context_lens]
        indptr = torch.tensor([0, *torch.tensor(blocks).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.cat([lay.block_tables[i, :n] for i, n in enumerate(blocks)]).int()
        last = torch.tensor([(c - 1) % lay.block_size + 1 for c in lay.context_lens],
                            dtype=torch.int32)
        dev = self.device
        return indptr.to(dev), indices.to(dev), last.to(dev)

    def build_metadata(self, layout: BatchLayout) -> FlashInferMeta:
        h, hkv, d, bs = self.num_heads, self.num_kv_heads, self.head_dim, layout.block_size
        dec, pre = layout.decode_part(), layout.prefill_part()
        if dec.num_seqs:
            self._decode.plan(*self._pages(dec), h, hkv, d, bs, pos_encoding_mode="NONE",
                              sm_scale=self.scale, q_data_type=self.dtype,
                              kv_data_type=self.kv_dtype)
        if pre.num_seqs:
            qo = torch.tensor(pre.query_start, dtype=torch.int32, device=self.device)
            self._prefill.plan(qo, *self._pages(pre), h, hkv, d, bs, causal=True,
                               sm_scale=self.scale, q_data_type=self.dtype,
                               kv_data_type=self.kv_dtype)
        return FlashInferMeta(layout.num_decodes, bs, dec.num_seqs > 0, pre.num_seqs > 0)

    def forward(self, q, k, v, kv_cache, meta: FlashInferMeta):
        hkv, d = self.num_kv_heads, self.head_dim
        pages = kv_cache.view(2, hkv, -1, meta.page_size, d).permute(0, 2, 1, 3, 4)
        paged = (pages[0], pages[1])
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        scales = {"k_scale": self.kv_scale, "v_scale": self.kv_scale} if fp8 else {}
        out = q.new_empty(q.shape[0], self.num_heads, d)
        n = meta.num_decode_tokens
        if meta.decode:
            out[:n] = self._decode.run(q[:n], paged, **scales)
        if meta.prefill:
            out[n:] = self._prefill.run(q[n:], paged, **scales)
        return out.view(q.shape[0], -1)
