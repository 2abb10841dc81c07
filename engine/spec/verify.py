"""The acceptance rule: which of a request's proposed tokens the target keeps.

The runner samples the target at every position of a speculating row (the position after the
request's last token, then after each proposal), each with the logits processors and the seeded
uniform number that position would have had without speculation. Proposals are one-hot (the
n-gram's continuation, or the draft model's argmax), and for a one-hot proposal q = 1{d} the
rejection rule "accept d with probability min(1, p(d) / q(d)), else draw from the normalised
residual max(0, p - q)" is exactly "draw x ~ p; keep d if x == d, else keep x": both accept d
with probability p(d), and both give p restricted to the other tokens, renormalised, otherwise.
So a row keeps the longest prefix of its proposals that the target's own draws confirm, plus the
target's draw at the first disagreement (or the bonus draw after the last proposal). Greedy rows
are the temperature-0 case. A seeded request gets the very tokens it gets without speculation.
"""

from __future__ import annotations

from typing import Callable, Sequence

AcceptRule = Callable[[Sequence[int], Sequence[int]], int]
"""(proposals [k], target draws [k + 1]) -> how many proposals are accepted (0..k)."""


def accepted_prefix(proposals: Sequence[int], draws: Sequence[int]) -> int:
    """The number of leading proposals the target's draws confirm."""
    n = 0
    for d, x in zip(proposals, draws):
        if d != x:
            break
        n += 1
    return n


def kept_tokens(proposals: Sequence[int], draws: Sequence[int],
                rule: AcceptRule = accepted_prefix) -> list[int]:
    """The tokens a verified row appends: its accepted proposals, then the target's draw."""
    n = rule(proposals, draws)
    return list(proposals[:n]) + [draws[n]]
