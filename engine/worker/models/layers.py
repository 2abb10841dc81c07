"""Building blocks shared by model files: linear layers with prepacked CPU weights, RMSNorm, RoPE."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). On the CPU in fp32 the weight is prepacked once: into 16-column panels for
    the native kernel (kernels/csrc/gemm.cpp) when the extension is in use, else for oneDNN (what
    torch.compile's freezing does). Both run the skinny decode GEMMs well above the default path.
    The native panels then hold the only copy (`weight` is emptied, dense_weight() unpacks them),
    so a loaded model keeps its fp32 weights once, not twice; oneDNN's layout cannot be read
    back, so with it (and under --prefill-bf16, which casts the dense weight) both stay."""

    ops = None
    """The native extension (see RMSNorm), set by the model's use_native_ops()."""

    bf16_min_rows = 0
    """Batches of at least this many rows multiply in bf16 through oneDNN (AMX's bf16 tiles):
    --prefill-bf16, set by the model's use_bf16_prefill(); 0 keeps every batch in fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None
        """oneDNN's prepacked weight."""
        self._panels: torch.Tensor | None = None
        """The native kernel's packed weight."""
        self._panel_bias: torch.Tensor | None = None
        """The bias zero-padded to whole 16-column panels, for the native kernel."""
        self._quant = None
        """A weight-only quantized weight (engine/worker/quant.py), in place of `weight`."""

    def quantize(self, weight) -> None:
        """Run on `weight` (a QuantWeight) from now on; the float weight is freed."""
        self._quant = weight
        self.weight.data = torch.empty(0)
        self._packed = self._panels = self._panel_bias = None

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, also when the native panels hold the only copy (unpacked then:
        a fresh tensor, for reading)."""
        if self._panels is None or self.weight.numel():
            return self.weight
        return unpack_panels(self._panels, self.out_features)

    def pack(self, batch_hint: int) -> None:
        """Prepack for whichever CPU kernel `ops` selects (one packed copy at a time)."""
        w = self.dense_weight().detach()
        self._packed = self._panels = self._panel_bias = None
        if self._quant is None and not self.weight.numel():  # unpacked from the old panels
            self.weight.data = w
        if self._quant is not None and self.ops is not None and self.bias is not None:
            # the native quantized kernels take the bias whole panels long, as fp32's
            self._panel_bias = F.pad(self.bias.detach(), (0, -self.bias.shape[0] % 16))
        if w.device.type != "cpu" or w.dtype != torch.float32 or self._quant is not None:
            return
        if self.ops is not None:
            self._panels = self.ops.pack_linear_weight(w)
            if self.bias is not None:
                self._panel_bias = F.pad(self.bias.detach(), (0, 16 * self._panels.shape[0]
                                                              - self.bias.shape[0]))
            if not self.bf16_min_rows:
                self.weight.data = torch.empty(0)  # the panels are the weight now
        elif torch.backends.mkldnn.is_available():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_min_rows and x.shape[0] >= self.bf16_min_rows:
            return self._bf16(x)
        if self._quant is not None:
            return self._quant(x, self.ops, self.bias)
        if self._panels is not None:
            return self.ops.packed_linear(x, self._panels, self.out_features, self._panel_bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


    def takes_bf16(self, rows: int) -> bool:
        """A batch of `rows` multiplies in bf16 (--prefill-bf16)."""
        return 0 < self.bf16_min_rows <= rows and self.bias is None

    def bf16_out(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in bf16 (x and W rounded to bf16, fp32 accumulation in oneDNN, the result rounded
        to bf16): for a consumer that rounds its input to bf16 anyway (the MLP's down_proj).
        Only where takes_bf16(rows)."""
        w = (self._quant.decode(self.ops, bf16=True) if self._quant is not None
             else self.dense_weight().to(torch.bfloat16))
        return F.linear(x.to(torch.bfloat16), w)

    def _bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) with x and W rounded to bf16 (quantized weights decoded first), fp32
        accumulation and result: oneDNN runs it on AMX's bf16 tiles where the CPU has them."""
        w = (self._quant.decode(self.ops, bf16=True) if self._quant is not None
             else self.dense_weight().to(torch.bfloat16))
        y = F.linear(x.to(torch.bfloat16), w).float()
        return y if self.bias is None else y + self.bias


def unpack_panels(panels: torch.Tensor, rows: int) -> torch.Tensor:
    """The native kernel's 16-column panels [P, K, 16] back to the [rows, K] weight."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:rows]


def fill(dst: torch.Tensor, weights: Mapping[str, torch.Tensor], names: list[str],
         skip: frozenset[str] = frozenset()) -> None:
    """Copy the named tensors into consecutive rows of `dst` (converting device and dtype as
    copy_ does), reading each once; no fused host copy is made. Nothing if all are in `skip`."""
    if all(n in skip for n in names):
        return
    at = 0
    with torch.no_grad():
        for name in names:
            t = weights[name]
            dst[at:at + t.shape[0]].copy_(t)
            at += t.shape[0]
    if at != dst.shape[0]:
        raise ValueError(f"{names}: {at} rows for a parameter of {dst.shape[0]}")


class RMSNorm(nn.Module):
    """norm(x), or with a residual stream: residual += x, then norm(residual) (vLLM's fused form).

    `ops` is the native extension (kernels/native.py) when the model runs in fp32 on the CPU: the
    residual form is then one in-place pass instead of an add, a norm and their thread wake-ups."""

    ops = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    @property
    def scale(self) -> torch.Tensor:
        """What the normed x is multiplied by: w (Gemma's subclass: 1 + w)."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        if self.ops is not None:
            self.ops.add_rms_norm_(x, residual, self.scale, self.eps)
            return x, residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; in fp32 it is bit-identical to HF's x * rsqrt(mean(x^2) + eps) * w.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The rope scaling types the model implements (HF's names); loaders reject any other."""


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default"


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  max_positions: int = 4096) -> torch.Tensor:
    """RoPE's inverse frequencies, scaled as transformers scales them (modeling_rope_utils):
    linear (position interpolation), llama3, yarn; `max_positions` is the model's
    max_position_embeddings (yarn's default original context)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        inv = _llama3_scale(inv, scaling)
    elif kind == "yarn":
        inv = _yarn_scale(head_dim, theta, scaling, max_positions)
    elif kind != "default":
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    return inv


def rope_attention_factor(scaling: dict | None, max_positions: int = 4096) -> float:
    """The factor yarn multiplies cos and sin by (1.0 for every other type)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_positions)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
    return _yarn_mscale(factor)


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, mid, scaled)


def _yarn_factor(s: dict, max_positions: int) -> float:
    if s.get("factor") is not None:
        return float(s["factor"])
    return max_positions / s.get("original_max_position_embeddings", max_positions)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scale(dim: int, base: float, s: dict, max_positions: int) -> torch.Tensor:
    """YaRN: interpolated frequencies (divided by the factor) for the slow dimensions,
    extrapolated (unchanged) for the fast ones, a linear ramp between the two."""
    factor = _yarn_factor(s, max_positions)
    old_ctx = s.get("original_max_position_embeddings") or max_positions
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table built once up to max_positions.

    rotate_half(x) * sin == roll(x, D/2) * sin_signed, where sin_signed negates the first half:
    one roll instead of slice, negate and concatenate, and bit-identical."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0):
        super().__init__()
        self.build(inv_freq, max_positions, attention_factor)

    def build(self, inv_freq: torch.Tensor, max_positions: int,
              attention_factor: float = 1.0) -> None:
        """attention_factor scales cos and sin (yarn's; 1.0 leaves them bit-identical)."""
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * attention_factor,
                             persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """positions [T]; qk [T, heads, D] (query and key heads side by side). With the native
        ops the model calls rope_store_kv_ instead: the same arithmetic, in place, K/V stored."""
        cos = self.cos[positions].unsqueeze(1).to(qk.dtype)
        sin = self.sin[positions].unsqueeze(1).to(qk.dtype)
        return qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin


def linear_sources(layers) -> list[tuple[Linear, list[str]]]:
    """Each decoder layer's linears (self_attn.qkv_proj and o_proj, mlp.gate_up_proj and
    down_proj) with the checkpoint tensors each fuses, in HF's names (quantization packs those)."""
    out = []
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        out += [(attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                (attn.o_proj, [p + "self_attn.o_proj.weight"]),
                (mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                (mlp.down_proj, [p + "mlp.down_proj.weight"])]
    return out
