"""CPU backend: decode and prefill attention in C++ kernels that read K/V blocks in place
(csrc/paged_decode.cpp, csrc/prefill_attention.cpp); shapes the prefill kernel does not take
(head dim or block size not a multiple of 16, or no AVX2) run their prefill chunks through torch
SDPA (inherited), while decode (dense or sparse) stays native: its kernels take any shape.

The gather that torch_sdpa does for decode writes every context token's K and V to a scratch
tensor and reads it back: three times the bytes attention needs. For prefill, SDPA runs one call
per chunk (a gather and a mask for a chunk after cached tokens); the kernel takes every chunk of
the step in one call and skips the masked half of each causal square. Both kernels are part of the
native extension (kernels/native.py), compiled on first use for this CPU. With --prefill-bf16
(AMX) prefill chunks go to torch SDPA in bf16 instead (torch_sdpa.py: prefill_bf16_min_rows):
on a 2-core Xeon with AMX a 2,048-token causal square takes ~12 ms there, ~44 ms here in fp32.

The KV cache may be fp32 (the model's dtype) or fp16 (`kv_cache_dtype="float16"`, llama.cpp's
default): the kernels widen fp16 blocks to fp32 as they read them, and store K/V rounded to
nearest-even, so an fp16 cache gives what an fp32 cache holding the same rounded values gives, from
half the bytes (decode attention reads every context token's K/V on every step: at batch 64 and
context 256 that is 754 MB in fp32).

Sliding-window layers (Gemma 3's): a step of decodes only runs the native decode kernel with the
window's bounds (it reads only the blocks the window reaches); a step with prefill chunks runs
them through the torch SDPA path this class inherits, with the window in its masks (the native
prefill kernel takes no window). That step's SDPA metadata is built on the first windowed layer
that asks and shared by the rest; the whole-context layers stay native.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.kernels.base import BatchLayout, Capabilities
from tierserve.kernels.native import load_extension
from tierserve.kernels.torch_sdpa import SdpaMeta, TorchSdpaBackend


@dataclass
class NativeDecodeMeta:
    batch: int
    block_size: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class NativePrefillMeta:
    rows: tuple[int, int]
    """The prefill tokens' rows of the flat batch, [first, end)."""
    block_tables: torch.Tensor
    """[prefills, max_blocks] int64."""
    query_start: torch.Tensor
    """[prefills + 1] int64: the row where each chunk begins (rows[1] last)."""
    context_lens: torch.Tensor
    """[prefills] int64: cached + new tokens of each."""
    block_size: int


@dataclass
class NativeMeta:
    decode: NativeDecodeMeta | None
    prefill: NativePrefillMeta | list | None
    """The native kernel's metadata, or torch SDPA's PrefillMeta per chunk."""
    layout: BatchLayout | None = None
    """The step's layout, for the windowed layers' SDPA metadata."""
    sdpa: SdpaMeta | None = None
    """torch SDPA's metadata of the step, built by the first windowed layer."""


class CpuNativeBackend(TorchSdpaBackend):
    name = "cpu_native"
    capabilities = Capabilities(
        device_types=("cpu",),
        dtypes=(torch.float32,),
        kv_dtypes=("auto", "float32", "float16"),
        requires=("ninja",),
        sparse=True,
        sliding_window=True,  # windowed layers through the inherited torch SDPA path
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError("the cpu_native kernel could not be built (see the log)")

    def plain_kv_store(self, kv_cache: torch.Tensor) -> bool:
        """The native store (rope_store_kv_) writes fp32 and fp16 caches, rounding as write_kv."""
        return kv_cache.dtype in (torch.float32, torch.float16) and self.dtype == torch.float32

    def build_metadata(self, layout: BatchLayout):
        b = layout.num_decodes
        decode = self._native_decode_meta(layout) if b else None
        prefill = None
        if layout.num_seqs > b and (self.prefill_bf16_min_rows or not
                                    self.ext.paged_prefill_supported(self.head_dim,
                                                                     layout.block_size)):
            prefill = self._prefill_metas(layout)  # torch SDPA's, one per chunk (bf16: AMX)
        elif layout.num_seqs > b:
            starts = layout.query_start[b:]
            prefill = NativePrefillMeta((starts[0], starts[-1]), layout.block_tables[b:].contiguous(),
                                        torch.tensor(starts, dtype=torch.long),
                                        torch.tensor(layout.context_lens[b:], dtype=torch.long),
                                        layout.block_size)
        return NativeMeta(decode, prefill, layout)

    def _prefill_into(self, q, k, v, kv_cache, p, out) -> None:
        """The step's prefill chunks into their rows of out: the native kernel, or torch SDPA per
        chunk for shapes it does not take (the decode kernels take any block size and head dim)."""
        if isinstance(p, list):
            for chunk in p:
                out[chunk.q0:chunk.q1] = self._prefill(q, k, v, kv_cache, chunk)
            return
        self.ext.paged_prefill_(q, kv_cache, p.block_tables, p.query_start, p.context_lens,
                                p.block_size, self.scale, out)

    def forward(self, q, k, v, kv_cache, meta, window: int | None = None):
        if not isinstance(meta, NativeMeta):
            return super().forward(q, k, v, kv_cache, meta, window)
        d, p = meta.decode, meta.prefill
        if window is not None and p is None:  # decodes only: the native kernel's window bounds
            return self._native_decode(q, kv_cache, d, window)
        if window is not None:
            if meta.sdpa is None:
                meta.sdpa = super().build_metadata(meta.layout)
            return super().forward(q, k, v, kv_cache, meta.sdpa, window)
        if p is None:
            return self._native_decode(q, kv_cache, d)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if d is not None:
            out[:d.batch] = self._native_decode(q, kv_cache, d)
        self._prefill_into(q, k, v, kv_cache, p, out)
        return out

    def forward_sparse(self, q, k, v, kv_cache, meta, sparse, layer):
        if not isinstance(meta, NativeMeta) or meta.decode is None:
            return self.forward(q, k, v, kv_cache, meta)
        d, p = meta.decode, meta.prefill
        dec = self.ext.sparse_paged_decode(
            q[:d.batch], kv_cache, sparse.summaries[layer], d.block_tables, d.context_lens,
            d.block_size, self.scale, sparse.topk, sparse.selected, sparse.stats).view(d.batch, -1)
        if p is None:
            return dec
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        out[:d.batch] = dec
        self._prefill_into(q, k, v, kv_cache, p, out)
        return out

    @staticmethod
    def decode_only(meta) -> NativeDecodeMeta | None:
        """The decode metadata of a step that is decodes only (for the model's one-call decode
        stack, csrc/decode_forward.cpp), else None."""
        if isinstance(meta, NativeMeta) and meta.prefill is None:
            return meta.decode
        return None

    def _native_decode_meta(self, layout: BatchLayout) -> NativeDecodeMeta:
        b = layout.num_decodes
        return NativeDecodeMeta(b, layout.block_size, layout.block_tables[:b].contiguous(),
                                torch.tensor(layout.context_lens[:b], dtype=torch.long))

    def _native_decode(self, q, kv_cache, m: NativeDecodeMeta, window: int | None = None):
        out = self.ext.paged_decode(q[:m.batch], kv_cache, m.block_tables, m.context_lens,
                                    m.block_size, self.scale, window or 0)
        return out.view(m.batch, -1)
