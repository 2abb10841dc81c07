"""KV cache dtypes: names users write, the torch dtype stored, bytes per element, fp8 quantization.

| name       | stored as             | bytes | read back as                  |
|------------|-----------------------|-------|-------------------------------|
| auto       | the model dtype       | 2-4   | as stored                     |
| float32    | float32               | 4     | as stored                     |
| float16    | float16               | 2     | as stored                     |
| bfloat16   | bfloat16              | 2     | as stored                     |
| fp8_e4m3   | float8_e4m3fn         | 1     | stored * scale (one global)   |

fp8 stores x / scale saturated to +-448 (e4m3fn has no infinity); backends dequantize on read.
"""

from __future__ import annotations

import torch

ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
           "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
TORCH_KV = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "fp8_e4m3": torch.float8_e4m3fn}
KV_CHOICES = ("auto", *TORCH_KV)
FP8_MAX = 448.0
MODEL_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def canonical_kv_dtype(name: str, model_dtype: str | torch.dtype) -> str:
    """The concrete KV dtype name ('auto' becomes the model dtype); ValueError lists the valid."""
    name = ALIASES.get(name, name)
    if name == "auto":
        return model_dtype if isinstance(model_dtype, str) else MODEL_DTYPE_NAMES[model_dtype]
    if name not in TORCH_KV:
        raise ValueError(f"unknown kv_cache_dtype {name!r} (valid: {', '.join(KV_CHOICES)}, "
                         f"or {', '.join(ALIASES)})")
    return name


def kv_torch_dtype(name: str, model_dtype: str | torch.dtype) -> torch.dtype:
    return TORCH_KV[canonical_kv_dtype(name, model_dtype)]


def kv_elem_size(name: str, model_dtype: str | torch.dtype) -> int:
    """Bytes of one stored K or V element: what the KV budget and every tier pay per value."""
    return kv_torch_dtype(name, model_dtype).itemsize


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.to(dtype)
    return y if scale == 1.0 else y.mul_(scale)
