"""torch scaled_dot_product_attention over the paged cache (CPU and CUDA).

Decodes run as one batched GQA matmul over a gather of every decode's KV padded to the longest
context; prefill chunks run one SDPA call each (a fresh prompt attends to its own K/V directly,
a chunk after cached tokens gathers its context and uses a bottom-right causal mask).

With `prefill_bf16_min_rows` set (--prefill-bf16, CPUs with AMX), a chunk of at least that many
rows attends in bf16: q, k and v rounded to bf16, torch's flash attention (its bf16 GEMMs run on
AMX's tiles, fp32 softmax and accumulation), the output widened back to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class PrefillMeta:
    q0: int
    q1: int
    slots: torch.Tensor | None
    """Context slots to gather; None when the chunk is the whole context (a fresh prompt)."""
    mask: torch.Tensor | None
    """[q_len, ctx] bool, bottom-right causal; None with slots None (is_causal)."""


@dataclass
class SdpaMeta:
    decode: object | None
    """The decode group's metadata (DecodeMeta here; subclasses bring their own)."""
    prefills: list[PrefillMeta]


def context_slots(layout: BatchLayout, seq: int, n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return layout.block_tables[seq, pos // layout.block_size] * layout.block_size + pos % layout.block_size


def causal_mask(q_len: int, ctx: int) -> torch.Tensor:
    return torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"
    capabilities = Capabilities(
        device_types=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_dtypes=("auto", "float32", "float16", "bfloat16", "fp8_e4m3"),
        min_capability_for=(("bfloat16", (8, 0)),),
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
        return DecodeMeta(b, width, slots.to(self.device), bias.to(self.device))

    def forward(self, q, k, v, kv_cache, meta: SdpaMeta):
        if not meta.prefills and meta.decode is not None and meta.decode.batch == q.shape[0]:
            return self._decode(q, kv_cache, meta.decode)  # all decodes: no copy into `out`
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if meta.decode is not None:
            out[:meta.decode.batch] = self._decode(q, kv_cache, meta.decode)
        for p in meta.prefills:
            out[p.q0:p.q1] = self._prefill(q, k, v, kv_cache, p)
        return out

    def _decode(self, q, kv_cache, m: DecodeMeta):
        hkv, d, b = self.num_kv_heads, self.head_dim, m.batch
        g = self.num_heads // hkv
        kg = self.read_kv(kv_cache[0].index_select(1, m.slots), q.dtype).view(hkv * b, m.width, d)
        vg = self.read_kv(kv_cache[1].index_select(1, m.slots), q.dtype).view(hkv * b, m.width, d)
        qd = q[:b].view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)
        scores = torch.baddbmm(m.bias.to(q.dtype), qd, kg.transpose(1, 2), alpha=self.scale)
        o = torch.bmm(torch.softmax(scores, dim=-1), vg)
        return o.view(hkv, b, g, d).transpose(0, 1).reshape(b, hkv * g * d)

    def _prefill(self, q, k, v, kv_cache, p: PrefillMeta):
        dt = q.dtype
        if 0 < self.prefill_bf16_min_rows <= p.q1 - p.q0 and dt == torch.float32:
            dt = torch.bfloat16
        qq = q[p.q0:p.q1].transpose(0, 1).unsqueeze(0).to(dt)
        if p.slots is None:
            kk = k[p.q0:p.q1].transpose(0, 1).unsqueeze(0).to(dt)
            vv = v[p.q0:p.q1].transpose(0, 1).unsqueeze(0).to(dt)
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            kk = self.read_kv(kv_cache[0].index_select(1, p.slots), q.dtype).unsqueeze(0).to(dt)
            vv = self.read_kv(kv_cache[1].index_select(1, p.slots), q.dtype).unsqueeze(0).to(dt)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=p.mask, scale=self.scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1).reshape(p.q1 - p.q0, -1).to(q.dtype)
