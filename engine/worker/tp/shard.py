"""Megatron-style sharding at load (see the package docstring) and a rank's collectives."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tierserve.engine.config import ModelConfig
from tierserve.engine.worker.loaders.lazy import LazyWeights
from tierserve.engine.worker.loaders.gguf_kquants import BLOCK_BYTES as KQ_BYTES
from tierserve.engine.worker.loaders.gguf_kquants import BLOCK_SIZE as KQ_SIZE
from tierserve.engine.worker.loaders.source import QuantBlocks


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each dimension rank `rank` of `size` holds."""

    rank: int
    size: int
    cfg: ModelConfig

    def _share(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's `n` consecutive items."""
        return self.rank * n, n

    @property
    def heads(self) -> tuple[int, int]:
        return self._share(self.cfg.num_heads // self.size)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's KV heads: its share, or (N above the KV heads) the one its queries read."""
        hkv = self.cfg.num_kv_heads
        if self.size <= hkv:
            return self._share(hkv // self.size)
        return self.rank * hkv // self.size, 1

    @property
    def inter(self) -> tuple[int, int]:
        return self._share(self.cfg.intermediate_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        return self._share(-(-self.cfg.vocab_size // self.size))

    def local_config(self) -> ModelConfig:
        return dataclasses.replace(self.cfg, num_heads=self.heads[1],
                                   num_kv_heads=self.kv_heads[1],
                                   intermediate_size=self.inter[1], vocab_size=self.vocab[1])


SHARDED = ("llama", "mistral", "qwen2", "qwen3")
"""The families whose model takes a rank's shard (llama.py's `tp`)."""


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """A one-line ValueError when the model's heads or widths do not split over `size` ranks."""
    h, hkv, i = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    why = None
    if cfg.architecture not in SHARDED:
        why = f"{cfg.architecture} has no tensor-parallel path (sharded: {', '.join(SHARDED)})"
    elif h % size:
        why = f"its {h} query heads do not divide by {size}"
    elif size <= hkv and hkv % size:
        why = f"its {hkv} KV heads do not divide by {size}"
    elif size > hkv and size % hkv:
        why = f"{size} ranks cannot share its {hkv} KV heads evenly (replication needs a multiple)"
    elif i % size:
        why = f"its MLP width {i} does not divide by {size}"
    if why:
        raise ValueError(f"tensor_parallel_size {size}: this model cannot be sharded: {why}")


def shard_model(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], rank: int,
                size: int) -> tuple[ModelConfig, LazyWeights]:
    """Rank `rank`'s config and HF-named weights (see the module docstring); each slice is read
    when the model copies it in (a safetensors file's rows through get_slice), not before."""
    plan = ShardPlan(rank, size, cfg)
    d = cfg.head_dim
    (h0, hn), (k0, kn), (i0, i_n), (v0, vn) = plan.heads, plan.kv_heads, plan.inter, plan.vocab
    src = LazyWeights.over(weights)
    whole = slice(None)
    out = {}
    for name in src:
        index: tuple[slice, ...] = ()
        rows = None
        if ".q_proj." in name:
            index = (slice(h0 * d, (h0 + hn) * d),)
        elif ".k_proj." in name or ".v_proj." in name:
            index = (slice(k0 * d, (k0 + kn) * d),)
        elif ".o_proj." in name:
            index = (whole, slice(h0 * d, (h0 + hn) * d))
        elif ".gate_proj." in name or ".up_proj." in name:
            index = (slice(i0, i0 + i_n),)
        elif ".down_proj." in name:
            index = (whole, slice(i0, i0 + i_n))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            index, rows = (slice(v0, v0 + vn),), vn  # the last rank's rows padded with zeros
        out[name] = src.part(name, index, rows)
    return plan.local_config(), LazyWeights(out)


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, **KQ_BYTES}
"""Bytes of one GGUF block (of 32 weights; of 256 for the K-quants)."""


def shard_blocks(blocks: dict, cfg: ModelConfig, rank: int, size: int) -> dict:
    """Rank `rank`'s slices of a GGUF's quantized blocks (--quantization gguf), cut as
    shard_model cuts the weights: rows of a tensor are whole rows of blocks, and a column cut
    falls on block boundaries (widths that do not leave the tensor out: its start then stops
    with gguf's own error). llama.cpp's RoPE row order is permuted within each head, so whole
    heads stay whole."""
    plan = ShardPlan(rank, size, cfg)
    d = cfg.head_dim
    (h0, hn), (k0, kn), (i0, i_n), (v0, vn) = plan.heads, plan.kv_heads, plan.inter, plan.vocab
    out = {}
    for name, b in blocks.items():
        bpb, (n, k), heads = BLOCK_BYTES[b.kind], b.shape, b.rope_heads
        size = KQ_SIZE.get(b.kind, 32)
        rows = cols = None
        if ".q_proj." in name:
            rows, heads = (h0 * d, hn * d), (hn if heads else None)
        elif ".k_proj." in name or ".v_proj." in name:
            rows, heads = (k0 * d, kn * d), (kn if heads else None)
        elif ".o_proj." in name:
            cols = (h0 * d, hn * d)
        elif ".gate_proj." in name or ".up_proj." in name:
            rows = (i0, i_n)
        elif ".down_proj." in name:
            cols = (i0, i_n)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = (v0, vn)
        raw = b.raw
        if rows is not None:
            raw = raw[rows[0]:rows[0] + rows[1]]
            if raw.shape[0] < rows[1]:  # the vocabulary's padding: zero blocks decode to 0
                raw = np.concatenate([raw, np.zeros((rows[1] - raw.shape[0], raw.shape[1]),
                                                    raw.dtype)])
            n = rows[1]
        if cols is not None:
            if cols[0] % size or cols[1] % size:
                continue
            raw, k = raw[:, cols[0] // size * bpb:(cols[0] + cols[1]) // size * bpb], cols[1]
        out[name] = QuantBlocks(np.ascontiguousarray(raw), b.kind, (n, k), heads)
    return out


class Shard:
    """The model's collective calls on one rank, given to the model at construction
    (LlamaForCausalLM's `tp`, each layer's `reduce`)."""

    def __init__(self, plan: ShardPlan):
        self.vocab_start, self.vocab_local = plan.vocab
        self.vocab_size = plan.cfg.vocab_size
        self.size = plan.size

    @staticmethod
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x)
        return x

    def embed(self, ids: torch.Tensor, table: torch.nn.Module) -> torch.Tensor:
        """Vocab-parallel lookup in `table` (an embedding, or its quantized form): rows this rank
        holds, zeros elsewhere, summed over ranks."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        x = table(local.clamp(0, self.vocab_local - 1))
        return self.all_reduce(x * inside[:, None].to(x.dtype))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the logits, in vocabulary order, padding dropped."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]
