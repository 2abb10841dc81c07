"""Turn the engine's cumulative outputs into per-chunk deltas, and count usage.

The engine's text is cumulative and only grows: it holds back partial UTF-8 characters and any
tail that may still become a stop string, so a delta taken by length is always safe to send."""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.engine.api import RequestOutput, TierDecision, TopLogprobs
from tierserve.server.protocol import PromptTokensDetails, Usage


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TopLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool
    """The first delta of this choice (for echo and the assistant role)."""
    kv_decision: TierDecision | None = None
    """Set on the choice's finishing delta: what the KV tier policy did."""
    kv_hit_tokens: dict[str, int] | None = None
    """Set on the finishing delta: prompt tokens served per cache."""


class DeltaTracker:
    """Per choice: how much text and how many tokens were already sent."""

    def __init__(self, num_choices: int):
        self.sent_text = [0] * num_choices
        self.sent_tokens = [0] * num_choices
        self.started = [False] * num_choices
        self.completion_tokens = [0] * num_choices
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}

    def delta(self, i: int, out: RequestOutput, prompt_index: int) -> Delta:
        first = not self.started[i]
        self.started[i] = True
        if out.prompt_token_ids:
            self.prompt_tokens.setdefault(prompt_index, len(out.prompt_token_ids))
            self.cached_tokens.setdefault(prompt_index, out.num_cached_tokens)
        if not out.outputs:  # aborted before it produced anything
            return Delta("", [], None, "abort" if out.finished else None, None, first)
        c = out.outputs[0]
        text = c.text[self.sent_text[i]:]
        ids = c.token_ids[self.sent_tokens[i]:]
        lps = c.logprobs[self.sent_tokens[i]:] if c.logprobs is not None else None
        self.sent_text[i] = max(self.sent_text[i], len(c.text))
        self.sent_tokens[i] = len(c.token_ids)
        self.completion_tokens[i] = len(c.token_ids)
        if not out.finished:
            return Delta(text, ids, lps, c.finish_reason, c.stop_reason, first)
        return Delta(text, ids, lps, c.finish_reason, c.stop_reason, first, out.kv_decision,
                     out.kv_hit_tokens)

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(self.cached_tokens.values())))


@dataclass(frozen=True)
class TokenInfo:
    """One token's logprob entry, before a route puts it in its response shape."""

    token: str
    logprob: float | None
    """None for the first prompt token, which has no logprob."""
    top: list[tuple[str, float]]
    """The most likely tokens at that position, with their logprobs."""


LOGPROB_FLOOR = -9999.0
"""A token a structured output's grammar masks has logprob -inf, which JSON cannot carry: it is
reported as this floor (as vLLM does)."""


def token_infos(tokenizer, ids: list[int], lps: list[TopLogprobs | None]) -> list[TokenInfo]:
    """The one logprobs builder of the completion and chat routes."""
    def text(tid: int) -> str:
        return tokenizer.decode([tid], skip_special_tokens=False)

    return [TokenInfo(text(tid), None, []) if lp is None else
            TokenInfo(text(tid), max(lp.logprob, LOGPROB_FLOOR),
                      [(text(t), max(v, LOGPROB_FLOOR)) for t, v in lp.top])
            for tid, lp in zip(ids, lps)]


def usage_of(outputs: list[RequestOutput], n: int) -> Usage:
    """Usage of finished outputs; child k belongs to prompt k // n (prompt tokens count once)."""
    t = DeltaTracker(len(outputs))
    for k, out in enumerate(outputs):
        t.delta(k, out, k // n)
    return t.usage()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
