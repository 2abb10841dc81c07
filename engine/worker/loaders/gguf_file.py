"""A GGUF file's metadata and tensor table, read with struct, and its tensor data as views of one
memory map (the gguf package's layout: quantized tensors as rows of bytes, F32/F16 as arrays).

The gguf package's GGUFReader builds a numpy view per metadata element: SmolLM2's 49,152-token
vocabulary and 48,900 merges took 4.6 s of a 6.2 s load on the 2-core box, at every start.
This reads the same header in a single pass (~0.1 s); the package still names the tensor types,
gives their block sizes and dequantizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
"""GGUF value type -> struct format (8 is a string, 9 an array)."""
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}
"""Tensor types stored as plain values (the rest as rows of bytes)."""
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any
    """gguf.GGMLQuantizationType."""
    shape: tuple[int, ...]
    """ggml's order (the fastest-varying dimension first), as the gguf package gives it."""
    data_offset: int
    n_bytes: int
    data: np.ndarray
    """A read-only view of the file: bytes per row for a quantized type, else the values."""


@dataclass(frozen=True)
class GGUFFile:
    version: int
    fields: dict[str, Any]
    """Metadata key -> a Python value (a list for an array)."""
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY:  # one read for the whole array
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise ValueError("an array runs past the end of the file")
                out = np.frombuffer(self.buf[self.pos:end], dt).tolist()
                self.pos = end
                return out
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_gguf(path: str) -> GGUFFile:
    """The file's header and tensor views; ValueError (or struct.error) for a file that is not
    GGUF, is of another version, or is cut short in its header."""
    import gguf

    data = np.memmap(path, mode="r", dtype=np.uint8)
    c = _Cursor(memoryview(data))
    if bytes(c.buf[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    c.pos = 4
    version = c.scalar("<I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    fields = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("<Q") for _ in range(c.scalar("<I")))
        infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError("invalid general.alignment: must be a power of two")
    start = -(-c.pos // align) * align
    return GGUFFile(version, fields, [_tensor(gguf, data, start, *i) for i in infos])


def _tensor(gguf, data: np.ndarray, start: int, name: str, dims: tuple[int, ...], raw: int,
            offset: int) -> GGUFTensor:
    ggml_type = gguf.GGMLQuantizationType(raw)
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(dims)) if dims else 1
    n_bytes = n * type_size // block
    np_dims = tuple(reversed(dims))
    first = start + offset
    view = data[first:first + n_bytes]
    plain = _PLAIN.get(ggml_type.name)
    if len(view) == n_bytes:  # a cut-short file keeps a short view: the caller checks sizes
        view = (view.view(plain).reshape(np_dims) if plain is not None
                else view.reshape(gguf.quant_shape_to_byte_shape(np_dims, ggml_type)))
    return GGUFTensor(name, ggml_type, dims, first, n_bytes, view)
