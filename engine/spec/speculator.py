"""Who proposes, how many tokens, and what came of it (plain Python; the draft model's proposer
brings its own runner, engine/spec/draft.py).

Each step, before the scheduler runs, `propose` sets `spec_token_ids` on the running requests that
are one token behind (a decode) and may speculate: not opted out (X-Speculative: off), no
structured-output grammar, no sparse decode for the row, room left under max_tokens and the context.
The scheduler verifies them in the step (a row of 1 + k query tokens), the runner keeps the
confirmed prefix (engine/spec/verify.py), and `observe` counts the outcome.

Adaptive: a request's acceptance rate is a moving average of accepted / proposed. While it stays
under acceptance_floor and the step has compute_bound_batch decode rows or more (where a verified
token costs about what a decoded one does, so rejected proposals are a loss), the request stops
proposing; below that batch size a verify row costs little more than a decode, and it proposes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.spec.config import SpeculativeConfig
from tierserve.engine.spec.ngram import NgramProposer

EWMA = 0.3
"""Weight of the newest step in a request's acceptance rate."""


class Proposer(Protocol):
    def propose(self, rows: list[tuple[Request, int]]) -> dict[RequestId, list[int]]:
        """Up to k proposals for each (request, k); a request may get none."""
        ...

    def release(self, request_id: RequestId) -> None:
        """The request finished: drop what the proposer keeps for it."""
        ...


class NgramRows:
    """The n-gram proposer over a batch (no state between steps)."""

    def __init__(self, config: SpeculativeConfig):
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, rows: list[tuple[Request, int]]) -> dict[RequestId, list[int]]:
        out = {}
        for req, k in rows:
            got = self.ngram.propose(req.all_token_ids, k)
            if got:
                out[req.request_id] = got
        return out

    def release(self, request_id: RequestId) -> None:
        pass


@dataclass
class SpecStats:
    """Counters since start-up, in vLLM's metric names (vllm:spec_decode_*)."""

    num_drafts: int = 0
    """Verified rows (a request's proposals checked in one step)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[i]: rows whose proposal i was accepted."""

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_pos))


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 may_speculate: Callable[[Request], bool] = lambda req: True):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.may_speculate = may_speculate
        """The engine's per-request check (no grammar, no sparse decode for the row)."""
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._rate: dict[RequestId, float] = {}

    def propose(self, running: list[Request]) -> None:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        bound = 0 < self.config.compute_bound_batch <= len(decodes)
        rows = []
        for req in decodes:
            req.spec_token_ids = []
            if bound and self._rate.get(req.request_id, 1.0) < self.config.acceptance_floor:
                continue
            k = min(self.config.num_speculative_tokens,
                    req.max_tokens - len(req.output_token_ids) - 1,
                    self.max_model_len - req.num_tokens)
            if k >= 1 and req.hints.speculative is not False and self.may_speculate(req):
                rows.append((req, k))
        if not rows:
            return
        by_id = {req.request_id: req for req, _ in rows}
        for rid, tokens in self.proposer.propose(rows).items():
            by_id[rid].spec_token_ids = tokens

    def observe(self, request_id: RequestId, proposed: int, accepted: int) -> None:
        """A verified row: `accepted` of its `proposed` tokens kept."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        old = self._rate.get(request_id, 1.0)
        self._rate[request_id] = (1 - EWMA) * old + EWMA * accepted / proposed

    def finished(self, request_id: RequestId) -> None:
        self._rate.pop(request_id, None)
        self.proposer.release(request_id)


def make_proposer(config: SpeculativeConfig, draft_factory: Callable[[], Proposer]) -> Proposer:
    return NgramRows(config) if config.method == "ngram" else draft_factory()
