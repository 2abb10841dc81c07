"""Weight-only quantized linears (issue 31).

    mode        weights kept                              kernel (CPU)
    none        the serving dtype (GGUF blocks            the fp32 path (native panels)
                dequantized)
    gguf-exact  the file's Q4_0 / Q4_1 / Q8_0 blocks, as  the native q4_linear / q8_linear, or
                they are: w = q d + m (Q4_1), (q - 8) d   torch's _weight_int4pack_mm_for_cpu
                (Q4_0), q d (Q8_0)                        (group 32) without the extension
    gguf        as gguf-exact (Q4 scales as fp16: the     Q4: the native q4i8_linear, activations
                file's own)                               rounded to int8 per block of 32 and
                                                          integer dot products (llama.cpp's
                                                          numerics, issue 44); Q8_0: as
                                                          gguf-exact
    int4        any fp32 weight, 4 bits, groups of 32,    as gguf-exact's Q4
                asymmetric (min/max per group)
    int8        any fp32 weight, 8 bits in groups of 32   as gguf-exact's Q8_0
                (symmetric, as GGUF's Q8_0)

On CUDA (bfloat16, compute capability 8.0 or newer) the same groups run on torch's tinygemm
kernel, `_weight_int4pack_mm` (codes two to a byte, `_convert_weight_to_int4pack`); 8-bit groups
as two such 4-bit planes.

torch's int4 packing is private and not one layout: on the CPU it follows the level torch runs at
(AVX-512, AVX2 and the default level each order the rows differently; ATEN_CPU_CAPABILITY picks
one). Nothing here reads it back: a weight on torch's packing that is read as well as multiplied
(the embedding's lookups; the linears --prefill-bf16 decodes) keeps its codes in a plain layout
beside it (`readable`: 1 byte a weight for 8-bit groups, 0.5 for 4-bit), counted in its bytes.
The native panels are our own layout and are read as they are.

The native kernels (kernels/csrc/quant_linear.cpp) decode the weights to fp32 as they use them
and multiply in the fp32 path's own order, so `gguf-exact` gives what `none` gives on the same
file, to the bit; they run in the one-call decode stack too (decode_forward.cpp takes their codes
and scales). torch's vectorised paths take bf16 activations (fp32 falls to a scalar loop, ~25x
slower), so there a linear rounds its input to bf16 and returns fp32. The embedding and LM head
are 8-bit groups of 32 (the file's Q8_0 blocks in gguf mode); a tied embedding decodes the rows
it takes from the bytes the head reads on the panels, from its kept codes on torch's planes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import torch

from tierserve.engine.config import GGUF_MODES, QUANTIZATIONS
from tierserve.engine.worker.loaders.gguf_blocks import block_fields
from tierserve.engine.worker.loaders.gguf_kquants import CODE_GROUP_TYPES, code_groups

GROUP = 32
PANEL = 16
_INNER_K_TILES = 2


class QuantizationError(ValueError):
    """A weight the chosen quantization cannot take (names the tensor and its type)."""


@dataclass(frozen=True)
class Int4Groups:
    """4-bit codes with a scale and an offset per group of 32 along the input: w = q s + m."""

    codes: torch.Tensor
    """[out, in] int32 in 0..15."""
    scale: torch.Tensor
    """[out, in / 32] fp32."""
    offset: torch.Tensor
    """[out, in / 32] fp32 (Q4_1's m; Q4_0's -8d; int4's group minimum)."""

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Output rows stacked (q, k, v into one qkv projection)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("codes", "scale", "offset")))

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP, GROUP).float()
        return torch.addcmul(self.offset[..., None], q, self.scale[..., None]).view(n, k)


def _minmax_groups(w: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric groups of 32 along the input: each group's min and max map to codes 0 and top;
    returns (codes [out, in] int32, scale, min [out, in / 32])."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / top).clamp_min(1e-10)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, top).to(torch.int32)
    return codes.view(n, k), scale, lo


def quantize_int4(w: torch.Tensor) -> Int4Groups:
    """Asymmetric 4-bit groups of 32: each group's min and max map to codes 0 and 15."""
    return Int4Groups(*_minmax_groups(w, 15))


def gguf_q4_groups(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Groups:
    """A Q4_0 or Q4_1 tensor's blocks as Int4Groups, without re-quantizing (Q4_0's codes are
    offset by 8: w = d code - 8 d)."""
    f = block_fields(raw, kind, shape)
    offset = f.m if kind == "Q4_1" else -8 * f.d
    return Int4Groups(f.codes.to(torch.int32), f.d, offset)


@dataclass(frozen=True)
class Int8Groups:
    """8-bit codes with a scale per group of 32 along the input: w = q s (GGUF's Q8_0, q in
    -128..127), or with an offset, w = q s + m (q in 0..255; GGUF's 5- and 6-bit blocks, whose
    codes are 0..31 or 0..63). Q6_K's groups are 16 wide: the group is in / scale's columns."""

    q: torch.Tensor
    """[out, in] int32."""
    scale: torch.Tensor
    """[out, in / group] fp32."""
    offset: torch.Tensor | None = None
    """[out, in / group] fp32, or None (symmetric)."""

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def with_offset(self, group: int) -> Int8Groups:
        """The same weights with an offset (q + 128 where symmetric: w = s (q + 128) - 128 s,
        exact) and scales repeated to groups of `group` (16 from 32: each scale twice)."""
        q, s, m = self.q, self.scale, self.offset
        if m is None:
            q, m = q + 128, -128 * s
        rep = self.group // group
        return Int8Groups(q, s.repeat_interleave(rep, 1), m.repeat_interleave(rep, 1))

    @staticmethod
    def cat(parts: list[Int8Groups]) -> Int8Groups:
        """Output rows stacked; mixed parts in the offset form, at the narrowest group."""
        if all(p.offset is None and p.group == GROUP for p in parts):
            return Int8Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
        group = min(p.group for p in parts)
        parts = [p.with_offset(group) for p in parts]
        return Int8Groups(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("q", "scale", "offset")))


def quantize_int8_groups(w: torch.Tensor) -> Int8Groups:
    """Asymmetric 8-bit groups of 32: each group's min and max map to codes 0 and 255 (the
    symmetric form, absmax -> 127, agreed 97.7% against 100% on the embedded model)."""
    return Int8Groups(*_minmax_groups(w, 255))


def gguf_q8_groups(raw: np.ndarray, shape: tuple[int, int]) -> Int8Groups:
    """A Q8_0 tensor's blocks ([d fp16] + 32 int8 codes each) as Int8Groups, as stored."""
    f = block_fields(raw, "Q8_0", shape)
    return Int8Groups(f.codes.to(torch.int32), f.d)


def gguf_code_groups(raw: np.ndarray, kind: str, shape: tuple[int, int]
                     ) -> Int4Groups | Int8Groups:
    """A Q5_0, Q5_1, Q4_K, Q5_K or Q6_K tensor's blocks as they are (gguf_kquants.code_groups):
    Q4_K's 4-bit codes as Int4Groups (its per-32 scale d * sc and offset -dmin * m, exact in
    fp32), the others' 5- and 6-bit codes as Int8Groups with an offset."""
    g = code_groups(raw, kind, shape)
    if kind == "Q4_K":
        return Int4Groups(g.codes.to(torch.int32), g.d, g.z)
    return Int8Groups(g.codes.to(torch.int32), g.d, g.z)


def as_int8_groups(g: Int4Groups | Int8Groups) -> Int8Groups:
    """4-bit groups as 8-bit ones with an offset (the same weights; 8-bit codes hold 0..15)."""
    return g if isinstance(g, Int8Groups) else Int8Groups(g.codes, g.scale, g.offset)


class QuantWeight:
    """A linear layer's weight packed for its kernel; call it as (x, the native extension or
    None, bias or None) -> x W^T + b."""

    device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def __call__(self, x: torch.Tensor, ops=None, bias=None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, ops=None, bf16: bool = False) -> torch.Tensor:
        """The weight as fp32 [out, in] (exactly the values the kernels multiply by), or rounded
        to bf16. On torch's packing only where the weight is `readable`."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """What it holds (weight_bytes counts these)."""
        raise NotImplementedError

    def stack_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(codes, d, z or None) as the native decode stack takes them (decode_forward.cpp's
        qweights), or None where this weight runs torch's kernel."""
        return None


def _panel_rows(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] zero-padded to whole panels of 16 rows, as [n / 16, 16, ...]."""
    pad = -t.shape[0] % PANEL
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.view(-1, PANEL, *t.shape[1:])


def _scales_in_panels(s: torch.Tensor) -> torch.Tensor:
    """[n, in / 32] -> [n / 16, in / 32, 16]: a block's scales for the panel's 16 rows together."""
    return _panel_rows(s.float()).transpose(1, 2).contiguous()


def _from_panels(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n / 16, X, 16] -> [n, X] (the first n rows)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def _inner_k_tiles(k: int) -> int:
    """tinygemm's k tiling on CUDA: the largest of 8, 4, 2 whose tile (16 of them) divides k."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise QuantizationError(f"an input width of {k} does not split into tinygemm's k tiles "
                            "(a multiple of 32); use none")


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[n, in] codes 0..15 -> [n, in / 2] uint8, column 2j in the low nibble, 2j + 1 in the high:
    our plain layout, kept beside torch's packing (which is not ours to read)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def _from_nibbles(p: torch.Tensor) -> torch.Tensor:
    """_nibbles undone: [n, in] int32."""
    return torch.stack([p & 15, p >> 4], -1).view(p.shape[0], -1).to(torch.int32)


def _unreadable(what: str) -> QuantizationError:
    return QuantizationError(
        f"{what} is held only in torch's int4 packing, a private layout that differs by the CPU "
        "level torch runs at; build it readable=True to keep its codes beside the packing")


def cuda_int4_operands(g: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA int4 kernel's operands before `_convert_weight_to_int4pack`: codes two to a byte,
    [out, in / 2] uint8 with the even column in the high nibble, and scales and zeros
    [in / 32, out, 2] bf16 of w = (q - 8) s + zero (tinygemm's form: zero = m + 8 s)."""
    c = g.codes.to(torch.uint8)
    pairs = ((c[:, 0::2] << 4) | c[:, 1::2]).contiguous()
    zero = g.offset + 8 * g.scale
    return pairs, torch.stack([g.scale.t(), zero.t()], -1).contiguous().to(torch.bfloat16)


class Int4Weight(QuantWeight):
    """Two kernels over the same groups: the native extension's q4_linear (panel order, below;
    the weights decoded to fp32 as they are used, the fp32 path's order of arithmetic) when
    `ops` is given, else torch's int4pack kernel (bf16 activations). Each keeps its own packing,
    made on first use, so an engine holds one.

    Panel order (kernels/csrc/quant_linear.cpp): codes [n / 16, in / 32, 16, 16] uint8, byte
    (j, i) of panel p, block b holding row 16p + i's codes at 32b + j (low nibble) and
    32b + 16 + j (high); d and z (the offset) [n / 16, in / 32, 16] fp32.

    `readable`: on torch's packing, also keep the codes as _nibbles (`plain`, 0.5 bytes a weight)
    so that decode() works; the panels need nothing more."""

    def __init__(self, g: Int4Groups, native: bool = False, device=None, readable: bool = False):
        self.out_features = g.codes.shape[0]
        self.groups: Int4Groups | None = g
        self.device = torch.device(device or "cpu")
        self.native = native and self.device.type == "cpu"
        self.readable = readable
        self.codes = self.d = self.z = None
        self.packed = self.scales_zeros = self.plain = None
        self._pack()

    def _pack(self) -> None:
        g = self.groups
        if self.device.type == "cuda":  # tinygemm (module docstring)
            n, k = g.codes.shape
            if n % 8:
                raise QuantizationError(f"{n} output rows: torch's CUDA int4 kernel takes a "
                                        "multiple of 8; use none")
            pairs, sz = cuda_int4_operands(g)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(self.device),
                                                                     _inner_k_tiles(k))
            self.scales_zeros = sz.to(self.device)
        elif self.native:
            n, k = g.codes.shape
            c = _panel_rows(g.codes.to(torch.uint8)).view(-1, PANEL, k // GROUP, 2, 16)
            c = c.permute(0, 2, 4, 1, 3)  # [panels, blocks, j, i, half]
            self.codes = (c[..., 0] | (c[..., 1] << 4)).contiguous()
            self.d, self.z = _scales_in_panels(g.scale), _scales_in_panels(g.offset)
        else:  # torch's kernel: w = (q - 8) s + zero
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.codes,
                                                                            _INNER_K_TILES)
            zero = g.offset + 8 * g.scale
            self.scales_zeros = torch.stack([g.scale.t(), zero.t()], -1).contiguous().to(
                torch.bfloat16)
        if self.packed is not None and self.readable:
            self.plain = _nibbles(g.codes).to(self.device)
        self.groups = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales_zeros, self.plain, self.codes, self.d,
                            self.z) if t is not None]

    def stack_parts(self):
        return None if self.codes is None else (self.codes, self.d, self.z)

    def unpack(self) -> Int4Groups:
        """The groups back from the panel order."""
        n = self.out_features
        c = self.codes.permute(0, 3, 1, 2)  # [panels, i, blocks, j]
        codes = torch.stack([c & 15, c >> 4], 3).reshape(-1, self.codes.shape[1] * GROUP)[:n]
        return Int4Groups(codes.int(), _from_panels(self.d, n), _from_panels(self.z, n))

    def decode(self, ops=None, bf16: bool = False) -> torch.Tensor:
        if self.codes is not None and ops is not None:
            return ops.q4_decode(self.codes, self.d, self.z, self.out_features, bf16)
        w = self.unpack().dequantize() if self.codes is not None else self._plain_weights()
        return w.to(torch.bfloat16) if bf16 else w

    def _plain_weights(self) -> torch.Tensor:
        """The kept codes with the scales and zeros torch's kernel reads (bf16):
        w = (q - 8) s + zero."""
        if self.plain is None:
            raise _unreadable("this int4 weight")
        n = self.out_features
        q = _from_nibbles(self.plain).float().view(n, -1, GROUP)
        sz = self.scales_zeros.float()  # [in / 32, n, 2]
        scale, zero = sz[..., 0].t(), sz[..., 1].t()
        return ((q - 8) * scale[..., None] + zero[..., None]).view(n, -1)

    def __call__(self, x: torch.Tensor, ops=None, bias=None) -> torch.Tensor:
        if self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.packed,
                                                   GROUP, self.scales_zeros).to(x.dtype)
            return y if bias is None else y + bias
        if self.codes is not None and ops is not None:
            return ops.q4_linear(x.float(), self.codes, self.d, self.z, self.out_features, bias)
        if self.packed is None:  # the native path was turned off: torch's packing, once
            self.groups, self.native = self.unpack(), False
            self.codes = self.d = self.z = None
            self._pack()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                        self.scales_zeros).float()
        return y if bias is None else y + bias


_UNIT = 320
"""Bytes of a q4i8 unit: 16 rows x 32 weights (two halves of 8 rows: 8 fp16 d, 8 fp16 m, 128
bytes of codes)."""


def pack_q4_dot(g: Int4Groups) -> torch.Tensor:
    """Int4Groups in q4i8_linear's layout (kernels/csrc/q4_int8.cpp): [ceil(n / 16), in / 32 *
    320] uint8. Rows go 16 to a group; a group's blocks of 32 follow one another as units, and
    a unit holds two halves of 8 rows: their d (fp16), their m (fp16), then 4 vectors of 32
    bytes, byte 4r + t of vector v holding row r's code at k = 4v + t (low nibble) and at
    k = 16 + 4v + t (high): one 32-byte load is 8 rows x 4 consecutive k, what maddubs takes."""
    n, k = g.codes.shape
    kb = k // GROUP
    q = _panel_rows(g.codes.to(torch.uint8)).view(-1, 2, 8, kb, 2, 4, 4)  # [G, h, r, b, hi, v, t]
    codes = (q[..., 0, :, :] | (q[..., 1, :, :] << 4)).permute(0, 3, 1, 4, 2, 5)  # G b h v r t

    def halves(s: torch.Tensor) -> torch.Tensor:  # [n, kb] -> [G, b, h, 16] bytes of 8 fp16
        h = _panel_rows(s.to(torch.float16)).view(-1, 2, 8, kb).permute(0, 3, 1, 2).contiguous()
        return h.view(torch.uint8).view(*h.shape[:3], 16)

    units = torch.cat([halves(g.scale), halves(g.offset),
                       codes.reshape(*codes.shape[:3], 128)], -1)
    return units.reshape(units.shape[0], kb * _UNIT).contiguous()


def unpack_q4_dot(packed: torch.Tensor, n: int) -> Int4Groups:
    """pack_q4_dot undone (the scales as the fp16 values kept)."""
    u = packed.view(packed.shape[0], -1, 2, _UNIT // 2)  # [G, b, h, 160]
    kb = u.shape[1]

    def scales(a: int) -> torch.Tensor:
        h = u[..., a:a + 16].contiguous().view(torch.float16).float()  # [G, b, h, 8]
        return h.permute(0, 2, 3, 1).reshape(-1, kb)[:n]

    c = u[..., 32:].reshape(*u.shape[:3], 4, 8, 4).permute(0, 2, 4, 1, 3, 5)  # [G, h, r, b, v, t]
    q = torch.stack([c & 15, c >> 4], -3).reshape(-1, kb * GROUP)[:n]  # k = 16 hi + 4v + t
    return Int4Groups(q.to(torch.int32), scales(0), scales(16))


class Int4DotWeight(QuantWeight):
    """4-bit groups for the native q4i8_linear (issue 44): each call rounds its input to int8
    per row and block of 32 (scale amax / 127, as llama.cpp's Q8_1) and takes integer dot
    products, one float multiply per block, so the result differs from the fp32 path's by that
    rounding (docs/quantization.md has the measured quality). A row's result does not depend on
    the batch. Held as pack_q4_dot's layout alone: d and m as fp16, which a GGUF's Q4_0 / Q4_1
    blocks are. Without the extension: the decoded weights and torch's matmul."""

    native = True

    def __init__(self, g: Int4Groups):
        self.out_features, self.in_features = g.codes.shape
        self.packed = pack_q4_dot(g)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]

    def stack_parts(self):
        return (self.packed, None, None)

    def decode(self, ops=None, bf16: bool = False) -> torch.Tensor:
        w = unpack_q4_dot(self.packed, self.out_features).dequantize()
        return w.to(torch.bfloat16) if bf16 else w

    def __call__(self, x: torch.Tensor, ops=None, bias=None) -> torch.Tensor:
        if ops is not None:
            return ops.q4i8_linear(x.float().contiguous(), self.packed, self.out_features, bias)
        y = x.float() @ self.decode().t()
        return y if bias is None else y + bias[:self.out_features]


class Int8GroupWeight(QuantWeight):
    """Int8Groups (GGUF's Q8_0, or 8-bit groups of any weights) for two kernels: the native
    extension's q8_linear (codes in panel order [n / 16, in, 16] int8, d [n / 16, in / 32, 16];
    1.1 bytes a weight) when `native` and `ops` is given; else torch's int4 kernel as two 4-bit
    planes: with u = q + 128 = 16 hi + lo, w = s q = [16s hi - 128s] + [s lo], so x W^T is the sum
    of two int4 GEMMs (group 32). Either way the weights are exactly the groups'.

    rows(ids) (the embedding's lookups) and decode() read the panels where the weight has them,
    so a tied embedding costs nothing more there. torch's planes are not read back (their layout
    is private): a `readable` weight keeps u beside them (`plain`, [n, in] uint8, and the offset
    in fp32), read with the planes' own bf16 scales, so its rows are what the head multiplies
    by."""

    def __init__(self, g: Int8Groups, native: bool = False, device=None, readable: bool = False):
        self.out_features = g.q.shape[0]
        self.device = torch.device(device or "cpu")
        self.native = native and self.device.type == "cpu"
        self.readable = readable
        self.q8 = self.d = self.z = self.hi = self.lo = self.offset = self.plain = None
        if self.native:
            codes = g.q.to(torch.int8 if g.offset is None else torch.uint8)
            self.q8 = _panel_rows(codes).transpose(1, 2).contiguous()
            self.d = _scales_in_panels(g.scale)
            self.z = None if g.offset is None else _scales_in_panels(g.offset)
        else:
            self._planes(g)

    def _planes(self, g: Int8Groups) -> None:
        if g.group != GROUP:
            raise QuantizationError("8-bit groups of 16 (GGUF's Q6_K) need the native kernels "
                                    "(torch's int4 planes take groups of 32)")
        # u = 16 hi + lo: q + 128 (symmetric: w = s u - 128 s) or q (w = s u + m)
        u = g.q + 128 if g.offset is None else g.q
        s = g.scale
        self.hi = Int4Weight(Int4Groups(u >> 4, 16 * s, -128 * s if g.offset is None
                                        else g.offset), device=self.device)
        self.lo = Int4Weight(Int4Groups(u & 15, s, torch.zeros_like(s)), device=self.device)
        if self.readable:
            self.plain = u.to(torch.uint8).to(self.device)
            self.offset = None if g.offset is None else g.offset.to(self.device)
        self.q8 = self.d = self.z = None
        self.native = False

    def __call__(self, x: torch.Tensor, ops=None, bias=None) -> torch.Tensor:
        if self.q8 is not None and ops is not None:
            return ops.q8_linear(x.float(), self.q8, self.d, self.out_features, bias, self.z)
        if self.q8 is not None:  # the native path was turned off: torch's planes, once
            n = self.out_features
            self._planes(Int8Groups(_from_panels(self.q8, n).int(), _from_panels(self.d, n),
                                    None if self.z is None else _from_panels(self.z, n)))
        if self.device.type == "cuda":  # the planes' bf16 results added in fp32, rounded once
            y = (self.hi(x.float()) + self.lo(x.float())).to(x.dtype)
        else:
            y = self.hi(x) + self.lo(x)
        return y if bias is None else y + bias

    def tensors(self) -> list[torch.Tensor]:
        own = [t for t in (self.q8, self.d, self.z, self.plain, self.offset) if t is not None]
        return own + (self.hi.tensors() + self.lo.tensors() if self.hi is not None else [])

    def stack_parts(self):
        return None if self.q8 is None else (self.q8, self.d, self.z)

    def decode(self, ops=None, bf16: bool = False) -> torch.Tensor:
        if self.q8 is not None and ops is not None:
            return ops.q8_decode(self.q8, self.d, self.out_features, self.z, bf16)
        w = self.rows(torch.arange(self.out_features, device=self.device))
        return w.to(torch.bfloat16) if bf16 else w

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids`, [n, in] fp32: the values its kernel multiplies by."""
        ids = ids.long()
        if self.q8 is not None:
            group = self.q8.shape[1] // self.d.shape[1]  # 32, or 16 (Q6_K)
            q = self.q8[ids // PANEL, :, ids % PANEL].float().view(len(ids), -1, group)
            d = self.d[ids // PANEL, :, ids % PANEL][..., None]
            if self.z is None:
                return (q * d).view(len(ids), -1)
            z = self.z[ids // PANEL, :, ids % PANEL][..., None]
            return torch.addcmul(z, q, d).view(len(ids), -1)
        if self.plain is None:
            raise _unreadable("this 8-bit weight")
        u = self.plain[ids].float().view(len(ids), -1, GROUP)
        scale = self.lo.scales_zeros[:, ids, 0].t().float()[..., None]  # [n, in / 32, 1]
        if self.offset is None:
            return ((u - 128) * scale).view(len(ids), -1)
        return torch.addcmul(self.offset[ids][..., None], u, scale).view(len(ids), -1)


def check_mode(mode: str) -> str:
    if mode not in QUANTIZATIONS:
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                                f"got {mode!r}")
    return mode


def resolve_quantization(mode: str, device_type: str, dtype: str, has_q4_blocks: bool,
                         native: bool = True, capability: tuple[int, int] | None = None,
                         int8_dot: bool = False) -> str:
    """--quantization as it will run: auto keeps a GGUF's blocks on the CPU in float32 where
    every decoder linear has blocks the kernels take (has_q4_blocks: quant.gguf_covers) and the
    native kernels are built: as gguf (int8 activations, integer dot products) where the CPU
    runs q4i8_linear's vector path (`int8_dot`: AVX2, FMA and F16C; 3.2x fp32's decode speed on
    an AVX2 EPYC, 96.6% top-1 agreement), else as gguf-exact (the fp32 path's bits from a fifth
    of the bytes); else none. An explicit mode runs on the CPU in float32, or on CUDA in
    bfloat16 with compute capability 8.0 or newer (torch's tinygemm int4 kernel; `capability`:
    the GPU's)."""
    check_mode(mode)
    here = device_type == "cpu" and dtype == "float32"
    if mode == "auto":
        if not (here and has_q4_blocks and native):
            return "none"
        return "gguf" if int8_dot else "gguf-exact"
    if mode == "none" or here:
        return mode
    if device_type != "cuda" or dtype != "bfloat16":
        raise QuantizationError(f"quantization {mode} runs on the CPU with dtype float32 or on "
                                f"CUDA with bfloat16, not {device_type} with {dtype}; use none")
    if capability is not None and capability < (8, 0):
        raise QuantizationError(f"quantization {mode} on CUDA needs compute capability 8.0 or "
                                f"newer (torch's int4 kernel); this GPU has "
                                f"{capability[0]}.{capability[1]}: use none")
    return mode


KERNEL_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", *CODE_GROUP_TYPES)
"""GGUF block types the native kernels take as they are (gguf modes); others are dequantized."""


def blocks_to_groups(b) -> Int4Groups | Int8Groups:
    """A loader's QuantBlocks decoded, with llama.cpp's RoPE row order undone like the fp32
    copy's (rows move with their blocks: the groups run along the input)."""
    from tierserve.engine.worker.loaders.gguf_loader import unpermute_rope

    if b.kind in CODE_GROUP_TYPES:
        g = gguf_code_groups(b.raw, b.kind, b.shape)
    elif b.kind == "Q8_0":
        g = gguf_q8_groups(b.raw, b.shape)
    else:
        g = gguf_q4_groups(b.raw, b.kind, b.shape)
    if b.rope_heads is None:
        return g
    return type(g)(*(None if t is None else torch.from_numpy(np.ascontiguousarray(
        unpermute_rope(t.numpy(), b.rope_heads))) for t in dataclasses.astuple(g)))


_LINEARS = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.[qkvo]|mlp\.(?:gate|up|down))_proj\.weight")


def gguf_covers(weights: dict, blocks: dict) -> bool:
    """Whether every decoder linear of the checkpoint has blocks the kernels take (a fused
    layer's parts may mix types: Gemma 3's Q4_K_M has Q5_0 q and k beside a Q8_0 v): what
    `auto` needs to keep a GGUF's own bits."""
    return gguf_uncovered(weights, blocks) is None and any(map(_LINEARS.fullmatch, weights))


def gguf_uncovered(weights: dict, blocks: dict) -> str | None:
    """The first decoder linear whose type the kernels do not take, as 'name (TYPE)', or None."""
    for name in weights:
        if _LINEARS.fullmatch(name) is None:
            continue
        kind = blocks[name].kind if name in blocks else "not block-quantized"
        if kind not in KERNEL_BLOCK_TYPES:
            return f"{name} ({kind})"
    return None


def gguf_weight(names: list[str], blocks: dict, native: bool = False, device=None,
                readable: bool = False, dot: bool = False) -> QuantWeight:
    """The file's own blocks of these tensors (fused along the output), on their kernel (`dot`:
    Q4 blocks on q4i8_linear, int8 activations)."""
    missing = [n for n in names if n not in blocks or blocks[n].kind not in KERNEL_BLOCK_TYPES]
    if missing:
        raise QuantizationError(f"quantization gguf: tensor {missing[0]} is not one of "
                                f"{', '.join(KERNEL_BLOCK_TYPES)} in this file (use int4, int8 "
                                "or none)")
    kinds = {blocks[n].kind for n in names}
    groups = [blocks_to_groups(blocks[n]) for n in names]
    cpu = native and torch.device(device or "cpu").type == "cpu"
    if kinds <= {"Q4_0", "Q4_1"} and dot and cpu:
        return Int4DotWeight(Int4Groups.cat(groups))
    if kinds <= {"Q4_0", "Q4_1", "Q4_K"}:
        return Int4Weight(Int4Groups.cat(groups), native, device, readable)
    g = Int8Groups.cat([as_int8_groups(g) for g in groups])
    if g.group != GROUP and not cpu:
        raise QuantizationError(f"quantization gguf: {names[0]} is Q6_K (scales per 16 "
                                "weights), which only the CPU's native kernels take here "
                                "(use int4, int8 or none)")
    return Int8GroupWeight(g, native, device, readable)


class QuantEmbedding(torch.nn.Module):
    """An embedding table held as an Int8GroupWeight: each lookup decodes the rows it takes."""

    def __init__(self, weight: Int8GroupWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.table = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).to(self.dtype)


def taken_from_blocks(mode: str, model: torch.nn.Module, blocks: dict) -> frozenset[str]:
    """The checkpoint tensors quantize_model takes from the file's own blocks (gguf mode: every
    decoder linear's, and the embedding's and LM head's where they are Q8_0): the model need not
    load them in fp32 first."""
    if mode not in GGUF_MODES:
        return frozenset()
    names = {n for _, ns in model.linear_sources() for n in ns}
    names |= {n for n in ("model.embed_tokens.weight", "lm_head.weight")
              if n in blocks and blocks[n].kind in TABLE_BLOCK_TYPES}
    return frozenset(n for n in names if n in blocks)


def quantize_model(model: torch.nn.Module, mode: str, blocks: dict,
                   native: bool = False, device=None,
                   dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Swap the model's linear weights (and its embedding and LM head) for quantized ones, in
    place; returns which kernel each kind of layer runs (for the start-up log and /v1/backends).

    The model lists its linears with the source tensor names each one fuses
    (`linear_sources()`); in gguf mode every name must have Q4 blocks, or the start stops with
    the tensor named. The weights that are read as well as multiplied are made `readable`: the
    embedding (its lookups) and, under --prefill-bf16 (set before this), the linears it decodes."""
    kinds: dict[str, str] = {}
    for lin, names in model.linear_sources():
        readable = lin.bf16_min_rows > 0
        if mode in GGUF_MODES:
            lin.quantize(gguf_weight(names, blocks, native, device, readable,
                                     dot=mode == "gguf" and not readable))
        elif mode == "int4":
            lin.quantize(Int4Weight(quantize_int4(lin.weight.detach()), native, device,
                                    readable))
        else:
            lin.quantize(Int8GroupWeight(quantize_int8_groups(lin.weight.detach()), native,
                                         device, readable))
        q = lin._quant
        kinds[type(q).__name__] = _kernel(q)
    embed = table_weight(mode, "model.embed_tokens.weight", model.embed_tokens.weight, blocks, native,
                   device, readable=True)
    head = embed if model.config.tie_word_embeddings else table_weight(
        mode, "lm_head.weight", model.lm_head.weight, blocks, native, device)
    model.lm_head.quantize(head)
    model.embed_tokens = QuantEmbedding(embed, dtype)
    tied = "" if head is not embed else (" (tied: the embedding reads the same bytes)"
                                         if head.q8 is not None else
                                         " (tied: the embedding reads a copy of its 8-bit codes)")
    kinds["lm_head"] = _kernel(head) + tied
    return kinds


_ROWS = ("; up to 8 rows (4 without AVX-512) decoded k by k into registers, more rows decoded "
         "panel by panel into the fp32 GEMM tiles")
_NATIVE_INT4 = ("int4 groups of 32 (native q4_linear: decoded to fp32 as used, the fp32 path's "
                "order of arithmetic" + _ROWS + ")")
_NATIVE_INT8 = ("8-bit codes in groups of 32 or 16 (native q8_linear: decoded to fp32 as used, "
                "the fp32 path's order of arithmetic" + _ROWS + ")")
_KERNELS: dict[type, str] = {
    Int4Weight: "int4 groups of 32 (_weight_int4pack_mm_for_cpu, bf16 activations)",
    Int8GroupWeight: "int8 groups of 32 (two int4 planes, bf16 activations)"}


_NATIVE_DOT = ("int4 groups of 32 (native q4i8_linear: activations rounded to int8 per block "
               "of 32, integer dot products, at every row count: 4 rows of x a pass over "
               "L1-sized runs of weights; bench/int8_dot.py measured it 1.7-2.1x the exact "
               "kernel from 1 to 512 rows on an AVX2 EPYC)")


def _kernel(q: QuantWeight) -> str:
    if isinstance(q, Int4DotWeight):
        return _NATIVE_DOT
    if q.device.type == "cuda":
        return ("int4 groups of 32 (_weight_int4pack_mm, CUDA tinygemm)"
                if isinstance(q, Int4Weight) else
                "int8 groups of 32 (two int4 planes on _weight_int4pack_mm, CUDA)")
    if getattr(q, "native", False):
        return _NATIVE_INT8 if isinstance(q, Int8GroupWeight) else _NATIVE_INT4
    return _KERNELS[type(q)]


def table_weight(mode: str, name: str, weight: torch.Tensor, blocks: dict, native: bool,
           device=None, readable: bool = False) -> Int8GroupWeight:
    """The embedding (and LM head): 8-bit groups of 32 (the file's own Q8_0 blocks in gguf mode
    when it has them); one scale per row lost too much: 95% top-1 agreement against 98.7%."""
    b = blocks.get(name) if mode in GGUF_MODES else None
    if b is not None and b.kind in TABLE_BLOCK_TYPES:
        g = as_int8_groups(blocks_to_groups(b))
    else:
        g = quantize_int8_groups(weight.detach())
    return Int8GroupWeight(g, native, device, readable)


TABLE_BLOCK_TYPES = ("Q8_0", *CODE_GROUP_TYPES)
"""Embedding / LM head blocks kept as they are in gguf modes (as 8-bit codes); others are
quantized again to 8-bit groups of 32 from their fp32 values."""


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights hold, quantized or not (each tensor counted once)."""
    seen, total = set(), 0
    tensors = [p for p in model.parameters()]
    for m in model.modules():
        w = getattr(m, "_quant", None) or getattr(m, "table", None)
        if isinstance(w, QuantWeight):
            tensors += w.tensors()
        panels = getattr(m, "_panels", None)  # fp32 linears' native panels: their only copy
        if panels is not None and not m.weight.numel():
            tensors.append(panels)
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
