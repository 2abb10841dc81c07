"""TierConfig: which KV tiers exist, in lookup order, and their limits. No I/O, no torch here."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

TIERS: dict[str, str] = {
    "cpu": "tierserve.engine.kv_tiers.cpu:CpuTier",
    "disk": "tierserve.engine.kv_tiers.disk:DiskTier",
    "s3": "tierserve.engine.kv_tiers.s3:S3Tier",
}
"""The tiers by name, each a class imported only when built (registry.create_tier): naming a tier
in a config imports neither boto3 nor torch."""


@dataclass(frozen=True)
class TierConfig:
    """Settings of every tier; a tier reads only its own fields."""

    tiers: tuple[str, ...] = ("cpu",)
    """Tier names in lookup order (after the device cache), from: cpu, disk, s3."""
    cpu_bytes: int = 4 << 30
    """Host memory the cpu tier may hold, in payload bytes."""
    disk_dir: str | None = None
    """Folder of the disk tier; each model gets its own subfolder named by its fingerprint."""
    disk_bytes: int = 64 << 30
    """Payload bytes the disk tier may keep under disk_dir (per model)."""
    disk_error_backoff_s: float = 30.0
    """After a failed disk write (full, read-only), stores pause this long; loads go on."""
    s3_bucket: str | None = None
    """Bucket of the s3 tier."""
    s3_prefix: str = "tierserve-kv"
    """First component of every object key: <prefix>/<model fingerprint hex>/<block key hex>."""
    s3_endpoint_url: str | None = None
    """S3-compatible endpoint (None: AWS). Credentials come from boto3's standard chain."""
    s3_region: str | None = None
    """Region name passed to boto3 (None: boto3's default chain)."""
    s3_connect_timeout_s: float = 2.0
    """TCP connect timeout of one attempt."""
    s3_read_timeout_s: float = 5.0
    """Socket read timeout of one attempt."""
    s3_max_attempts: int = 2
    """Attempts per request, the first included (botocore's total_max_attempts)."""
    s3_probe_batch: int = 8
    """HEAD requests in flight at once while finding how many leading keys the bucket holds."""
    s3_create_bucket: bool = True
    """Create the bucket before the first write if it is missing."""
    breaker_threshold: int = 3
    """Consecutive failed requests that open the s3 circuit breaker."""
    breaker_backoff_s: float = 5.0
    """First wait before an open breaker lets one probe through; doubles on each failed probe."""
    breaker_max_backoff_s: float = 60.0
    """Cap of the breaker's back-off."""
    store_queue_depth: int = 64
    """Pending store jobs per tier; a store beyond it is dropped and counted, never waited for."""
    store_workers: int = 1
    """Writer threads per tier."""
    load_workers: int = 4
    """Threads that read payloads for start_load, shared by all tiers."""
    event_log_size: int = 10000
    """KV events (stored, removed, cleared) kept for GET /v1/kv/events readers that fall behind."""
    load_timeout_s: float = 30.0
    """A load's payload reads that run past this (or past the request's TTFT budget, if
    sooner) are abandoned: what arrived is kept, the rest of the prompt recomputed."""
    event_token_ids: bool = False
    """BlockStored events carry the blocks' token ids (vLLM's field). Off: hashes only, so an
    event reader learns no prompt text."""

    def __post_init__(self) -> None:
        for name in self.tiers:
            if name not in TIERS:
                raise ValueError(f"tiers: unknown tier {name!r} (valid: {', '.join(TIERS)})")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers: each tier may appear once, got {self.tiers}")
        if "disk" in self.tiers and not self.disk_dir:
            raise ValueError("disk_dir: required when the disk tier is enabled")
        if "s3" in self.tiers and not self.s3_bucket:
            raise ValueError("s3_bucket: required when the s3 tier is enabled")
        for field in ("cpu_bytes", "disk_bytes", "store_queue_depth", "store_workers",
                      "load_workers", "s3_max_attempts", "s3_probe_batch", "breaker_threshold",
                      "event_log_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: must be at least 1, got {getattr(self, field)}")
        if not self.load_timeout_s > 0:
            raise ValueError(f"load_timeout_s: must be above 0, got {self.load_timeout_s}")


def default_cpu_bytes() -> int:
    """The cpu tier's size when none is given: an eighth of the host's memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 4 << 30
    return max(1 << 20, min(4 << 30, total // 8))


def default_disk_bytes(folder: str) -> int:
    """The disk tier's size when none is given: a quarter of the space free where `folder` is
    (or will be created), at most 64 GiB."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return 64 << 30
    return max(1 << 20, min(64 << 30, free // 4))


def describe_tiers(config: TierConfig) -> str:
    """The start-up line's words: each tier with its bound."""
    words = {"cpu": f"cpu ({config.cpu_bytes / 2**30:.1f} GiB of host memory)",
             "disk": f"disk ({config.disk_dir}, {config.disk_bytes / 2**30:.1f} GiB)",
             "s3": f"s3 (s3://{config.s3_bucket}/{config.s3_prefix})"}
    return ", ".join(words[n] for n in config.tiers)
