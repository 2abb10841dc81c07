"""Where a tier keeps its blocks, in vLLM's vocabulary (KV events and tier filters read alike)."""

from __future__ import annotations

from enum import Enum


class Medium(str, Enum):
    """The kind of memory a tier stores blocks in (the device cache itself is the caller's)."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(str, Enum):
    """Whether a tier's blocks live on this machine or behind a network."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"
