"""FlashInfer's paged prefill and decode wrappers (CUDA), imported only when this backend is built.

Our per-layer cache [2, Hkv, blocks * page, D] is viewed as FlashInfer's HND pages
[blocks, Hkv, page, D] (a permuted view, no copy). plan() runs once per step in build_metadata;
run() once per layer. fp8 caches pass the dequantization scale as k_scale / v_scale.

Per step, nothing is done twice (FlashInfer 0.7.4's decode.py / prefill.py):
- plan() reads indptr and last_page_len on the host (it calls .to("cpu") on them) and copies
  the index tensors to the device itself, non-blocking: so they are built on the host, pinned
  where there is CUDA, and handed over there (device tensors would be copied back, a sync each).
- run() writes into our output rows (out=), not a new tensor copied over per layer.
- The workspace starts zeroed, as FlashInfer asks ("must be initialized to 0 for its first use").
- Decode uses the tensor-core kernel (use_tensor_cores) from a GQA group of 4, where FlashInfer
  documents it as faster; below that the CUDA-core decode kernel.

CUDA graphs: not captured (cuda_graphs stays False; --cuda-graphs decode runs eagerly with the
runner's warning). FlashInfer's graph mode (use_cuda_graph=True with fixed indptr / indices /
last_page_len buffers) fixes the batch size per wrapper and needs plan() on the host before each
replay; engine/worker/cuda_graphs.py captures one graph per (bucket, width) from metadata built
once over static device tensors and has no per-replay host hook, so taking it would need one
wrapper per bucket and a plan() call inside the replay path: the graph-capable decode backend
is triton. Call shapes are checked against a recording stub in tests/test_flashinfer_calls.py;
the kernels themselves only on a GPU node (bench/gpu_check.py).

Sliding windows (Gemma 3): not taken yet, so the router sends windowed models elsewhere.
FlashInfer has them (plan(window_left=window - 1)), but the window is fixed when a wrapper is
planned and its kernel variant chosen, while ours differs by layer: it needs a wrapper pair per
window, each planned once a step, and a run on a GPU before the router may pick it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tierserve.kernels.base import AttentionBackend, BatchLayout, Capabilities

WORKSPACE_BYTES = 128 << 20
TENSOR_CORE_GROUP = 4
"""GQA group (query heads per KV head) from which decode runs FlashInfer's tensor-core kernel."""


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
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        tensor_cores = self.num_heads // self.num_kv_heads >= TENSOR_CORE_GROUP
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "HND", use_tensor_cores=tensor_cores)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")
        self._pin = self.device.type == "cuda"

    def _host(self, values) -> torch.Tensor:
        """An int32 host tensor, pinned under CUDA so plan()'s copy to the device is async. It
        may be dropped as soon as plan() returns: torch's pinned allocator keeps a block from
        reuse until the copies recorded on it have finished."""
        return torch.tensor(values, dtype=torch.int32, pin_memory=self._pin)

    def _pages(self, lay: BatchLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, indices, last_page_len) on the host: FlashInfer's CSR page table."""
        blocks = [-(-c // lay.block_size) for c in lay.context_lens]
        indptr = self._host([0, *itertools.accumulate(blocks)])
        # block_tables is a host view; each row's first `blocks` entries are its pages
        width = torch.arange(lay.block_tables.shape[1])
        used = lay.block_tables[width.unsqueeze(0) < torch.tensor(blocks).unsqueeze(1)]
        indices = torch.empty(used.numel(), dtype=torch.int32, pin_memory=self._pin)
        indices.copy_(used)
        last = self._host([(c - 1) % lay.block_size + 1 for c in lay.context_lens])
        return indptr, indices, last

    def build_metadata(self, layout: BatchLayout) -> FlashInferMeta:
        h, hkv, d, bs = self.num_heads, self.num_kv_heads, self.head_dim, layout.block_size
        dec, pre = layout.decode_part(), layout.prefill_part()
        if dec.num_seqs:
            self._decode.plan(*self._pages(dec), h, hkv, d, bs, pos_encoding_mode="NONE",
                              sm_scale=self.scale, q_data_type=self.dtype,
                              kv_data_type=self.kv_dtype)
        if pre.num_seqs:
            qo = self._host(pre.query_start)
            self._prefill.plan(qo, *self._pages(pre), h, hkv, d, bs, causal=True,
                               sm_scale=self.scale, q_data_type=self.dtype,
                               kv_data_type=self.kv_dtype)
        return FlashInferMeta(layout.num_decodes, bs, dec.num_seqs > 0, pre.num_seqs > 0)

    def forward(self, q, k, v, kv_cache, meta: FlashInferMeta, window: int | None = None):
        if window is not None:  # capabilities say no sliding window: the router sends none here
            raise NotImplementedError("the flashinfer backend takes no sliding window yet")
        hkv, d = self.num_kv_heads, self.head_dim
        pages = kv_cache.view(2, hkv, -1, meta.page_size, d).permute(0, 2, 1, 3, 4)
        paged = (pages[0], pages[1])
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        scales = {"k_scale": self.kv_scale, "v_scale": self.kv_scale} if fp8 else {}
        out = q.new_empty(q.shape[0], self.num_heads, d)
        n = meta.num_decode_tokens
        if meta.decode:  # out[:n] and out[n:] are contiguous row ranges of out
            self._decode.run(q[:n], paged, out=out[:n], **scales)
        if meta.prefill:
            self._prefill.run(q[n:], paged, out=out[n:], **scales)
        return out.view(q.shape[0], -1)
