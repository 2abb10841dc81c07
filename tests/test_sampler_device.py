"""The sampler is device-agnostic: every tensor it makes lives on the logits' device, and the
tokens it picks are the ones the host sampler picked before it moved (recorded below), for the
same seeds. A batch mixes greedy rows, seeded temperature/top-k/top-p/min-p rows, penalties,
logit_bias, min_tokens and logprobs, over several steps whose tokens feed back (so penalties and
min_tokens change from step to step). No GPU here: a `meta` default device stands in for "some
other device", since any tensor made without `device=` lands there and cannot meet the logits."""

from __future__ import annotations

import pytest
import torch

from tierserve.engine.worker.sampler import Sampler, SampleRow
from tierserve.engine.sampling_params import SamplingParams as P

VOCAB = 512
EOS, STOP = 3, 11

# Recorded from the host sampler before it became device-agnostic (Sampler(seed=7), the logits
# of _run), one list per step, one token per row of _rows().
EXPECTED_TOKENS = [
    [44, 234, 421, 121, 409, 411, 439, 31, 338],
    [231, 194, 220, 323, 424, 305, 50, 223, 288],
    [403, 191, 176, 272, 277, 351, 40, 195, 417],
    [222, 414, 294, 256, 333, 3, 40, 206, 6],
    [339, 461, 77, 431, 434, 3, 11, 2, 204],
    [107, 357, 95, 445, 468, 3, 266, 186, 473],
]
# Rows 5 and 6 ask for logprobs: (token, logprob, rank, top ids) per step.
EXPECTED_LOGPROBS = [
    [(411, -2.0794, 1, [411, 382, 1]), (439, -1.5303, 1, [])],
    [(305, -1.8163, 1, [305, 141, 507]), (50, -0.9276, 1, [])],
    [(351, -1.8441, 1, [351, 100, 363]), (40, -5.1688, 30, [])],
    [(3, -8.6463, 195, [485, 324, 328]), (40, -4.3782, 16, [])],
    [(3, -3.4375, 5, [270, 458, 35]), (11, -5.9599, 31, [])],
    [(3, -16.9208, 507, [252, 424, 34]), (266, -1.2477, 1, [])],
]


def _rows() -> list[SampleRow]:
    spec = [
        (P(temperature=0.0), ()),
        (P(temperature=0.8, top_k=20, seed=1), ()),
        (P(temperature=1.0, top_p=0.9, seed=2), ()),
        (P(temperature=1.2, min_p=0.05, seed=3), ()),
        (P(temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5,
           presence_penalty=0.3, seed=4), ()),
        # the bias makes EOS the argmax: min_tokens must hold it back for three steps
        (P(temperature=0.0, logit_bias={EOS: 100.0, 7: -100.0}, min_tokens=3, logprobs=3),
         (EOS, STOP)),
        (P(temperature=0.9, seed=6, logit_bias={STOP: 8.0, 40: 5.0}, min_tokens=2, logprobs=0),
         (EOS, STOP)),
        (P(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0), ()),
        (P(temperature=1.0, top_k=5), ()),  # unseeded: draws from the engine generator
    ]
    prompt = list(range(0, 64, 3)) + [6, 6, 9, 40]  # repeats: penalized once each
    return [SampleRow(p, prompt, [], stop) for p, stop in spec]


def _run(dtype=torch.float32, default_device: str | None = None):
    sampler, rows = Sampler(seed=7), _rows()
    gen = torch.Generator().manual_seed(11)
    tokens, logprobs = [], []
    for _ in range(len(EXPECTED_TOKENS)):
        logits = (torch.randn(len(rows), VOCAB, generator=gen, device="cpu") * 3).to(dtype)
        if default_device is None:
            res = sampler(logits, rows)
        else:
            with torch.device(default_device):
                res = sampler(logits, rows)
        for r, t in zip(rows, res.token_ids):
            r.output_token_ids.append(t)
        tokens.append(res.token_ids)
        logprobs.append([None if x is None else (x.token_id, x.logprob, x.rank,
                                                 [t for t, _ in x.top]) for x in res.logprobs])
    return tokens, logprobs


def _check(tokens, logprobs) -> None:
    assert tokens == EXPECTED_TOKENS
    for step, want in zip(logprobs, EXPECTED_LOGPROBS):
        assert [lp is None for lp in step] == [i not in (5, 6) for i in range(len(step))]
        for got, (tok, lp, rank, top) in zip(step[5:7], want):
            assert (got[0], got[2], got[3]) == (tok, rank, top)
            assert got[1] == pytest.approx(lp, abs=1e-3)


def test_same_tokens_as_the_host_sampler():
    _check(*_run())


def test_float64_logits_pick_the_same_tokens():
    _check(*_run(torch.float64))


def test_every_tensor_lives_on_the_logits_device():
    # Any tensor made without an explicit device lands on `meta` here and cannot be combined
    # with the CPU logits, nor read back: the run fails unless the sampler names its devices.
    _check(*_run(default_device="meta"))


def test_seeded_rows_do_not_depend_on_the_engine_seed():
    seeded = [1, 2, 3, 4, 6]
    a, b = Sampler(seed=7), Sampler(seed=99)
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    ta, tb = a(logits, _rows()).token_ids, b(logits, _rows()).token_ids
    assert [ta[i] for i in seeded] == [tb[i] for i in seeded] == \
        [EXPECTED_TOKENS[0][i] for i in seeded]


def test_repeated_ids_are_penalized_once_and_counted_per_occurrence():
    logits = torch.zeros(1, VOCAB)
    logits[:, 6], logits[:, 7] = 2.0, 0.9

    def pick(prompt, output, **params):
        row = SampleRow(P(temperature=0.0, **params), prompt, output, ())
        return Sampler()(logits, [row]).token_ids[0]

    # repetition: 2.0 / 2 = 1.0 still beats 0.9; dividing once per occurrence (0.25) would not
    assert pick([6, 6, 6], [6], repetition_penalty=2.0) == 6
    # frequency per occurrence, presence once: 2.0 - 2 * 0.3 - 0.1 = 1.3 > 0.9 ...
    assert pick([], [6, 6], frequency_penalty=0.3, presence_penalty=0.1) == 6
    # ... and 2.0 - 4 * 0.3 - 0.1 = 0.7 < 0.9
    assert pick([], [6, 6, 6, 6], frequency_penalty=0.3, presence_penalty=0.1) == 7
