"""Block payloads as bytes: one or several consecutive blocks in one safetensors object.

The object holds one tensor, "kv", of shape [n, layers, 2, kv_heads, block_size, head_dim], and
string metadata: the format version, the n block keys (hex, in order), the dtype, the per-block
shape and a checksum. decode() checks every one of them against what the caller expects, so a
payload that decodes is the KV of exactly those keys; anything else (garbage, a truncated or torn
file, another model's object, bit rot) raises CorruptPayload.

Two checksums, told apart by the format field (both the same length, so a payload's size does
not depend on which):

    format            checksum                                                 written by
    tierserve-kv/1    blake2b-128 of the tensor bytes                          the s3 tier
    tierserve-kv/2    blake2b-128 keyed with a secret, over the other four     the disk tier
                      fields and the tensor bytes

Anyone can recompute the first, so it only catches accidents; s3 keeps it so that replicas share
blocks without sharing a secret (the bucket's credentials keep writers out there). The second
also stops whoever can write the tier but lacks the secret: a planted payload, or a real one
relabelled to another key, fails it. decode() with a key accepts only /2, without one only /1.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers.errors import CorruptPayload

FORMAT = "tierserve-kv/1"
FORMAT_KEYED = "tierserve-kv/2"
TENSOR = "kv"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checksum(t: torch.Tensor) -> str:
    """blake2b-128 of the tensor's bytes (any dtype: hashed through a uint8 view, no copy)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def keyed_checksum(header: dict[str, str], t: torch.Tensor, mac_key: bytes) -> str:
    """blake2b-128 keyed with mac_key (32 bytes) over the header fields and the tensor bytes."""
    h = hashlib.blake2b(digest_size=16, key=mac_key)
    h.update(json.dumps(header, sort_keys=True).encode())
    h.update(b"\0")
    h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def encode(keys: Sequence[BlockHash], blocks: torch.Tensor,
           mac_key: bytes | None = None) -> bytes:
    """blocks: [n, *block_shape] with n == len(keys), any device; returns the object's bytes.
    With mac_key the checksum is keyed (format /2), else plain (format /1)."""
    if blocks.shape[0] != len(keys):
        raise ValueError(f"{len(keys)} keys for {blocks.shape[0]} blocks")
    t = blocks.detach().to("cpu").contiguous()
    meta = _header(keys, t.dtype, t.shape[1:], mac_key)
    meta["checksum"] = _checksum(meta, t, mac_key)
    return save({TENSOR: t}, metadata=meta)


def decode(data: bytes, keys: Sequence[BlockHash], dtype: torch.dtype,
           block_shape: Sequence[int], mac_key: bytes | None = None) -> torch.Tensor:
    """The [n, *block_shape] tensor of an object that must hold exactly `keys`, in order, and
    carry the checksum of mac_key (None: the plain checksum)."""
    meta, t = _parse(data)
    want = _header(keys, dtype, block_shape, mac_key)
    for field, value in want.items():
        if meta.get(field) != value:
            raise CorruptPayload(f"payload {field} is {meta.get(field)!r}, expected {value!r}")
    if t.dtype != dtype or tuple(t.shape) != (len(keys), *block_shape):
        raise CorruptPayload(f"tensor is {t.dtype} {tuple(t.shape)}, header disagrees")
    got = str(meta.get("checksum")).encode("utf-8", "replace")
    if not hmac.compare_digest(_checksum(want, t, mac_key).encode(), got):
        raise CorruptPayload("payload checksum mismatch")
    return t


def _header(keys: Sequence[BlockHash], dtype: torch.dtype, block_shape: Sequence[int],
            mac_key: bytes | None) -> dict[str, str]:
    return {
        "format": FORMAT if mac_key is None else FORMAT_KEYED,
        "keys": ",".join(k.hex() for k in keys),
        "dtype": dtype_name(dtype),
        "block_shape": ",".join(map(str, block_shape)),
    }


def _checksum(header: dict[str, str], t: torch.Tensor, mac_key: bytes | None) -> str:
    return checksum(t) if mac_key is None else keyed_checksum(header, t, mac_key)


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
