"""Where a tier keeps its blocks, in vLLM's vocabulary (KV events and tier filters read alike)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Medium(str, Enum):
    """The kind of memory a tier stores blocks in (the device cache itself is the caller's)."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(str, Enum):
    """Whether a tier's blocks live on this machine or behind a network."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass(frozen=True)
class TierDescriptor:
    """One configured tier as everyone outside it names it: the tier policy, the server's
    headers and kv_transfer_params matchers, the engine's published facts."""

    name: str
    """cpu, disk or s3: what X-KV-Load-Tiers and the policy say."""
    medium: Medium
    locality: Locality

    @property
    def local(self) -> bool:
        """On this machine (cpu, disk) rather than behind a network (s3)."""
        return self.locality is Locality.LOCAL

    def matcher(self) -> dict[str, str]:
        """vLLM's tier matcher that selects exactly this tier's kind."""
        return {"medium": self.medium.value, "locality": self.locality.value}
