"""What one request asks of the KV tiers: explicit load and store tiers, token budgets, and its
latency target. Plain Python, no torch, no HTTP: the server parses headers and the body into a
KVHints, the offline API takes one directly, and the scheduler's tier policy decides from it."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class SloClass(enum.Enum):
    INTERACTIVE = "interactive"
    """A person waits: admitted first, stores to local tiers, skips loads that miss the budget."""
    BATCH = "batch"
    """Throughput work: admitted after interactive requests, loads from and stores to every tier."""


@dataclass(frozen=True)
class KVHints:
    """A request's KV tier hints; a None field leaves that choice to the scheduler."""

    load_tiers: tuple[str, ...] | None = None
    """Tiers the request may load from, by name (() allows none); explicit, so no cost check."""
    store_tiers: tuple[str, ...] | None = None
    """Tiers the request's new blocks may be stored to (() allows none)."""
    ttft_budget_ms: float | None = None
    """Time-to-first-token budget: loads that cannot finish within it are skipped or abandoned."""
    slo_class: SloClass | None = None
    """interactive or batch (admission order and the tier choice)."""
    max_load_tokens: int | None = None
    """At most this many prompt tokens loaded from the tiers (0 turns loading off)."""
    max_offload_tokens: int | None = None
    """At most this many of the request's tokens stored to the tiers (0 turns storing off)."""
    sparse_attention: bool | None = None
    """Sparse top-k decode on (True) or off (False) for this request; None: the server's setting."""
    speculative: bool | None = None
    """False: this request never proposes tokens (X-Speculative: off); None or True: it does
    when the server speculates."""

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def over(self, defaults: KVHints) -> KVHints:
        """These hints, with the fields left unset taken from `defaults` (the server's)."""
        return KVHints(**{f.name: getattr(defaults, f.name) if getattr(self, f.name) is None
                          else getattr(self, f.name) for f in dataclasses.fields(self)})


NO_HINTS = KVHints()
