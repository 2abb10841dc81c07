"""torch scaled_dot_product_attention over the paged cache (CPU and CUDA).

Decodes run as one batched GQA matmul over a gather of every decode's KV padded to the longest
context; prefill chunks run one SDPA call each (a fresh prompt attends to its own K/V directly,
a chunk after cached tokens gathers its context and uses a bottom-right causal mask).

With `prefill_bf16_min_rows` set (--prefill-bf16, CPUs with AMX), a chunk of at least that many
rows attends in bf16: q, k and v rounded to bf16, torch's flash attention (its bf16 GEMMs run on
AMX's tiles, fp32 softmax and accumulation), the output widened back to fp32.

A windowed layer (forward's `window`: a query at position p sees keys at (p - window, p]) adds
the window to the same masks: decodes mask the keys before their window (the gather still reads
the whole context: windowed layers keep every block for now), a chunk after cached tokens gathers
only the keys its window reaches, a fresh prompt takes an explicit mask instead of is_causal. The
masks are built on the first layer that asks, once per window and step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tierserve.kernels.base import AttentionBackend, BatchLayout, Capabilities


@dataclass
class DecodeMeta:
    batch: int
    width: int
    """Padded context length of the gather."""
    slots: torch.Tensor
    """[batch * width] slot ids (padding reads slot 0 and is masked)."""
    bias: torch.Tensor
    """[Hkv * batch, 1, width]: 0 for real keys, -inf for padding."""
    lens: torch.Tensor | None = None
    """[batch] context lengths, on the device (the windowed layers' masks)."""
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)
    """bias with the keys before each query's window at -inf too, per window (built on first
    use in a step)."""

    def bias_for(self, window: int | None) -> torch.Tensor:
        """The additive mask of a layer with this sliding window (None: the whole context)."""
        if window is None:
            return self.bias
        if window not in self.windowed:
            pos = torch.arange(self.width, device=self.bias.device)
            before = pos[None, :] < (self.lens - window)[:, None]  # [batch, width]
            hkv = self.bias.shape[0] // self.batch
            self.windowed[window] = self.bias.masked_fill(
                before.repeat(hkv, 1).unsqueeze(1), float("-inf"))
        return self.windowed[window]


@dataclass
class PrefillMeta:
    q0: int
    q1: int
    slots: torch.Tensor | None
    """Context slots to gather; None when the chunk is the whole context (a fresh prompt)."""
    mask: torch.Tensor | None
    """[q_len, ctx] bool, bottom-right causal; None with slots None (is_causal)."""
    windowed: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """Per sliding window: (first context position any query's window reaches, the mask from
    there), built on first use in a step."""

    def window_mask(self, window: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """(lo, mask [q_len, ctx - lo]): the keys this chunk's windows reach start at lo."""
        if window not in self.windowed:
            q_len = self.q1 - self.q0
            ctx = q_len if self.slots is None else self.slots.numel()
            lo = max(0, ctx - q_len - window + 1)
            self.windowed[window] = (lo, causal_mask(q_len, ctx, window)[:, lo:].to(device))
        return self.windowed[window]


@dataclass
class SdpaMeta:
    decode: object | None
    """The decode group's metadata (DecodeMeta here; subclasses bring their own)."""
    prefills: list[PrefillMeta]


def context_slots(layout: BatchLayout, seq: int, n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return layout.block_tables[seq, pos // layout.block_size] * layout.block_size + pos % layout.block_size


def causal_mask(q_len: int, ctx: int, window: int | None = None) -> torch.Tensor:
    """[q_len, ctx] bool: the last q_len positions of a ctx-long context, each seeing the keys
    at or before it (and after its position - window, with a window)."""
    keys, queries = torch.arange(ctx)[None, :], torch.arange(ctx - q_len, ctx)[:, None]
    seen = keys <= queries
    return seen if window is None else seen & (keys > queries - window)


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"
    capabilities = Capabilities(
        device_types=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_dtypes=("auto", "float32", "float16", "bfloat16", "fp8_e4m3"),
        min_capability_for=(("bfloat16", (8, 0)),),
        sliding_window=True,
    )
    prefill_bf16_min_rows = 0
    """Prefill chunks of at least this many rows attend in bf16 (0: never); fp32 models only."""

    def build_metadata(self, layout: BatchLayout) -> SdpaMeta:
        decode = self._decode_meta(layout) if layout.num_decodes else None
        return SdpaMeta(decode, self._prefill_metas(layout))

    def _prefill_metas(self, layout: BatchLayout) -> list[PrefillMeta]:
        prefills = []
        for s in range(layout.num_decodes, layout.num_seqs):
            q0, ql, ctx = layout.query_start[s], layout.query_lens[s], layout.context_lens[s]
            if ql == ctx:
                prefills.append(PrefillMeta(q0, q0 + ql, None, None))
            else:
                prefills.append(PrefillMeta(q0, q0 + ql, context_slots(layout, s, ctx).to(self.device),
                                            causal_mask(ql, ctx).to(self.device)))
        return prefills

    def _decode_meta(self, layout: BatchLayout) -> DecodeMeta:
        b = layout.num_decodes
        lens = torch.tensor(layout.context_lens[:b])
        width = int(lens.max())
        pos = torch.arange(width)
        tables = layout.block_tables[:b]
        slots = tables[:, pos // layout.block_size] * layout.block_size + pos % layout.block_size
        pad = pos[None, :] >= lens[:, None]
        slots = slots.masked_fill(pad, 0).reshape(-1)
        bias = torch.zeros(b, width).masked_fill_(pad, float("-inf"))
        bias = bias.unsqueeze(1).repeat(self.num_kv_heads, 1, 1)
        return DecodeMeta(b, width, slots.to(self.device), bias.to(self.device),
                          lens.to(self.device))

    def forward(self, q, k, v, kv_cache, meta: SdpaMeta, window: int | None = None):
        if not meta.prefills and meta.decode is not None and meta.decode.batch == q.shape[0]:
            return self._decode(q, kv_cache, meta.decode, window)  # all decodes: no copy into `out`
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if meta.decode is not None:
            out[:meta.decode.batch] = self._decode(q, kv_cache, meta.decode, window)
        for p in meta.prefills:
            out[p.q0:p.q1] = self._prefill(q, k, v, kv_cache, p, window)
        return out

    def _decode(self, q, kv_cache, m: DecodeMeta, window: int | None = None):
        hkv, d, b = self.num_kv_heads, self.head_dim, m.batch
        g = self.num_heads // hkv
        kg = self.read_kv(kv_cache[0].index_select(1, m.slots), q.dtype).view(hkv * b, m.width, d)
        vg = self.read_kv(kv_cache[1].index_select(1, m.slots), q.dtype).view(hkv * b, m.width, d)
        qd = q[:b].view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)
        scores = torch.baddbmm(m.bias_for(window).to(q.dtype), qd, kg.transpose(1, 2),
                               alpha=self.scale)
        o = torch.bmm(torch.softmax(scores, dim=-1), vg)
        return o.view(hkv, b, g, d).transpose(0, 1).reshape(b, hkv * g * d)

    def _prefill(self, q, k, v, kv_cache, p: PrefillMeta, window: int | None = None):
        dt = q.dtype
        if 0 < self.prefill_bf16_min_rows <= p.q1 - p.q0 and dt == torch.float32:
            dt = torch.bfloat16
        qq = q[p.q0:p.q1].transpose(0, 1).unsqueeze(0).to(dt)
        lo, mask = (0, p.mask) if window is None else p.window_mask(window, q.device)
        if p.slots is None:
            kk = k[p.q0:p.q1].transpose(0, 1).unsqueeze(0).to(dt)
            vv = v[p.q0:p.q1].transpose(0, 1).unsqueeze(0).to(dt)
        else:
            slots = p.slots[lo:]
            kk = self.read_kv(kv_cache[0].index_select(1, slots), q.dtype).unsqueeze(0).to(dt)
            vv = self.read_kv(kv_cache[1].index_select(1, slots), q.dtype).unsqueeze(0).to(dt)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(p.q1 - p.q0, -1).to(q.dtype)
