"""Chained block hashes: the key of a full KV block in the prefix index and in every KV tier.

hash(block i) = sha256(hash(block i-1) | token ids of block i | extra keys). The extra keys hold
the model fingerprint (model digest, dtype, KV dtype, block size, layer count) and the request's
cache scope and salt (scope_key), so equal keys mean equal KV bytes across requests, processes and restarts. Python's
built-in hash() is salted per process and so is not used.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)

ROOT = BlockHash(b"\x00" * 16)

BlockMeta = tuple[BlockHash | None, tuple[int, ...]]
"""(parent hash or None, token ids) of one stored block: what a tier's KV events report."""


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(extra)
    return BlockHash(h.digest()[:16])


def extend_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                  extra: bytes) -> None:
    """Append the hashes of every full block of token_ids not yet in `hashes`."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))


def scope_key(scope: str | None, salt: str | None) -> bytes:
    """The request's share of the extra keys: its cache scope (the server's per-API-key scope,
    or None) and its cache salt (or None). Empty when both are None, so unscoped, unsalted
    requests keep the hashes they always had; otherwise a digest of both, length-prefixed, so
    no choice of salt can reproduce another scope's key."""
    if scope is None and salt is None:
        return b""
    h = hashlib.sha256()
    for part in (scope, salt):
        raw = b"" if part is None else part.encode("utf-8")
        h.update(struct.pack("<bI", part is not None, len(raw)) + raw)
    return h.digest()[:16]


def fingerprint(*parts: object) -> bytes:
    """Digest of the model identity, mixed into every block hash."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:16]
