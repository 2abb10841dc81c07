"""Per-request KV-cache policy from HTTP headers (x-slo-*, x-kv-*): a stub for the tiers issue.

Today it only records the raw headers on the request, so they can be logged and later parsed into
load/store tier filters and SLOs (see docs/headers.md). Nothing acts on them yet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

POLICY_HEADER_PREFIXES = ("x-slo-", "x-kv-")


@dataclass(frozen=True)
class RequestPolicy:
    """The KV policy headers a request sent, lower-cased names to raw values; not interpreted."""

    headers: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.headers


def policy_from_headers(headers: Mapping[str, str]) -> RequestPolicy:
    """Keep the x-slo-* and x-kv-* headers as sent."""
    return RequestPolicy({k.lower(): v for k, v in headers.items()
                          if k.lower().startswith(POLICY_HEADER_PREFIXES)})
