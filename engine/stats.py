"""The engine's counters since start-up, in plain ints kept by the loop thread (exported as
metrics at scrape time)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tierserve.engine.spec.speculator import SpecStats
from tierserve.engine.worker.grammar import GrammarStats
from tierserve.engine.worker.sparse import SparseStats


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


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment: counts per bucket (the last one above every bound), and the sum
    of what was observed."""

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    total: float = 0.0


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state published by the loop thread after each step (read by /metrics, admission)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    num_preemptions: int = 0
    iteration_tokens: HistogramSnapshot = HistogramSnapshot()
    """Tokens per step."""
    table_width: HistogramSnapshot = HistogramSnapshot()
    """Block-table width per step, in blocks."""
    metadata_bytes: HistogramSnapshot = HistogramSnapshot()
    """Bytes of metadata views per step."""
    metadata_seconds: float = 0.0
    sparse: SparseStats = SparseStats()
    """Sparse decode's counters (frozen: the runner replaces them each step)."""
    num_tracked: int = 0
    """Requests the engine holds state for (a refused request must leave none)."""
    grammar: GrammarStats = GrammarStats()
    """Structured outputs: requests, compiles, cache hits, mask time."""
    spec: SpecStats = field(default_factory=SpecStats)
    """Speculative decoding's counters (a copy; zeros when it is off)."""


def snapshot(stats: EngineStats, pool, scheduler, sparse: SparseStats, num_tracked: int,
             grammar: GrammarStats, spec: SpecStats) -> EngineSnapshot:
    """The engine's state as the loop thread publishes it after each step."""
    def hist(b: BucketCounts) -> HistogramSnapshot:
        return HistogramSnapshot(b.bounds, tuple(b.counts), b.total)

    return EngineSnapshot(len(scheduler.running), len(scheduler.waiting), pool.num_blocks,
                          pool.num_free, pool.usage, pool.queries, pool.hits,
                          stats.prompt_tokens, stats.generation_tokens, stats.steps,
                          scheduler.num_preemptions, hist(stats.iteration_tokens),
                          hist(stats.table_width), hist(stats.metadata_bytes),
                          stats.metadata_seconds, sparse, num_tracked, grammar, spec)
