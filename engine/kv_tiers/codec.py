"""Block payloads as bytes: one or several consecutive blocks in one safetensors object.

The object holds one tensor, "kv", of shape [n, layers, 2, kv_heads, block_size, head_dim], and
string metadata: the format version, the n block keys (hex, in order), the dtype, the per-block
shape and a blake2b digest of the tensor bytes. decode() checks every one of them against what
the caller expects, so a payload that decodes is the KV of exactly those keys; anything else
(garbage, a truncated or torn file, another model's object, bit rot) raises CorruptPayload.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers.errors import CorruptPayload

FORMAT = "tierserve-kv/1"
TENSOR = "kv"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checksum(t: torch.Tensor) -> str:
    """blake2b-128 of the tensor's bytes (any dtype: hashed through a uint8 view, no copy)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def encode(keys: Sequence[BlockHash], blocks: torch.Tensor) -> bytes:
    """blocks: [n, *block_shape] with n == len(keys), any device; returns the object's bytes."""
    if blocks.shape[0] != len(keys):
        raise ValueError(f"{len(keys)} keys for {blocks.shape[0]} blocks")
    t = blocks.detach().to("cpu").contiguous()
    meta = {
        "format": FORMAT,
        "keys": ",".join(k.hex() for k in keys),
        "dtype": dtype_name(t.dtype),
        "block_shape": ",".join(map(str, t.shape[1:])),
        "checksum": checksum(t),
    }
    return save({TENSOR: t}, metadata=meta)


def decode(data: bytes, keys: Sequence[BlockHash], dtype: torch.dtype,
           block_shape: Sequence[int]) -> torch.Tensor:
    """The [n, *block_shape] tensor of an object that must hold exactly `keys`, in order."""
    meta, t = _parse(data)
    want = {
        "format": FORMAT,
        "keys": ",".join(k.hex() for k in keys),
        "dtype": dtype_name(dtype),
        "block_shape": ",".join(map(str, block_shape)),
    }
    for field, value in want.items():
        if meta.get(field) != value:
            raise CorruptPayload(f"payload {field} is {meta.get(field)!r}, expected {value!r}")
    if t.dtype != dtype or tuple(t.shape) != (len(keys), *block_shape):
        raise CorruptPayload(f"tensor is {t.dtype} {tuple(t.shape)}, header disagrees")
    if checksum(t) != meta.get("checksum"):
        raise CorruptPayload("payload checksum mismatch")
    return t


def _parse(data: bytes) -> tuple[dict[str, str], torch.Tensor]:
    try:
        tensors = load(data)
        (n,) = struct.unpack_from("<Q", data)  # safetensors keeps metadata in its JSON header
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
    except (SafetensorError, ValueError, struct.error, UnicodeDecodeError, MemoryError) as e:
        raise CorruptPayload(f"not a readable payload: {e}") from e
    if list(tensors) != [TENSOR]:
        raise CorruptPayload(f"payload holds tensors {sorted(tensors)}, expected [{TENSOR!r}]")
    return meta, tensors[TENSOR]
