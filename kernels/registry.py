"""Attention backends by name, imported lazily."""

from __future__ import annotations

from tierserve._lazy import lazy_class
from tierserve.kernels.base import AttentionBackend

BACKENDS: dict[str, str] = {
    "torch_sdpa": "tierserve.kernels.torch_sdpa:TorchSdpaBackend",
    "torch_ref": "tierserve.kernels.torch_ref:TorchRefBackend",
    "cpu_native": "tierserve.kernels.cpu_native:CpuNativeBackend",
    "triton": "tierserve.kernels.triton_attn:TritonBackend",
    "flashinfer": "tierserve.kernels.flashinfer_attn:FlashInferBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    return lazy_class(BACKENDS, name, "attention backend")


def create_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                   scale: float, **kwargs) -> AttentionBackend:
    """kwargs: kv_scale, device (see AttentionBackend)."""
    return backend_class(name)(num_heads, num_kv_heads, head_dim, scale, **kwargs)
