"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a flat batch of tokens.

Tokens of many requests are concatenated (no padding): x is [T, hidden]. Attention reaches the
paged KV cache and the step's metadata through the forward context (kernels.context).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.engine.config import ModelConfig
from tierserve.engine.worker.models.layers import (Linear, RMSNorm, RotaryEmbedding, fill as _fill,
                                            linear_sources,
                                            rope_attention_factor, rope_inv_freq)
from tierserve.kernels.context import get_forward_context


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class ParallelContext(Protocol):
    """A rank's collectives, as the model calls them (tensor parallel's Shard)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor, table: nn.Module) -> torch.Tensor: ...

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor: ...


class Attention(nn.Module):
    ops = None
    """The native extension on CPU fp32 (see RMSNorm); rope_store_kv_ then rotates q/k in place
    and stores K/V in one pass, where the cache is a plain fp32 one."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = _same):
        super().__init__()
        self.reduce = reduce
        """Tensor parallel: the all-reduce of o_proj's partial sums (row-parallel); else identity."""
        self.layer = layer
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer]
        flat = self.qkv_proj(x)
        qkv = flat.view(t, self.h + 2 * self.hkv, self.d)
        if self.ops is not None and self.q_norm is None and ctx.backend.plain_kv_store(cache):
            self.ops.rope_store_kv_(flat, positions, self.rope.cos, self.rope.sin, cache,
                                    ctx.slot_mapping, self.h, self.hkv)
            q, k, v = qkv.split([self.h, self.hkv, self.hkv], dim=1)
        else:
            qk, v = qkv[:, :self.h + self.hkv], qkv[:, self.h + self.hkv:]
            if self.q_norm is not None:
                qk = torch.cat((self.q_norm(qk[:, :self.h]), self.k_norm(qk[:, self.h:])), dim=1)
            q, k = self.rope(positions, qk).split([self.h, self.hkv], dim=1)
            ctx.backend.write_kv(k, v, cache, ctx.slot_mapping)
        sparse = ctx.sparse
        if sparse is not None and sparse.applies(self.layer):
            return self.reduce(self.o_proj(ctx.backend.forward_sparse(q, k, v, cache, ctx.metadata,
                                                                      sparse, self.layer)))
        return self.reduce(self.o_proj(ctx.backend.forward(q, k, v, cache, ctx.metadata)))


class MLP(nn.Module):
    ops = None

    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _same):
        super().__init__()
        self.reduce = reduce
        """Tensor parallel: the all-reduce of down_proj's partial sums (row-parallel); else identity."""
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.takes_bf16(x.shape[0]):
            # --prefill-bf16: gate/up stay bf16 into down_proj, which takes bf16 (no round trip
            # through fp32: after an AMX GEMM that widening cost as much as the GEMM)
            h = self.gate_up_proj.bf16_out(x)
            if self.ops is not None:  # one pass, fp32 math, rounded once
                return self.reduce(self.down_proj(self.ops.silu_and_mul(h)))
            gate, up = h.chunk(2, dim=-1)
            return self.reduce(self.down_proj(F.silu(gate) * up))
        if self.ops is not None:
            return self.reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = _same):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rope, reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, reduce)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream kept apart (vLLM's form): returns (mlp output, residual before it)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: ParallelContext | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        """Tensor parallel (engine/worker/tp/shard.py's Shard), or None: this rank holds a slice
        of the vocabulary in the embedding and the LM head, and its layers all-reduce."""
        # Left uninitialized for load_weights (a random init on the meta device would import
        # torch's Python meta kernels: ~150 MB of host memory for nothing).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        mpe = cfg.max_position_embeddings
        with torch.device("cpu"):  # the table is computed on the host in fp32, also when the
            # parameters are built on the meta device (ModelRunner), and moved with the model
            rope = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                 mpe),
                                   max_positions, rope_attention_factor(cfg.rope_scaling, mpe))
        reduce = _same if tp is None else tp.all_reduce
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, reduce)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.ops = None
        """The native extension, set by use_native_ops()."""
        self._stack: list[torch.Tensor] | None = None
        """Every layer's weights in decode_forward's order, when the one-call path applies."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        x, residual = self._embed(input_ids), None
        decode = self._stack_decode(x.shape[0])
        if decode is not None:
            return self._decode_in_one_call(x, positions, decode)
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only for the rows that are sampled: [N, hidden] -> [N, vocab] fp32."""
        logits = self.lm_head(hidden).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        return self.tp.embed(input_ids, self.embed_tokens)

    def load_weights(self, weights: Mapping[str, torch.Tensor],
                     skip: frozenset[str] = frozenset()) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up: each tensor is read once (a
        LazyWeights reads it from the file then) and copied straight into its parameter, on the
        parameter's device and in its dtype. A parameter whose tensors are all in `skip` is left
        as it is (never read: quantization takes those from the file's blocks)."""
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            _fill(attn.qkv_proj.weight, weights, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], skip)
            if attn.qkv_proj.bias is not None:
                _fill(attn.qkv_proj.bias, weights, [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            _fill(attn.o_proj.weight, weights, [p + "self_attn.o_proj.weight"], skip)
            if attn.q_norm is not None:
                _fill(attn.q_norm.weight, weights, [p + "self_attn.q_norm.weight"])
                _fill(attn.k_norm.weight, weights, [p + "self_attn.k_norm.weight"])
            _fill(layer.mlp.gate_up_proj.weight, weights,
                  [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], skip)
            _fill(layer.mlp.down_proj.weight, weights, [p + "mlp.down_proj.weight"], skip)
            _fill(layer.input_layernorm.weight, weights, [p + "input_layernorm.weight"])
            _fill(layer.post_attention_layernorm.weight, weights,
                  [p + "post_attention_layernorm.weight"])
        _fill(self.embed_tokens.weight, weights, ["model.embed_tokens.weight"], skip)
        _fill(self.norm.weight, weights, ["model.norm.weight"])
        if "rope_freqs.weight" in weights:  # Llama 3.1 GGUFs carry the scaled frequencies' divisors
            rope = self.layers[0].self_attn.rope
            rope.build(rope_inv_freq(self.config.head_dim, self.config.rope_theta, None)
                       / weights["rope_freqs.weight"], rope.cos.shape[0])
        tied = self.config.tie_word_embeddings or "lm_head.weight" not in weights
        _fill(self.lm_head.weight, weights,
              ["model.embed_tokens.weight" if tied else "lm_head.weight"], skip)

    def linear_sources(self) -> list[tuple[Linear, list[str]]]:
        """Each linear layer with the checkpoint tensors it fuses (quantization packs those)."""
        return linear_sources(self.layers)

    def use_bf16_prefill(self, min_rows: int) -> None:
        """Batches of at least min_rows tokens (prefill chunks) run the decoder layers' linears
        in bf16 (Linear.bf16_min_rows; 0: off). The LM head takes only the sampled rows."""
        for layer in self.layers:
            for lin in layer.modules():
                if isinstance(lin, Linear):
                    lin.bf16_min_rows = min_rows

    def use_native_ops(self, ops, batch_hint: int = 64) -> None:
        """Route the element-wise ops and the linear layers through the native extension (CPU,
        fp32), or back to torch (None); the linear weights are packed again for the new path."""
        self.ops = ops
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP, Linear)):
                m.ops = ops
            if isinstance(m, Linear):
                m.pack(batch_hint)
        self._stack, self._qstack = None, []
        linears = [[layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj] for layer in self.layers]
        if ops is None or self.config.qk_norm or not all(
                _stack_weight(lin) is not None for lins in linears for lin in lins):
            return
        none = torch.empty(0)
        self._stack = []
        for layer, (qkv, o, gate_up, down) in zip(self.layers, linears):
            self._stack += [layer.input_layernorm.weight, _stack_weight(qkv),
                            none if qkv.bias is None else qkv._panel_bias,
                            _stack_weight(o), layer.post_attention_layernorm.weight,
                            _stack_weight(gate_up), _stack_weight(down)]
        parts = [lin._quant.stack_parts() if lin._quant is not None else None
                 for lins in linears for lin in lins]
        if any(parts):
            self._qstack = [t if t is not None else none
                            for p in parts for t in (p[1:] if p else (None, None))]

    # ---- decode steps in one native call (kernels/csrc/decode_forward.cpp) -----------------

    stack_decode_min_batch = 1
    """EngineConfig.stack_decode_min_batch (the runner sets it). Decode-only steps of at least this many sequences run the whole layer stack in one native
    call, by a team of torch's threads that split every GEMM's weights and the attention rows and
    meet at spin barriers; 0 keeps every step layer by layer. The team does the layer-by-layer
    path's work split without its ~150 thread hand-offs and Python calls per step. Measured on a
    2-vCPU Intel Xeon with AVX-512, the layer stack alone at context 256: batch 1 takes 16.4 ms in
    one call against 17-21 layer by layer, batch 8 22.5 against 30.3, batch 64 97 against 108."""

    def _stack_decode(self, batch: int):
        """The decode metadata when this step can run in one native call, else None."""
        if (self._stack is None or not self.stack_decode_min_batch
                or batch < self.stack_decode_min_batch):
            return None
        ctx = get_forward_context()
        decode_only = getattr(ctx.backend, "decode_only", None)
        meta = decode_only(ctx.metadata) if decode_only is not None else None
        if meta is None or meta.batch != batch or not ctx.backend.plain_kv_store(ctx.kv_caches[0]):
            return None
        return meta

    def _decode_in_one_call(self, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        ctx = get_forward_context()
        cfg = self.config
        rope = self.layers[0].self_attn.rope
        h = self.layers[0].input_layernorm(x)  # x stays the residual stream
        args = (h, x, positions, ctx.slot_mapping, self._stack, self.norm.weight, ctx.kv_caches,
                rope.cos, rope.sin, meta.block_tables, meta.context_lens, meta.block_size,
                ctx.backend.scale, self.norm.eps, cfg.num_heads, cfg.num_kv_heads,
                torch.get_num_threads())
        sp = ctx.sparse
        quant = {"qweights": self._qstack} if self._qstack else {}
        if sp is None:
            return self.ops.decode_forward(*args, **quant)
        return self.ops.decode_forward_sparse(*args, sp.summaries, sp.topk, sp.dense_layers,
                                              sp.selected, sp.stats, **quant)


def _stack_weight(lin: Linear) -> torch.Tensor | None:
    """What decode_forward takes for this linear: its fp32 panels, or its codes as the native
    q4_linear (uint8) or q8_linear (int8, or uint8 with an offset) take them (d and z go in the
    call's qweights); None where it runs another kernel."""
    if lin._panels is not None:
        return lin._panels
    parts = lin._quant.stack_parts() if lin._quant is not None else None
    return parts[0] if parts else None
