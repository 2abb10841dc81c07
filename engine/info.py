"""The engine's face to the server: what it chose at start-up, published once, read-only.

The server (routes, metrics, start-up) reads this and the AsyncEngine's request API, never the
engine's internals: those belong to the engine loop thread. Everything here is fixed after
start-up, or (the event log, the tier stats, the policy counters) safe to read from any
thread."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tierserve.engine.worker.device import DeviceChoice, DtypeChoice
from tierserve.engine.core.tier_descriptor import TierDescriptor


@dataclass(frozen=True)
class SparseStatus:
    """Whether sparse top-k decode is configured, and whether the decode backend runs it."""

    enabled: bool
    backend_supports: bool
    topk_blocks: int | None
    topk_ratio: float | None
    min_context: int
    dense_layers: int

    @property
    def active(self) -> bool:
        return self.enabled and self.backend_supports


@dataclass(frozen=True)
class EngineInfo:
    model: str
    """The model the engine loaded (an alias, a path)."""
    max_model_len: int
    device: DeviceChoice
    dtype: DtypeChoice
    kv_cache_dtype: str
    backend: str
    """The attention backend's name."""
    routes: Mapping[str, Any]
    """Phase -> the router's decision (kernels.router.Route: to_json() explains it)."""
    sparse: SparseStatus
    tiers: tuple[TierDescriptor, ...]
    """The KV tiers below the device cache, in lookup order (empty without tiers)."""
    events: Any | None
    """The tiers' KV event log (engine.kv_tiers.events.EventLog; thread-safe), or None."""
    tier_stats: Callable[[], dict] | None
    """Per-tier stats, thread-safe (None without tiers)."""
    policy_counters: Any | None
    """The tier policy's decision counters (plain ints), or None without tiers."""
    quantization: str = "none"
    """--quantization as it runs (auto resolved)."""
    quant_kernels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Which kernel each kind of quantized layer runs (empty: none)."""
    weight_bytes: int = 0
    """Bytes the weights hold on the device."""
    tensor_parallel_size: int = 1
    speculative: str | None = None
    """Speculative decoding as configured (SpeculativeConfig.describe()), or None when off."""
