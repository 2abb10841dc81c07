"""The state of one request (one sequence) inside the engine. Plain Python, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NewType

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.core.kv_hints import NO_HINTS, KVHints
from tierserve.engine.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    """Waiting for KV blocks to arrive from a slower tier; other requests run meanwhile."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One sequence. Invariant: num_computed_tokens <= num_tokens; a sample is drawn when the
    step brings num_computed_tokens up to num_tokens."""

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Output-token limit after applying the context length."""
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    """The client's salt: requests with different salts never share a KV block."""
    cache_scope: str | None = None
    """Who may share this request's KV blocks (the server's per-API-key scope; None: anyone with
    the same salt). Mixed into the block hashes with the salt, so a salt cannot cross scopes."""
    tenant: str | None = None
    """Whose share of the engine the request uses (engine/core/fair_share.py): a short digest of
    the caller's API key, never the key; None: the one tenant of a server without keys."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of the full blocks of all_token_ids, extended as tokens arrive."""
    num_published_blocks: int = 0
    """Leading blocks already in the prefix index (or taken from it)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache or a KV tier at first admission (which tier
    served how many: the KV connector's own table)."""
    hints: KVHints = NO_HINTS
    """What the request asked of the KV tiers (explicit tiers, budgets, SLO)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed next tokens (speculative decoding) to verify in the coming step: set before the
    scheduler runs, cleared by its update; they are not tokens of the request until accepted."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
