"""Per-tier counters (plain ints and floats, no prometheus) and their frozen snapshot.

Counters are written by the manager's worker threads and read by anyone: every update and every
snapshot takes the counters' own lock, so a snapshot is consistent and cheap (a few dozen fields).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class TierStats:
    """One tier's counters at one moment. Sums, not rates: a reader takes deltas."""

    name: str
    """Tier name: cpu, disk or s3."""
    medium: str
    """Medium value: CPU or STORAGE."""
    locality: str
    """Locality value: LOCAL or REMOTE."""
    lookups: int = 0
    """lookup() calls that asked this tier."""
    hit_blocks: int = 0
    """Blocks lookup() assigned to this tier."""
    hit_tokens: int = 0
    """hit_blocks times the block size."""
    loaded_blocks: int = 0
    """Blocks read and verified."""
    bytes_loaded: int = 0
    """Payload bytes of those blocks."""
    load_seconds: float = 0.0
    """Wall time of those reads, summed (mean latency = load_seconds / loaded_blocks)."""
    stored_blocks: int = 0
    """Blocks written (a key already present is not rewritten and not counted)."""
    bytes_stored: int = 0
    """Payload bytes of those blocks."""
    store_seconds: float = 0.0
    """Wall time of those writes, summed."""
    evictions: int = 0
    """Blocks removed to make room."""
    dropped_writes: int = 0
    """Store jobs dropped because the tier's queue was full."""
    queued_writes: int = 0
    """Store jobs waiting in the tier's queue now (filled in by the manager)."""
    used_bytes: int = 0
    """Payload bytes held now (s3: bytes this process uploaded; the bucket may hold more)."""
    capacity_bytes: int | None = None
    """Byte budget (None: unbounded, the bucket's lifecycle rules decide)."""
    errors: dict[str, int] = field(default_factory=dict)
    """Failures by kind: miss, corrupt, timeout, connect, no_space, read_only, unavailable..."""
    breaker_state: str | None = None
    """closed, open or half_open for tiers with a circuit breaker."""
    load_latency: tuple[int, ...] = ()
    """Block reads per LATENCY_BUCKETS bucket (the last: slower than every bound)."""
    store_latency: tuple[int, ...] = ()
    """Block writes per LATENCY_BUCKETS bucket."""


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
"""Upper bounds (seconds) of the per-block load and store latency histograms."""


COUNTED = ("lookups", "hit_blocks", "loaded_blocks", "bytes_loaded", "load_seconds",
           "stored_blocks", "bytes_stored", "store_seconds", "evictions", "dropped_writes")


class TierCounters:
    """The mutable, lock-guarded sums behind TierStats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {name: 0 for name in COUNTED}
        self._errors: dict[str, int] = {}
        self._latency = {"load": [0] * (len(LATENCY_BUCKETS) + 1),
                         "store": [0] * (len(LATENCY_BUCKETS) + 1)}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._sums[name] += d

    def observe(self, op: str, seconds: float) -> None:
        """One block's load or store latency into its histogram."""
        with self._lock:
            self._latency[op][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def error(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + n

    def errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)

    def snapshot(self, **extra) -> TierStats:
        """TierStats of these sums plus `extra` (name, medium, used_bytes...)."""
        with self._lock:
            sums, errors = dict(self._sums), dict(self._errors)
            latency = {f"{op}_latency": tuple(c) for op, c in self._latency.items()}
        known = {f.name for f in fields(TierStats)}
        return TierStats(**{k: v for k, v in sums.items() if k in known}, errors=errors,
                         **latency, **extra)
