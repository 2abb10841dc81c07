"""The sampler's random draw on its own: the tokens it picks follow the distribution the
parameters define, masked tokens never come out, and a seeded row's token depends only on its
seed and output index."""

from __future__ import annotations

import math

import torch

from tierserve.engine.worker.sampler import Sampler, SampleRow
from tierserve.engine.sampling_params import SamplingParams

VOCAB = 1000


def _logits(probs: dict[int, float], rows: int) -> torch.Tensor:
    """Rows of logits whose softmax is `probs` (every other token: probability ~0)."""
    x = torch.full((rows, VOCAB), -1e4)
    for tok, p in probs.items():
        x[:, tok] = math.log(p)
    return x


def _rows(n: int, **params) -> list[SampleRow]:
    return [SampleRow(SamplingParams(max_tokens=8, **params), [1, 2], [], ()) for _ in range(n)]


def test_draws_follow_the_distribution():
    probs = {7: 0.5, 300: 0.3, 999: 0.15, 0: 0.05}
    n = 20000
    tokens = Sampler(seed=1)(_logits(probs, n), _rows(n, temperature=1.0)).token_ids
    counts = {t: tokens.count(t) for t in set(tokens)}
    assert set(counts) == set(probs)
    for t, p in probs.items():  # 5 standard deviations of a binomial count
        assert abs(counts[t] - n * p) < 5 * math.sqrt(n * p * (1 - p)), (t, counts[t])


def test_temperature_flattens_and_sharpens():
    probs = {1: 0.8, 2: 0.2}
    n = 8000
    hot = Sampler(seed=2)(_logits(probs, n), _rows(n, temperature=2.0)).token_ids
    # T = 2: p ~ sqrt(p), renormalized: 0.8^0.5 / (0.8^0.5 + 0.2^0.5) = 2/3
    assert abs(hot.count(1) / n - 2 / 3) < 0.03
    cold = Sampler(seed=2)(_logits(probs, n), _rows(n, temperature=0.25)).token_ids
    assert cold.count(1) / n > 0.99  # 0.8^4 / (0.8^4 + 0.2^4) = 0.996


def test_top_k_top_p_min_p_never_draw_masked_tokens():
    probs = {10: 0.4, 20: 0.3, 30: 0.2, 40: 0.1}
    n = 4000
    for params, allowed in ((dict(top_k=2), {10, 20}), (dict(top_p=0.65), {10, 20}),
                            (dict(min_p=0.6), {10, 20}), (dict(top_k=1), {10})):
        tokens = Sampler(seed=3)(_logits(probs, n), _rows(n, temperature=1.0, **params)).token_ids
        assert set(tokens) == allowed, params


def test_seeded_row_ignores_its_neighbours():
    probs = {t: 1 / 50 for t in range(0, 1000, 20)}  # 50 equally likely tokens
    seeded = SampleRow(SamplingParams(max_tokens=8, temperature=1.0, seed=42), [5], [3, 4], ())
    alone = Sampler(seed=0)(_logits(probs, 1), [seeded]).token_ids[0]
    for batch_seed, pos in ((1, 0), (2, 5), (3, 9)):
        rows = _rows(10, temperature=1.0)
        rows[pos] = seeded
        got = Sampler(seed=batch_seed)(_logits(probs, 10), rows).token_ids
        assert got[pos] == alone
    # the next output index draws anew: over 20 indices, more than one token comes out
    picks = {Sampler(seed=0)(_logits(probs, 1), [SampleRow(seeded.params, [5], [3] * i, ())])
             .token_ids[0] for i in range(20)}
    assert len(picks) > 1
