"""The per-request KV tier policy: which tiers a request loads from and stores to, and why.

Decided at admission (again after a preemption), from the request's KVHints and a cost model the
engine measures itself. Plain Python, no torch.

    explicit tiers (X-KV-Load-Tiers, kv_transfer_params) win: no cost check
    otherwise, per tier in lookup order, a load is planned only when
      - the prompt is long enough for the tier's locality (short prompts skip remote tiers),
      - it fits what is left of the TTFT budget after the time already waited (budget), and
      - loading the wanted blocks is faster than recomputing them (cost; only once the tier's
        read rate and the engine's prefill rate are both measured, never on a guess);
      batch requests skip the cost and budget checks: they load from every tier
    stores: explicit tiers win; batch and class-less requests store to every tier, interactive
    ones to the local tiers only
    a planned load carries a deadline (arrival + budget): past it, it is abandoned and the rest of
    the prompt recomputed
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from tierserve.engine.core.kv_hints import KVHints, SloClass
from tierserve.engine.core.tier_descriptor import TierDescriptor


class SkipReason(enum.Enum):
    """Why a tier is not loaded from for one admission."""

    HINT = "hint"
    """The request named its load tiers, and not this one."""
    SHORT_PROMPT = "short prompt"
    """A remote tier, and too few tokens to load for a round trip to pay."""
    BUDGET = "budget"
    """The load would not fit what is left of the TTFT budget."""
    COST = "cost"
    """Recomputing the blocks is faster than loading them."""


@dataclass(frozen=True)
class TierDecision:
    """What the policy chose for one admission of one request."""

    load_tiers: tuple[str, ...]
    store_tiers: tuple[str, ...]
    max_load_blocks: int | None
    """At most this many blocks loaded (None: no limit)."""
    max_store_blocks: int | None
    """At most this many of the request's blocks stored (None: no limit)."""
    deadline: float | None
    """time.monotonic() by which a load must be done (None: the engine's load timeout)."""
    skipped: dict[str, SkipReason] = field(default_factory=dict)
    """Tier -> why it is not loaded from."""
    notes: tuple[str, ...] = ()
    """The reasons in a few words each, e.g. 's3 skipped: est 820 ms > 500 ms budget'."""



class Ewma:
    """An exponentially weighted moving average; None until the first sample."""

    def __init__(self, alpha: float, seed: float | None = None):
        self.alpha, self.value = alpha, seed

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class CostModel:
    """Per tier: the time to find blocks (lookup latency) and to read them (bandwidth), from real
    loads; for every tier alike, the time to copy a loaded block into the device cache; the
    engine's prefill throughput from real steps. Updated from the fetch and step threads, read at
    admission: a lock keeps each update whole."""

    def __init__(self, block_bytes: int, block_size: int, alpha: float = 0.3,
                 prefill_tokens_per_s: float | None = None):
        self.block_bytes, self.block_size, self.alpha = block_bytes, block_size, alpha
        self._lookup: dict[str, Ewma] = {}
        self._bandwidth: dict[str, Ewma] = {}
        self._copy_in = Ewma(alpha, 0.0)
        self._prefill = Ewma(alpha, prefill_tokens_per_s)
        self._measured_at: dict[str, float] = {}
        """time.monotonic() of each tier's last read-rate sample (or last re-probe granted)."""
        self._lock = threading.Lock()

    def observe_lookup(self, tier: str, seconds: float) -> None:
        with self._lock:
            self._lookup.setdefault(tier, Ewma(self.alpha)).add(seconds)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A tier's payload reads (lookup excluded): nbytes in seconds."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._bandwidth.setdefault(tier, Ewma(self.alpha)).add(nbytes / seconds)
            self._measured_at[tier] = time.monotonic()

    def claim_reprobe(self, tier: str, now: float, after_s: float) -> bool:
        """True once per `after_s` of no new read-rate sample for `tier`: a tier skipped for
        cost is never read, so its estimate would never change (one slow read, say of a
        corrupt block, would keep it skipped for good); the caller lets one load through."""
        with self._lock:
            last = self._measured_at.get(tier)
            if last is None or now - last < after_s:
                return False
            self._measured_at[tier] = now
            return True

    def observe_copy_in(self, blocks: int, seconds: float) -> None:
        """Loaded blocks written into the device cache (the step thread's share of a load)."""
        if blocks > 0:
            with self._lock:
                self._copy_in.add(seconds / blocks)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._prefill.add(tokens / seconds)

    def load_seconds(self, tier: str, blocks: int) -> tuple[float, bool] | None:
        """(expected time to look up, read and copy in `blocks` blocks, whether the read rate
        was measured), or None before the tier's first lookup. Without a measured rate the
        estimate is a lower bound: the lookup and the copy-in only."""
        with self._lock:
            lookup, bw = self._lookup.get(tier), self._bandwidth.get(tier)
            if lookup is None:
                return None
            est = lookup.value + blocks * self._copy_in.value
            if bw is None:
                return est, False
            return est + blocks * self.block_bytes / bw.value, True

    def recompute_seconds(self, blocks: int) -> float | None:
        """The time to prefill `blocks` blocks instead, or None before the first measured
        prefill step (a guess would decide a cold server's first loads by chance)."""
        with self._lock:
            if self._prefill.value is None:
                return None
            return blocks * self.block_size / self._prefill.value

    def snapshot(self) -> dict:
        with self._lock:
            return {"prefill_tokens_per_s": self._prefill.value,
                    "copy_in_s_per_block": self._copy_in.value,
                    "lookup_s": {k: v.value for k, v in self._lookup.items()},
                    "bandwidth_bytes_per_s": {k: v.value for k, v in self._bandwidth.items()}}


class TierPolicy:
    def __init__(self, tiers: Sequence[TierDescriptor], cost: CostModel, block_size: int,
                 remote_min_tokens: int = 512, reprobe_after_s: float = 30.0):
        self.tiers, self.cost, self.block_size = tuple(tiers), cost, block_size
        self.reprobe_after_s = reprobe_after_s
        """A tier skipped for cost gets one load after this long without a new read-rate sample
        (CostModel.claim_reprobe)."""
        self.remote_min_tokens = remote_min_tokens
        """Prompts with fewer tokens to load than this skip remote tiers (a round trip costs more
        than their prefill)."""

    def decide(self, hints: KVHints, blocks: int, arrival: float,
               now: float | None = None) -> TierDecision:
        """The decision for a request wanting `blocks` blocks past its device prefix."""
        now = time.monotonic() if now is None else now
        deadline = None if hints.ttft_budget_ms is None else arrival + hints.ttft_budget_ms / 1e3
        load, skipped, notes = self._load_tiers(hints, blocks, now, deadline)
        max_load = _blocks(hints.max_load_tokens, self.block_size)
        if max_load == 0:
            load, notes = (), notes + ("load off: max_load_tokens=0",)
        return TierDecision(load, self._store_tiers(hints), max_load,
                            _blocks(hints.max_offload_tokens, self.block_size), deadline,
                            skipped, notes)

    def _load_tiers(self, hints: KVHints, blocks: int, now: float, deadline: float | None):
        names = [t.name for t in self.tiers]
        if hints.load_tiers is not None:
            chosen = tuple(n for n in names if n in hints.load_tiers)
            return chosen, {n: SkipReason.HINT for n in names if n not in chosen}, ()
        if hints.slo_class is SloClass.BATCH:
            return tuple(names), {}, ()
        chosen, skipped, notes = [], {}, []
        for t in self.tiers:
            why = self._skip(t, blocks, now, deadline)
            if why is None:
                chosen.append(t.name)
            else:
                skipped[t.name] = why[0]
                notes.append(f"{t.name} skipped: {why[1]}")
        return tuple(chosen), skipped, tuple(notes)

    def _skip(self, t: TierDescriptor, blocks: int, now: float,
              deadline: float | None) -> tuple[SkipReason, str] | None:
        """(kind, words) when tier t should not be asked, else None."""
        tokens = blocks * self.block_size
        if not t.local and tokens < self.remote_min_tokens:
            return SkipReason.SHORT_PROMPT, f"{tokens} tokens < {self.remote_min_tokens}"
        known = self.cost.load_seconds(t.name, blocks)
        if known is None:  # never looked up: try it, the load itself measures it
            return None
        est, complete = known
        if deadline is not None and now + est > deadline:
            left = max(0.0, deadline - now)
            return SkipReason.BUDGET, f"est {est * 1e3:.0f} ms > {left * 1e3:.0f} ms budget"
        recompute = self.cost.recompute_seconds(blocks)
        if complete and recompute is not None and est >= recompute:
            if self.cost.claim_reprobe(t.name, now, self.reprobe_after_s):
                return None  # its estimate is old: this load measures it again
            return SkipReason.COST, f"est {est * 1e3:.0f} ms >= recompute {recompute * 1e3:.0f} ms"
        return None

    def _store_tiers(self, hints: KVHints) -> tuple[str, ...]:
        names = [t.name for t in self.tiers]
        if hints.store_tiers is not None:
            return tuple(n for n in names if n in hints.store_tiers)
        if hints.max_offload_tokens == 0:
            return ()
        if hints.slo_class is SloClass.INTERACTIVE:
            return tuple(t.name for t in self.tiers if t.local)
        return tuple(names)


def _blocks(tokens: int | None, block_size: int) -> int | None:
    return None if tokens is None else tokens // block_size
