"""KV tiers below the device cache: cpu (host memory), disk (local folder), s3 (a bucket).

The names below load lazily: the config, registry and media vocabulary are torch-free, and
importing them (or this package) must pull in neither torch nor boto3.
"""

from __future__ import annotations

from tierserve._lazy import lazy_getattr

_LAZY = {
    "TierConfig": "tierserve.engine.kv_tiers.config",
    "Medium": "tierserve.engine.core.tier_descriptor",
    "Locality": "tierserve.engine.core.tier_descriptor",
    "TierDescriptor": "tierserve.engine.core.tier_descriptor",
    "TIERS": "tierserve.engine.kv_tiers.config",
    "tier_class": "tierserve.engine.kv_tiers.registry",
    "create_tier": "tierserve.engine.kv_tiers.registry",
    "TierError": "tierserve.engine.kv_tiers.errors",
    "TierMiss": "tierserve.engine.kv_tiers.errors",
    "CorruptPayload": "tierserve.engine.kv_tiers.errors",
    "TierUnavailable": "tierserve.engine.kv_tiers.errors",
    "TierStats": "tierserve.engine.kv_tiers.stats",
    "BlockLayout": "tierserve.engine.kv_tiers.layout",
    "KVTier": "tierserve.engine.kv_tiers.base",
    "TierHit": "tierserve.engine.kv_tiers.load",
    "LoadHandle": "tierserve.engine.kv_tiers.load",
    "TierManager": "tierserve.engine.kv_tiers.manager",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
