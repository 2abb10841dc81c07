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
        sparse=True,
    )
    cuda_graphs = True
    """Decode metadata can live in static device tensors (static_decode_metadata), so decode
    steps can replay CUDA graphs."""

    def __init__(self, *args, tile: int | None = None, **kwargs):
        """tile: the kernels' block_n and block_m (None: default_tile's choice for this device and
        head size). The tests set 64 to run the GPU's tiles under TRITON_INTERPRET."""
        super().__init__(*args, **kwargs)
        from tierserve.kernels import triton_kernels  # imports triton
        self.k = triton_kernels
        on_gpu = self.device.type == "cuda"
        self.target_programs = (2 * torch.cuda.get_device_properties(self.device).multi_processor_count
                                if on_gpu else 1)
        """Decode splits the context until batch * KV heads * splits reaches this."""
        self.block_n = self.block_m = tile or default_tile(on_gpu, self.head_dim)

    def build_metadata(self, layout: BatchLayout) -> TritonMeta:
        dec = self._decode_meta(layout.decode_part()) if layout.num_decodes else None
        pre = layout.prefill_part()
        pmeta = self._prefill_meta(pre, layout.query_start[layout.num_decodes]) if pre.num_seqs else None
        return TritonMeta(dec, pmeta)

    def _decode_meta(self, lay: BatchLayout) -> TritonDecodeMeta:
        b, dev = lay.num_seqs, self.device
        split_len, splits = self._splits(b, max(lay.context_lens))
        return TritonDecodeMeta(b, lay.block_tables.to(dev, non_blocking=True),
                                torch.tensor(lay.context_lens, dtype=torch.int32).to(dev),
                                lay.block_size, split_len, splits)

    def _splits(self, batch: int, longest: int) -> tuple[int, int]:
        """(split_len, num_splits) for a decode batch whose longest context is `longest`."""
        tiles = -(-longest // self.block_n)
        want = -(-self.target_programs // (batch * self.num_kv_heads))
        splits = max(1, min(want, tiles, 32))
        split_len = -(-tiles // splits) * self.block_n
        return split_len, -(-longest // split_len)

    def static_decode_metadata(self, tables: torch.Tensor, lens: torch.Tensor,
                               page_size: int) -> TritonMeta:
        """Decode-only metadata over device tensors a CUDA graph keeps (engine/worker/cuda_graphs.py):
        tables [batch, width] int64, lens [batch] int32, refilled before every replay. The
        splits are python ints baked into the graph, so they are sized for the longest context
        the width admits (width * page_size), not for the batch's longest. The kernel reads each
        sequence's length from `lens`, so splits past a context loop over nothing and weigh 0 in
        the combine; the cost is fewer splits carrying the real context than eager would use:
        at most 2x fewer for a width chosen by next_power_of_two (more below the narrowest
        width, or where capped widths leave gaps), which matters only for small batches whose
        programs do not fill the SMs anyway (batch * KV heads < 2 * SMs)."""
        b, width = tables.shape
        split_len, splits = self._splits(b, width * page_size)
        return TritonMeta(TritonDecodeMeta(b, tables, lens, page_size, split_len, splits), None)

    def forward_sparse(self, q, k, v, kv_cache, meta: TritonMeta, sparse, layer):
        """forward() with the decodes attending their top-k blocks (triton_kernels
        .sparse_paged_decode): scoring, choice and attention stay on the device. The splits are
        sized for the most blocks any decode attends (sparse.max_blocks, known on the host)."""
        if meta.decode is None:
            return self.forward(q, k, v, kv_cache, meta)
        q = q if q.stride(-1) == 1 else q.contiguous()
        m = meta.decode
        longest = sparse.max_blocks * m.page_size if sparse.max_blocks else m.split_len * m.num_splits
        split_len, splits = self._splits(m.batch, longest)
        dec = self.k.sparse_paged_decode(
            q[:m.batch], kv_cache, sparse.summaries[layer], m.tables, m.lens, sparse.topk,
            m.page_size, split_len, splits, self.num_heads // self.num_kv_heads, self.scale,
            self.kv_scale, self.block_n, sparse.selected, sparse.stats)
        if meta.prefill is None:
            return dec.reshape(m.batch, -1)
        out = self.forward(q, k, v, kv_cache, TritonMeta(None, meta.prefill))
        out[:m.batch] = dec.reshape(m.batch, -1)
        return out

    def _prefill_meta(self, lay: BatchLayout, t0: int) -> TritonPrefillMeta:
        dev = self.device

        def ints(xs):
            return torch.tensor(xs, dtype=torch.int32).to(dev, non_blocking=True)
        return TritonPrefillMeta(t0, lay.block_tables.to(dev, non_blocking=True),
                                 ints(lay.query_start[:-1]), ints(lay.query_lens),
                                 ints(lay.context_lens), max(lay.query_lens), lay.block_size)

    def forward(self, q, k, v, kv_cache, meta: TritonMeta, window: int | None = None):
        if window is not None:  # capabilities say no sliding window: the router sends none here
            raise NotImplementedError("the triton kernels take no sliding window")
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


def default_tile(on_gpu: bool, head_dim: int) -> int:
    """Context positions (and prefill query rows) per tile: 64 on a GPU for heads up to 128 wide,
    else 32 (the interpreter's, and the register budget of wider heads)."""
    return 64 if on_gpu and head_dim <= 128 else 32
