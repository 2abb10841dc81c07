"""Who gets the next seat and how much of a step's token budget, when tenants share the engine.
Plain Python, no torch.

A tenant is one API key (Request.tenant, a short digest of the key's digest, never the key);
requests without a key are one tenant (None). The scheduler asks its share policy three things:

    admission_order(ready, running)   the waiting requests in the order seats are offered
    quotas(budget, running, offered)  the step's budget and each tenant's tokens of it
    victim(candidates, running)       the running request to preempt when blocks run out

FirstCome is the order every peer ships: rank (SLO class, or priority under the priority policy,
then arrival) across everyone, the whole budget to whoever comes first, the lowest-ranked request
preempted. FairShare, per tenant:

- seats (max_num_seqs): the next seat goes to the tenant holding the fewest (running, plus seats
  already offered this step); ties to the tenant whose first request ranks first. A tenant's
  priority and SLO class order its own requests only: no key outranks another by asking.
- tokens (max_num_batched_tokens): the budget is water-filled over the tenants' demands (running
  requests' next chunks, the prompts of the requests offered a seat): each tenant gets its demand
  or an equal level, whichever is less, and the level rises with what small tenants leave. A
  tenant spends its quota in the order FirstCome would spend the whole budget. No credit: a
  tenant idle for an hour has none to burst with, and none is owed to a busy one.
- a newcomer's short step: when a tenant holding no seat is offered one while others run, that
  step carries the newcomers' even shares and the running tenants' decodes, not their prefill.
  Where a step's time grows with its tokens (the CPU), the newcomer's first token then waits for
  a step about its own size, not one the budget's size; the running tenants lose no throughput
  there (a shorter step), on a GPU at most the prefill of every other step (never two such
  steps in a row).
- preemption: the last candidate of the tenant holding the most seats.

With one tenant FairShare is FirstCome: same order, the whole budget, the same victim.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from typing import Callable, Sequence

from tierserve.engine.core.request import Request

Rank = Callable[[Request], tuple]
"""A request's place within its tenant (lower first)."""
Want = Callable[[Request], int]
"""Tokens a request would compute this step if it had the whole budget."""


class Shares:
    """One step's token budget and quotas, spent as requests are scheduled. A tenant without a
    quota may use `default` tokens (FirstCome: the whole budget)."""

    def __init__(self, budget: int, quotas: dict[str | None, int], default: int):
        self.budget = budget
        """The step's token budget: max_num_batched_tokens, or less in a newcomer's short step."""
        self._left = dict(quotas)
        self._default = default

    def allowed(self, req: Request, budget: int) -> int:
        """Tokens `req` may take now: what is left of the step's budget and of its tenant's."""
        return min(budget, self._left.get(req.tenant, self._default))

    def take(self, req: Request, n: int) -> None:
        self._left[req.tenant] = self._left.get(req.tenant, self._default) - n


class FirstCome:
    """Rank order across every tenant (fair_share off)."""

    def __init__(self, rank: Rank):
        self.rank = rank

    def admission_order(self, ready: list[Request], running: list[Request]) -> list[Request]:
        return sorted(ready, key=self.rank)  # stable: equal ranks keep their queue order

    def quotas(self, budget: int, running: list[Request], offered: Sequence[Request],
               want: Want) -> Shares:
        return Shares(budget, {}, budget)

    def victim(self, candidates: list[Request], running: list[Request]) -> Request:
        return candidates[-1]


class FairShare(FirstCome):
    """Seats, tokens and preemption shared across tenants (see the module docstring)."""

    def __init__(self, rank: Rank):
        super().__init__(rank)
        self._short = False
        """The last step was a newcomer's short step (the next one may not be)."""

    def admission_order(self, ready: list[Request], running: list[Request]) -> list[Request]:
        queues: dict[str | None, deque[Request]] = defaultdict(deque)
        for req in super().admission_order(ready, running):
            queues[req.tenant].append(req)
        seats = Counter(r.tenant for r in running)
        order = list(queues)  # a tie of seats and rank goes to the tenant first in the queue
        heap = [(seats[t], self.rank(queues[t][0]), i) for i, t in enumerate(order)]
        heapq.heapify(heap)
        out = []
        while heap:
            held, _, i = heapq.heappop(heap)
            queue = queues[order[i]]
            out.append(queue.popleft())
            if queue:
                heapq.heappush(heap, (held + 1, self.rank(queue[0]), i))
        return out

    def quotas(self, budget: int, running: list[Request], offered: Sequence[Request],
               want: Want) -> Shares:
        demand: dict[str | None, int] = defaultdict(int)
        for req in (*running, *offered):
            demand[req.tenant] += want(req)
        if len(demand) <= 1:
            self._short = False
            return Shares(budget, {}, budget)
        seated = {r.tenant for r in running}
        new = [t for t in demand if t not in seated]
        self._short = bool(new and seated) and not self._short
        if self._short:
            return self._newcomers(budget, demand, new, running, want)
        return Shares(budget, water_fill(budget, demand), 0)

    @staticmethod
    def _newcomers(budget: int, demand: dict[str | None, int], new: list[str | None],
                   running: list[Request], want: Want) -> Shares:
        """A short step: the running tenants' decodes, and the newcomers' even shares."""
        quota = dict.fromkeys(demand, 0)
        for req in running:
            if req.num_tokens - req.num_computed_tokens == 1:  # a decode (maybe with proposals)
                quota[req.tenant] += want(req)
        room = min(budget - sum(quota.values()), budget // len(demand) * len(new))
        quota |= water_fill(room, {t: demand[t] for t in new})
        return Shares(min(budget, sum(quota.values())), quota, 0)

    def victim(self, candidates: list[Request], running: list[Request]) -> Request:
        seats = Counter(r.tenant for r in running)
        return max(reversed(candidates), key=lambda r: seats[r.tenant])  # first max: the last


def water_fill(budget: int, demand: dict[str | None, int]) -> dict[str | None, int]:
    """Max-min fair split of `budget`: each tenant gets min(demand, level), the level as high as
    the budget allows; tokens that do not divide evenly go one each to the first tenants."""
    quota = dict.fromkeys(demand, 0)
    left = {t: d for t, d in demand.items() if d > 0}
    while left and budget > 0:
        level = budget // len(left)
        small = {t: d for t, d in left.items() if d <= level}
        if not small:  # everyone wants more than the level: split what is left evenly
            for i, t in enumerate(left):
                quota[t] = level + (1 if i < budget - level * len(left) else 0)
            break
        for t, d in small.items():
            quota[t], budget = d, budget - d
            del left[t]
    return quota
