"""Our Triton paged attention (decode and prefill) for CUDA; see kernels/triton_kernels.py.

The capability descriptor lives here without importing triton, so routing never needs it. On the
CPU the kernels run under TRITON_INTERPRET=1 (tests only: the descriptor says CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.kernels.base import AttentionBackend, BatchLayout, Capabilities

HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)

@dataclass
class TritonDecodeMeta:
    batch: int
    tables: torch.Tensor
    """[batch, max_blocks] on the device."""
    lens: torch.Tensor
    """[batch] context lengths on the device."""
    page_size: int
    split_len: int
    """Context positions per split (a multiple of the key tile)."""
    num_splits: int

@dataclass
class TritonPrefillMeta:
    t0: int
    """First prefill token in the step's flat batch."""
    tables: torch.Tensor
    q_start: torch.Tensor
    """[n] first query token of each chunk, relative to t0."""
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    max_q_len: int
    page_size: int

@dataclass
class TritonMeta:
    decode: TritonDecodeMeta | None
    prefill: TritonPrefillMeta | None

class TritonBackend(AttentionBackend):
    name = "triton"
    capabilities = Capabilities(
        device_types=("cuda",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_dtypes=("auto", "float32", "float16", "bfloat16", "fp8_e4m3"),
        head_dims=HEAD_DIMS,
        min_capability=(8, 0),
        requires=("triton",),
        min_capability_for=(("fp8_e4m3", (8, 9)),),  # fp8e4nv conversions need sm89+
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from tierserve.kernels import triton_kernels  # imports triton
        self.k = triton_kernels
        on_gpu = self.device.type == "cuda"
        self.target_programs = (2 * torch.cuda.get_device_properties(self.device).multi_processor_count
                                if on_gpu else 1)
        """Decode splits the context until batch * KV heads * splits reaches this."""
        self.block_n = 64 if on_gpu and self.head_dim <= 128 else 32
        self.block_m = 64 if on_gpu and self.head_dim <= 128 else 32

    def build_metadata(self, layout: BatchLayout) -> TritonMeta:
        dec = self._decode_meta(layout.decode_part()) if layout.num_decodes else None
        pre = layout.prefill_part()
        pmeta = self._prefill_meta(pre, layout.query_start[layout.num_decodes]) if pre.num_seqs else None
        return TritonMeta(dec, pmeta)

    def _decode_meta(self, lay: BatchLayout) -> TritonDecodeMeta:
        b, dev = lay.num_seqs, self.device
        longest = max(lay.context_lens)
        tiles = -(-longest // self.block_n)
        want = -(-self.target_programs // (b * self.num_kv_heads))
        splits = max(1, min(want, tiles, 32))
        split_len = -(-tiles // splits) * self.block_n
        splits = -(-longest // split_len)
        return TritonDecodeMeta(b, lay.block_tables.to(dev, non_blocking=True),
                                torch.tensor(lay.context_lens, dtype=torch.int32).to(dev),
                                lay.block_size, split_len, splits)

    def _prefill_meta(self, lay: BatchLayout, t0: int) -> TritonPrefillMeta:
        dev = self.device

        def ints(xs):
            return torch.tensor(xs, dtype=torch.int32).to(dev, non_blocking=True)
        return TritonPrefillMeta(t0, lay.block_tables.to(dev, non_blocking=True),
                                 ints(lay.query_start[:-1]), ints(lay.query_lens),
                                 ints(lay.context_lens), max(lay.query_lens), lay.block_size)

    def forward(self, q, k, v, kv_cache, meta: TritonMeta):
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = q.new_empty(q.shape[0], self.num_heads, self.head_dim)
        g = self.num_heads // self.num_kv_heads
        if meta.decode is not None:
            m = meta.decode
            out[:m.batch] = self.k.paged_decode(
                q[:m.batch], kv_cache, m.tables, m.lens, m.page_size, m.split_len,
                m.num_splits, g, self.scale, self.kv_scale, self.block_n)
        if meta.prefill is not None:
            p = meta.prefill
            out[p.t0:] = self.k.paged_prefill(
                q[p.t0:], kv_cache, p.tables, p.q_start, p.q_lens, p.ctx_lens, p.max_q_len,
                p.page_size, g, self.scale, self.kv_scale, self.block_m,
                self.block_n)
        return out.view(q.shape[0], -1)
