"""GGUF's 5-bit block types (Q5_0, Q5_1) and its K-quant super-block types (Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K) split into their fields and decoded with torch over a whole tensor at once, to the bit
of the gguf package's `dequantize` (tests/test_gguf_kquants.py compares them on random blocks).

The package decodes these in numpy, 16 rows at a time: a [2048, 2048] Q4_K tensor in about
45 ms, a Q6_K one in 28 ms on the 2-core box, 14 and 15 ms here (measured while the box was
busy). Each type's codes are unpacked as uint8 (or int8) weights in their order, each
sub-block's scale (and minimum) is computed in fp32 as the package computes it, and the weights
are the same fp32 operations in the same order: every value is an exact small integer or an fp16
widened to fp32, so one rounding per operation gives the same bits (NaNs included, see _half and
_scaled). Nothing here makes an int64 or fp64 copy of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierserve.engine.worker.loaders.gguf_blocks import _bytes, _fp16

QK_K = 256
"""Weights per super-block of the K-quant types."""
BLOCK_SIZE = {"Q5_0": 32, "Q5_1": 32, "Q2_K": QK_K, "Q3_K": QK_K, "Q4_K": QK_K, "Q5_K": QK_K,
              "Q6_K": QK_K}
"""Weights per block of each type."""
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176,
               "Q6_K": 210}
"""Bytes per block of each type (gguf's GGML_QUANT_SIZES)."""
KQUANT_TYPES = tuple(BLOCK_BYTES)
"""The types this module decodes."""


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 weights of numpy shape `shape` (rows first) whose bytes are `raw` (uint8, as gguf's
    reader gives them, a read-only memory map included), equal to gguf.quants.dequantize's."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{kind} is not one of the types gguf_kquants decodes ({KQUANT_TYPES})")
    size, cols = BLOCK_SIZE[kind], shape[-1] if shape else 0
    if not shape or cols % size:
        raise ValueError(f"{kind} rows of {cols} weights are not whole blocks of {size}")
    n_blocks = int(np.prod(shape)) // size
    b = _bytes(raw)
    if b.numel() != n_blocks * BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} tensor of shape {tuple(shape)} needs "
                         f"{n_blocks * BLOCK_BYTES[kind]} bytes, not {b.numel()}")
    return _DECODERS[kind](b.reshape(n_blocks, BLOCK_BYTES[kind])).reshape(shape)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[blocks, 2] uint8 little-endian halves -> [blocks, 1] fp32, widened as the gguf package
    widens them (gguf_blocks._fp16: numpy keeps a NaN's sign and payload, which the products
    below carry to the weights)."""
    return _fp16(two_bytes).unsqueeze(-1)


def _bits(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """[..., n] uint8 -> [..., len(shifts), n] uint8: (x >> shift) & mask for each shift."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)


def _scaled(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
            add: bool = False) -> torch.Tensor:
    """d * float(q), then + m (add) or - m, in fp32: q is [blocks, groups, n] integer codes, d
    and m [blocks, groups] fp32 (one scale and minimum per group of n weights). Where both
    d * q and m are NaN, numpy's sum keeps the first NaN, torch's vectorized add and sub (an FMA,
    m * +-1 + out) the second: the groups where both can be (d not finite, m NaN) get the
    products' NaNs back."""
    out = torch.mul(q, d.unsqueeze(-1))  # fp32: float(q) * d, without a float copy of q
    if m is not None:
        both = (m.isnan() & ~d.isfinite()).nonzero(as_tuple=True)
        first = out[both]
        out = out.add_(m.unsqueeze(-1)) if add else out.sub_(m.unsqueeze(-1))
        out[both] = torch.where(first.isnan(), first, out[both])
    return out.reshape(q.shape[0], -1)


def _five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1 codes 0..31, [blocks, 1, 32] uint8: qs's 16 bytes hold the low 4 bits (low
    nibbles: weights 0-15, high nibbles: 16-31), qh's 4 bytes the fifth (weight j: bit j % 8 of
    byte j // 8, i.e. bit j of a little-endian uint32)."""
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    high = _bits(qh, tuple(range(8)), 1).transpose(-1, -2).reshape(low.shape)
    return (low | (high << 4)).unsqueeze(1)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks of 32: fp16 scale d (bytes 0-1), the codes' high bits (2-5), their low
    nibbles (6-21); w = d * float(code - 16)."""
    q = _five_bit_codes(b[:, 2:6], b[:, 6:22]).view(torch.int8) - 16
    return _scaled(q, _half(b[:, 0:2]))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    """Q5_1 blocks of 32: fp16 scale d (bytes 0-1), fp16 minimum m (2-3), the codes' high bits
    (4-7), their low nibbles (8-23); w = d * code + m."""
    q = _five_bit_codes(b[:, 4:8], b[:, 8:24])
    return _scaled(q, _half(b[:, 0:2]), _half(b[:, 2:4]), add=True)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """Q2_K super-blocks: 16 bytes of 4-bit scale (low nibble) and minimum (high) for 16
    sub-blocks of 16 weights, 64 bytes of 2-bit codes (byte i of half h holds weights h*128 +
    s*32 + i at bits 2s), fp16 d, fp16 dmin; w = (d * scale) * code - (dmin * min)."""
    n, sc = b.shape[0], b[:, 0:16]
    dl = _half(b[:, 80:82]) * (sc & 0x0F).float()
    ml = _half(b[:, 82:84]) * (sc >> 4).float()
    q = _bits(b[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    return _scaled(q, dl, ml)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K super-blocks: 32 bytes of high-bit mask (weight j*32 + i: bit j of byte i), 64 bytes
    of low 2-bit codes (as Q2_K's), 12 bytes of 6-bit scales for 16 sub-blocks of 16 (the low 4
    bits of sub-block k < 8 in byte k's low nibble, of k >= 8 in byte k - 8's high nibble; the
    top 2 bits of sub-block 4s + k at bits 2s of byte 8 + k), fp16 d;
    w = (d * (scale - 32)) * (low - (4 if the mask bit is 0 else 0))."""
    n, sc = b.shape[0], b[:, 96:108]
    low = _bits(sc[:, 0:8], (0, 4), 0x0F).reshape(n, 16)
    high = _bits(sc[:, 8:12], (0, 2, 4, 6), 3).reshape(n, 16)
    scale = (low | (high << 4)).view(torch.int8) - 32
    dl = _half(b[:, 108:110]) * scale.float()
    ql = _bits(b[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    qh = _bits(b[:, 0:32], tuple(range(8)), 1).reshape(n, 16, 16) ^ 1
    return _scaled(ql.view(torch.int8) - (qh << 2).view(torch.int8), dl)


def _scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's fp32 d * scale and dmin * min, [blocks, 8], from fp16 d (bytes 0-1), fp16
    dmin (2-3) and 12 bytes (4-15) of 6-bit scales and minimums for 8 sub-blocks of 32: sub-block
    j < 4 has scale byte j & 63, min byte 4 + j & 63; j >= 4 has scale = low nibble of byte 4 + j
    with byte j - 4's top 2 bits above, min = high nibble of byte 4 + j with byte j's top 2."""
    s = b[:, 4:16]
    sd, sm, smd = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], dim=-1)
    mn = torch.cat([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], dim=-1)
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    return d * sc.float(), dmin * mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks: the scales of _scale_min (bytes 0-15), then 128 bytes of 4-bit codes
    (byte i of chunk c holds weights 64c + i in its low nibble, 64c + 32 + i in its high);
    w = (d * scale) * code - (dmin * min)."""
    d, m = _scale_min(b)
    q = _bits(b[:, 16:144].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
    return _scaled(q, d, m)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q5_K super-blocks: the scales of _scale_min (bytes 0-15), 32 bytes of fifth bits (weight
    j*32 + i: bit j of byte i), the low nibbles as Q4_K's (bytes 48-175);
    w = (d * scale) * code - (dmin * min)."""
    d, m = _scale_min(b)
    ql = _bits(b[:, 48:176].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
    qh = _bits(b[:, 16:48], tuple(range(8)), 1)
    return _scaled(ql | (qh << 4), d, m)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks: 128 bytes of low nibbles (byte i of half h: weights h*128 + i low,
    h*128 + 64 + i high, i < 64), 64 bytes of top 2 bits (byte i of half h: weight h*128 + s*32
    + i at bits 2s), 16 int8 scales for sub-blocks of 16, fp16 d;
    w = (d * scale) * (code - 32)."""
    n = b.shape[0]
    ql = _bits(b[:, 0:128].reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    d = _half(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()
    return _scaled(q.reshape(n, 16, 16), d)


@dataclass(frozen=True)
class CodeGroups:
    """A tensor's blocks as codes with an fp32 scale and offset per group: w = d * code + z
    equals gguf's value to the bit when taken as one FMA (d * code is exact in fp32: an fp16
    times a 6-bit scale times a code of at most 6 bits; z is exact too, so one rounding remains,
    numpy's own; for Q5_0 and Q6_K, where gguf computes d * (code - bias), d * code - bias * d
    is exact, but its zero is +0.0 where gguf's d * 0 is -0.0 for d < 0: equal values, and a dot
    product's sum of them is the same). What the native kernels hold (engine/worker/quant.py,
    kernels/csrc/quant_linear.cpp)."""

    codes: torch.Tensor
    """[rows, cols] uint8: 0..15 (Q4_K), 0..31 (Q5_0, Q5_1, Q5_K), 0..63 (Q6_K)."""
    d: torch.Tensor
    """[rows, cols / group] fp32."""
    z: torch.Tensor
    """[rows, cols / group] fp32."""
    group: int
    """Weights per d and z: 32, or 16 (Q6_K)."""


CODE_GROUP_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""The types code_groups takes (Q2_K and Q3_K: not yet; their tensors are dequantized)."""


def code_groups(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> CodeGroups:
    """A 2-D tensor's blocks (of a CODE_GROUP_TYPES type) as CodeGroups, not re-quantized."""
    if kind not in CODE_GROUP_TYPES:
        raise ValueError(f"{kind} blocks are not kept as codes (kept: {CODE_GROUP_TYPES})")
    rows, cols = shape
    b = _bytes(raw).reshape(-1, BLOCK_BYTES[kind])
    if kind in ("Q5_0", "Q5_1"):
        codes = _five_bit_codes(b[:, 2 + 2 * (kind == "Q5_1"):6 + 2 * (kind == "Q5_1")],
                                b[:, 6 + 2 * (kind == "Q5_1"):])
        d = _half(b[:, 0:2])
        z = -16 * d if kind == "Q5_0" else _half(b[:, 2:4])
    elif kind == "Q6_K":
        ql = _bits(b[:, 0:128].reshape(-1, 2, 64), (0, 4), 0x0F).reshape(-1, 8, 32)
        qh = _bits(b[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 8, 32)
        codes = ql | (qh << 4)
        d = _half(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()
        z = -32 * d
    else:
        d, m = _scale_min(b)
        codes = _bits(b[:, -128:].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
        if kind == "Q5_K":
            codes = codes | (_bits(b[:, 16:48], tuple(range(8)), 1) << 4)
        z = -m
    group = 16 if kind == "Q6_K" else 32
    return CodeGroups(codes.reshape(rows, cols), d.reshape(rows, cols // group),
                      z.reshape(rows, cols // group), group)


_DECODERS = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}
