"""Gemma 3's text decoder (HF's Gemma3ForCausalLM) over a flat batch of tokens, as llama.py's:
x is [T, hidden], attention reaches the paged KV cache through the forward context.

Where it differs from the Llama family (transformers' modeling_gemma3.py, the reference):
- the embedding is scaled by sqrt(hidden_size), the factor rounded to the compute dtype;
- every RMSNorm scales by (1 + w), in fp32, rounded once (the checkpoints store w);
- each layer norms the attention's and the MLP's outputs as well as their inputs, and q and k
  per head before RoPE;
- the MLP is GeGLU (GELU's tanh approximation), scores are scaled by query_pre_attn_scalar**-0.5;
- the windowed layers (five of every six) attend to the last sliding_window positions with
  RoPE base rope_local_base_freq; the others to the whole context with rope_theta and the
  model's rope scaling.

    layer:  h = x + post_attn_norm(attn(input_norm(x)))
            x = h + post_ffw_norm(mlp(pre_ffw_norm(h)))

Decode steps run layer by layer (llama.py's one-call decode stack, csrc/decode_forward.cpp,
knows neither the extra norms nor the windows); with the native ops the linears and the fused
add+norm run natively.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.engine.config import ModelConfig
from tierserve.engine.worker.models.layers import (Linear, RMSNorm, RotaryEmbedding, fill,
                                                   linear_sources,
                                                   rope_attention_factor, rope_inv_freq)
from tierserve.kernels.context import get_forward_context

ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
               "silu": F.silu}
"""The MLP gate activations (ModelConfig.hidden_act), by HF's names."""


class GemmaRMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 and rounded once (HF's Gemma3RMSNorm);
    with a residual stream, RMSNorm's fused form (residual += x, then the norm) with 1 + w as
    its scale."""

    _scale: torch.Tensor | None = None
    """1 + w in fp32 (HF computes it per call; the same bits), made on first use after the
    weights loaded (Gemma3ForCausalLM.load_weights clears it)."""

    @property
    def scale(self) -> torch.Tensor:
        if self._scale is None or self._scale.device != self.weight.device:
            self._scale = 1.0 + self.weight.float()
        return self._scale

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        if x.dtype == torch.float32 and self.ops is not None:  # add_rms_norm_'s steps
            return self.ops.rms_norm(x, scale, self.eps)
        if x.dtype == torch.float32:  # one fused op, HF's bits (layers.RMSNorm)
            return F.rms_norm(x, self.weight.shape, scale, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.window = cfg.window(layer)
        """This layer's sliding window (None: the whole context), handed to the backend."""
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rope = rope

    ops = None
    """The native extension on CPU fp32 (set by use_native_ops): q and k are normed in place in
    the projection's rows, then rope_store_kv_ rotates them and stores K/V in one pass (llama.py's
    fused path, after the norms)."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer]
        flat = self.qkv_proj(x)
        qkv = flat.view(x.shape[0], self.h + 2 * self.hkv, self.d)
        q, k, v = qkv.split([self.h, self.hkv, self.hkv], dim=1)
        if self.ops is not None and ctx.backend.plain_kv_store(cache):
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
            self.ops.rope_store_kv_(flat, positions, self.rope.cos, self.rope.sin, cache,
                                    ctx.slot_mapping, self.h, self.hkv)
        else:
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)  # [T, H + Hkv, D]
            q, k = self.rope(positions, qk).split([self.h, self.hkv], dim=1)
            ctx.backend.write_kv(k, v, cache, ctx.slot_mapping)
        return self.o_proj(ctx.backend.forward(q, k, v, cache, ctx.metadata, self.window))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer, rope)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream kept apart (llama.py's form): returns (the normed MLP output, the
        residual before it)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None):
        super().__init__()
        if tp is not None:  # build.py refuses it first (tp/shard.py's check_shardable)
            raise ValueError("gemma3 has no tensor-parallel path")
        self.config = cfg
        self.tp = None
        # Left uninitialized for load_weights, as llama.py's.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        whole, local = _ropes(cfg, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, whole if cfg.window(i) is None else local)
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.ops = None
        """The native extension, set by use_native_ops()."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        # HF's normalizer: sqrt(hidden) as an fp32 tensor, rounded to the compute dtype
        x = x * torch.tensor(self.config.hidden_size ** 0.5, device=x.device).to(x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only for the rows that are sampled: [N, hidden] -> [N, vocab] fp32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Mapping[str, torch.Tensor],
                     skip: frozenset[str] = frozenset()) -> None:
        """HF-named tensors in, q/k/v and gate/up fused (llama.py's load_weights); the norms'
        w as HF stores them (a GGUF's 1 + w is undone by the loader)."""
        for lin, names in self.linear_sources():
            fill(lin.weight, weights, names, skip)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            if attn.qkv_proj.bias is not None:
                fill(attn.qkv_proj.bias, weights, [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            for name, norm in _norms(layer):
                fill(norm.weight, weights, [p + name + ".weight"])
        fill(self.embed_tokens.weight, weights, ["model.embed_tokens.weight"], skip)
        fill(self.norm.weight, weights, ["model.norm.weight"])
        tied = self.config.tie_word_embeddings or "lm_head.weight" not in weights
        fill(self.lm_head.weight, weights,
             ["model.embed_tokens.weight" if tied else "lm_head.weight"], skip)
        for m in self.modules():  # the norms' 1 + w follow the new weights
            if isinstance(m, GemmaRMSNorm):
                m._scale = None

    def linear_sources(self) -> list[tuple[Linear, list[str]]]:
        """Each linear layer with the checkpoint tensors it fuses (quantization packs those)."""
        return linear_sources(self.layers)

    def use_bf16_prefill(self, min_rows: int) -> None:
        """Batches of at least min_rows tokens run the decoder layers' linears in bf16
        (Linear.bf16_min_rows; 0: off), as llama.py's."""
        for layer in self.layers:
            for lin in layer.modules():
                if isinstance(lin, Linear):
                    lin.bf16_min_rows = min_rows

    def use_native_ops(self, ops, batch_hint: int = 64) -> None:
        """The linears, the norms and the fused rope + K/V store through the native extension
        (CPU, fp32), or back to torch (None); the linear weights are packed again for the new
        path. Every step runs layer by layer (no one-call decode stack for this family yet)."""
        self.ops = ops
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, Linear)):
                m.ops = ops
            if isinstance(m, Linear):
                m.pack(batch_hint)


def _ropes(cfg: ModelConfig, max_positions: int) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """(the whole-context layers' RoPE: rope_theta and the model's scaling, the windowed
    layers': rope_local_base_freq unscaled). Tables on the host in fp32, as llama.py's."""
    mpe = cfg.max_position_embeddings
    local_base = cfg.rope_local_base_freq or cfg.rope_theta
    with torch.device("cpu"):
        whole = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, mpe),
                                max_positions, rope_attention_factor(cfg.rope_scaling, mpe))
        local = RotaryEmbedding(rope_inv_freq(cfg.head_dim, local_base, None), max_positions)
    return whole, local


def _norms(layer: DecoderLayer) -> list[tuple[str, GemmaRMSNorm]]:
    """A layer's norms under their HF names (relative to model.layers.N.)."""
    return [("input_layernorm", layer.input_layernorm),
            ("post_attention_layernorm", layer.post_attention_layernorm),
            ("pre_feedforward_layernorm", layer.pre_feedforward_layernorm),
            ("post_feedforward_layernorm", layer.post_feedforward_layernorm),
            ("self_attn.q_norm", layer.self_attn.q_norm),
            ("self_attn.k_norm", layer.self_attn.k_norm)]
