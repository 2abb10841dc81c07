"""Errors a tier raises. Each carries a `kind`: the name its tier counts it under in `errors`."""

from __future__ import annotations


class TierError(Exception):
    """A tier could not serve or keep a block; the caller treats it as a miss or a dropped write."""

    kind = "io"

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class TierMiss(TierError):
    """The key is not (or no longer) in the tier."""

    kind = "miss"


class CorruptPayload(TierError):
    """A payload failed its check (garbage, truncated, wrong key, dtype, shape or checksum)."""

    kind = "corrupt"


class TierUnavailable(TierError):
    """The tier refuses work for now (circuit breaker open, store back-off after a disk error)."""

    kind = "unavailable"
