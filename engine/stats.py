"""The engine's counters since start-up, in plain ints kept by the loop thread (exported as
metrics at scrape time)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since start-up (exported as metrics)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0
    """Tokens run through the model (prompt tokens served from the prefix cache are not)."""
    steps: int = 0
    finished_requests: int = 0
    iteration_tokens: BucketCounts = field(default_factory=lambda: BucketCounts(ITERATION_BUCKETS))
    """Tokens run per step (vllm:iteration_tokens_total)."""
    table_width: BucketCounts = field(default_factory=lambda: BucketCounts(WIDTH_BUCKETS))
    """Block-table width per step, in blocks (a power of two, engine.batch_buffers)."""
    metadata_bytes: BucketCounts = field(default_factory=lambda: BucketCounts(BYTES_BUCKETS))
    """Bytes of metadata views per step."""
    metadata_seconds: float = 0.0
    """Time spent building step inputs and backend metadata."""


ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
WIDTH_BUCKETS = tuple(1 << i for i in range(3, 15))
BYTES_BUCKETS = tuple(1 << i for i in range(8, 25, 2))


@dataclass
class BucketCounts:
    """A histogram in plain ints, kept by the loop thread and exported at scrape time."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    """counts[i]: observations <= bounds[i] and > bounds[i-1]; the last one is above all bounds."""
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
