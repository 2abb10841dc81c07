"""Teacher-forced comparison of decode modes over one text: the measure behind sparse decode's
accuracy (tests/test_sparse_engine.py, bench/sparse.py).

Every mode runs the same token ids as its own sequence, side by side in one batch: a dense
prefill of the first `start` tokens (computed once, its KV copied to each mode's blocks), then
one decode step per position, each fed the text's true token. At each position the logits give
the mode's top-1 prediction and the negative log-likelihood of the true next token. Blocks come
from the engine's pool and go back to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tierserve.engine.core.kv_hints import KVHints
from tierserve.engine.llm_engine import LLMEngine
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModeResult:
    top1: list[int] = field(default_factory=list)
    """The predicted next token at each decoded position."""
    nll: list[float] = field(default_factory=list)
    """-log p(true next token) at each decoded position."""

    @property
    def perplexity(self) -> float:
        return float(torch.tensor(self.nll).mean().exp())


def agreement(a: ModeResult, b: ModeResult) -> float:
    """Share of positions where both modes predict the same next token."""
    return sum(x == y for x, y in zip(a.top1, b.top1)) / max(1, len(a.top1))


def teacher_forced(engine: LLMEngine, ids: list[int], start: int, modes: list[bool | None],
                   progress: Callable[[int, int], None] | None = None) -> list[ModeResult]:
    """Decode positions start .. len(ids) - 2 of `ids` once per mode (a sparse_attention hint:
    True, False or None for the engine's default), feeding the true tokens."""
    runner, bs = engine.executor.runner, engine.executor.runner.block_size
    nb = -(-len(ids) // bs)
    blocks = engine.pool.allocate(nb * len(modes))
    if blocks is None:
        raise ValueError(f"teacher_forced needs {nb * len(modes)} free KV blocks")
    try:
        reqs = [Request(RequestId(f"tf{i}"), list(ids), SamplingParams(max_tokens=1, temperature=0),
                        1, hints=KVHints(sparse_attention=m)) for i, m in enumerate(modes)]
        tables = [tuple(blocks[i * nb:(i + 1) * nb]) for i in range(len(modes))]
        budget = runner.config.scheduler.max_num_batched_tokens
        for a in range(0, start, budget):  # one dense prefill, one chunk per step
            n = min(budget, start - a)
            step = ScheduledRequest(reqs[0], a, n, tables[0][:-(-(a + n) // bs)], False)
            runner.execute(SchedulerOutput((step,), n))
        filled = list(tables[0][:-(-start // bs)])
        for table in tables[1:]:  # the same prefix's KV for every other mode
            runner.write_blocks(list(table[:len(filled)]), runner.gather_blocks(filled))
        results = [ModeResult() for _ in modes]
        last = len(ids) - 1
        for p in range(start, last):
            steps = tuple(ScheduledRequest(r, p, 1, t[:p // bs + 1], True)
                          for r, t in zip(reqs, tables))
            logp = torch.log_softmax(runner.logits(SchedulerOutput(steps, len(steps))), dim=-1)
            for res, row in zip(results, logp):
                res.top1.append(int(row.argmax()))
                res.nll.append(-float(row[ids[p + 1]]))
            if progress is not None:
                progress(p - start + 1, last - start)
        return results
    finally:
        engine.pool.free(blocks)
