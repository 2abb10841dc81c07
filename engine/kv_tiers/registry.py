"""KV tiers by name, imported lazily: naming a tier in a config must not import boto3 or torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierserve._lazy import lazy_class

if TYPE_CHECKING:
    from tierserve.engine.kv_tiers.base import KVTier
    from tierserve.engine.kv_tiers.layout import BlockLayout

from tierserve.engine.kv_tiers.config import TIERS, TierConfig


def tier_class(name: str) -> type[KVTier]:
    return lazy_class(TIERS, name, "KV tier")


def create_tier(name: str, config: TierConfig, layout: BlockLayout) -> KVTier:
    return tier_class(name)(config, layout)
