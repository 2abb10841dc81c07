"""GGUF's simple block types (Q4_0, Q4_1, Q8_0) split into their fields and decoded with torch, to
the bit of the gguf package's `dequantize`, over a whole tensor at once.

The package decodes 16 rows at a time in numpy: 2.2 s of every load of the embedded model (210
Q4_1 tensors) on the 2-core box; one torch pass over all blocks takes 0.6 s, the same values
(tests/test_loaders.py compares them on random blocks and the embedded file). Other types still go
through the package.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

QK = 32
"""Weights per block in all three types."""
HEAD_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}
"""Bytes of fp16 scale (and Q4_1's fp16 minimum) before each block's codes."""
BLOCK_BYTES = {"Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2, "Q8_0": 2 + QK}


@dataclass(frozen=True)
class BlockFields:
    """One tensor's blocks, per weight row: w = d * code + m (Q4_1), d * code (Q8_0, codes
    -128..127) or d * (code - 8) (Q4_0, codes 0..15)."""

    codes: torch.Tensor
    """[rows, cols] uint8 (Q4_0, Q4_1) or int8 (Q8_0), in the weights' order."""
    d: torch.Tensor
    """[rows, cols / 32] fp32."""
    m: torch.Tensor | None
    """[rows, cols / 32] fp32 for Q4_1, else None."""


def block_fields(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> BlockFields:
    """The fields of a tensor of numpy shape `shape` (rows first) whose bytes are `raw`."""
    head = HEAD_BYTES[kind]
    cols = shape[-1]
    if cols % QK:
        raise ValueError(f"{kind} rows of {cols} weights are not whole blocks of {QK}")
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    b = _bytes(raw).reshape(rows, cols // QK, BLOCK_BYTES[kind])
    d = _fp16(b[..., 0:2])
    m = _fp16(b[..., 2:4]) if kind == "Q4_1" else None
    qs = b[..., head:]
    if kind == "Q8_0":
        codes = qs.contiguous().view(torch.int8)
    else:  # low nibbles: the block's first 16 weights, high nibbles: the last 16
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return BlockFields(codes.reshape(rows, cols), d, m)


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 weights of numpy shape `shape`, equal to gguf.quants.dequantize's: the same fp32
    operations in the same order (Q4_0: d * float(code - 8); Q4_1: d * code + m; Q8_0: code * d)."""
    f = block_fields(raw, kind, shape)
    rows, cols = f.codes.shape
    codes = f.codes.reshape(rows, cols // QK, QK)
    d = f.d.unsqueeze(-1)
    if kind == "Q4_0":
        out = d * (codes.to(torch.int8) - 8).float()
    elif kind == "Q4_1":
        out = d * codes.float() + f.m.unsqueeze(-1)
    else:
        out = codes.float() * d
    return out.reshape(shape)


def _bytes(raw: np.ndarray) -> torch.Tensor:
    """The bytes as a uint8 tensor, without a copy: a read-only view of the file's memory map
    (nothing here writes to it; torch warns about any non-writable array)."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.flags.writeable:
        return torch.from_numpy(flat)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(flat)


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves -> [...] fp32, widened by numpy as the gguf package
    widens them (torch's Half -> float turns a NaN past its last whole vector into 0x7fffffff)."""
    halves = two_bytes.contiguous().numpy().view(np.float16).astype(np.float32)
    return torch.from_numpy(halves).squeeze(-1)
