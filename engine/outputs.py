"""What the engine returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.engine.core.tier_policy import TierDecision


@dataclass
class TopLogprobs:
    """Logprob of the chosen token and of the top-N alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TopLogprobs] | None
    finish_reason: str | None = None
    """'stop', 'length', 'abort' or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output (None for EOS or length)."""

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs is not None else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TopLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    kv_decision: TierDecision | None = None
    """What the tier policy chose (X-KV-Policy is its header()); None without tiers."""
    kv_hit_tokens: dict[str, int] | None = None
    """Prompt tokens served per cache: device, then each tier (the X-KV-Hit-Tokens header)."""
