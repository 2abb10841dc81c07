"""Who proposes, how many tokens, and what came of it (plain Python; the draft model's proposer
brings its own runner, engine/spec/draft.py).

Each step, before the scheduler runs, `propose` sets `spec_token_ids` on the running requests that
are one token behind (a decode) and may speculate: not opted out (X-Speculative: off), no
structured-output grammar, no sparse decode for the row, room left under max_tokens and the context.
The scheduler verifies them in the step (a row of 1 + k query tokens), the runner keeps the
confirmed prefix (engine/spec/verify.py), and `observe` counts the outcome.

Adaptive, so speculation does not make a batch slower: a step is memory-bound up to
`row_budget` rows (decodes plus proposals: the weights are read once for all of them) and
compute-bound past it (each row costs about what it yields). Proposals fill the step up to the
budget, the requests with the best acceptance rate first, so a batch of `row_budget` decodes or
more proposes nothing. A request whose acceptance rate (a moving average of accepted / proposed)
falls under acceptance_floor holds off for 2 steps, then 4, 8, ... up to 64 while it keeps
failing; one good verification resets it (an answer may paraphrase first and copy later).
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


MAX_HOLD = 64
"""Most steps a request with a low acceptance rate waits before it proposes again."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 row_budget: int, may_speculate: Callable[[Request], bool] = lambda req: True):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.row_budget = row_budget
        """Rows a step may hold before it is compute-bound (0: no limit)."""
        self.may_speculate = may_speculate
        """The engine's per-request check (no grammar, no sparse decode for the row)."""
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._rate: dict[RequestId, float] = {}
        self._hold: dict[RequestId, tuple[int, int]] = {}
        """Requests holding off: (steps left, the hold's length)."""

    def propose(self, running: list[Request]) -> None:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        for req in decodes:
            req.spec_token_ids = []
        budget = (self.row_budget - len(decodes)) if self.row_budget else 1 << 30
        rows = []
        for req in sorted(decodes, key=lambda r: -self._rate.get(r.request_id, 1.0)):
            k = min(self.config.num_speculative_tokens, budget,
                    req.max_tokens - len(req.output_token_ids) - 1,
                    self.max_model_len - req.num_tokens)
            if k >= 1 and not self._holding(req.request_id) and \
                    req.hints.speculative is not False and self.may_speculate(req):
                rows.append((req, k))
                budget -= k
        if not rows:
            return
        by_id = {req.request_id: req for req, _ in rows}
        for rid, tokens in self.proposer.propose(rows).items():
            by_id[rid].spec_token_ids = tokens

    def _holding(self, rid: RequestId) -> bool:
        left, length = self._hold.get(rid, (0, 0))
        if left > 0:
            self._hold[rid] = (left - 1, length)
        return left > 0

    def observe(self, request_id: RequestId, proposed: int, accepted: int) -> None:
        """A verified row: `accepted` of its `proposed` tokens kept."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        rate = (1 - EWMA) * self._rate.get(request_id, 1.0) + EWMA * accepted / proposed
        self._rate[request_id] = rate
        if rate < self.config.acceptance_floor:
            length = min(MAX_HOLD, 2 * self._hold.get(request_id, (0, 1))[1])
            self._hold[request_id] = (length, length)
            self._rate[request_id] = self.config.acceptance_floor  # its next try starts afresh
        elif accepted:
            self._hold.pop(request_id, None)

    def finished(self, request_id: RequestId) -> None:
        self._rate.pop(request_id, None)
        self._hold.pop(request_id, None)
        self.proposer.release(request_id)


def make_proposer(config: SpeculativeConfig, draft_factory: Callable[[], Proposer]) -> Proposer:
    return NgramRows(config) if config.method == "ngram" else draft_factory()
