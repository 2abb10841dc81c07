"""Draft-model proposals: a smaller model with the target's vocabulary proposes k tokens by
greedy decoding, on its own runner and its own paged KV cache (its blocks are taken from the same
memory budget as the target's: the engine splits it).

Each request has a shadow sequence in the draft's cache. At every proposal the shadow's tokens
become the request's tokens; what the draft computed before stays valid up to the first position
where the two disagree (a rejected proposal), so a step costs one catch-up chunk (the kept tokens,
or the whole prompt the first time) and k - 1 one-token decodes, batched over the requests."""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from tierserve.engine.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(eq=False)
class _Shadow:
    seq: Request
    """Its prompt is the request's tokens, its output the proposals of the current step."""


class DraftModelProposer:
    def __init__(self, runner, num_blocks: int, block_size: int, max_batched_tokens: int):
        self.runner = runner
        """The draft's ModelRunner (its own weights and KV cache)."""
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        self.max_batched_tokens = max_batched_tokens
        self._shadows: dict[RequestId, _Shadow] = {}

    def propose(self, rows: list[tuple[Request, int]]) -> dict[RequestId, list[int]]:
        live = [(sh, k) for req, k in rows if (sh := self._sync(req, k)) is not None]
        out: dict[RequestId, list[int]] = {}
        for sh, tok in self._catch_up([sh for sh, _ in live]):
            sh.seq.output_token_ids.append(tok)
        for j in range(1, max((k for _, k in live), default=0)):
            step = [sh for sh, k in live if k > j]
            for sh, tok in zip(step, self._decode(step)):
                sh.seq.output_token_ids.append(tok)
        for sh, _ in live:
            out[sh.seq.request_id] = list(sh.seq.output_token_ids)
        return out

    def release(self, request_id: RequestId) -> None:
        sh = self._shadows.pop(request_id, None)
        if sh is not None:
            self.pool.free(sh.seq.block_ids)

    def _sync(self, req: Request, k: int) -> _Shadow | None:
        """The request's shadow with the request's tokens, its valid KV cut back to their common
        prefix and blocks for k more positions; None when the draft's pool is out of blocks."""
        sh = self._shadows.get(req.request_id)
        if sh is None:
            sh = _Shadow(Request(req.request_id, [], _GREEDY, 0))
            self._shadows[req.request_id] = sh
        seq, tokens = sh.seq, req.all_token_ids
        common = _common_prefix(seq.all_token_ids, tokens)
        seq.prompt_token_ids, seq.output_token_ids = tokens, []
        seq.num_computed_tokens = min(seq.num_computed_tokens, common, len(tokens) - 1)
        need = -(-(len(tokens) + k) // self.pool.block_size) - len(seq.block_ids)
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                return None
            seq.block_ids.extend(new)
        return sh

    def _catch_up(self, shadows: list[_Shadow]) -> list[tuple[_Shadow, int]]:
        """Run each shadow up to its last token (chunks within the token budget); its first
        proposal is the draft's argmax there."""
        firsts: list[tuple[_Shadow, int]] = []
        pending = list(shadows)
        while pending:
            batch, budget = [], self.max_batched_tokens
            for sh in pending:
                seq = sh.seq
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n <= 0:
                    break
                start = seq.num_computed_tokens
                batch.append(ScheduledRequest(seq, start, n, tuple(seq.block_ids),
                                              start + n == seq.num_tokens))
                budget -= n
            batch.sort(key=lambda s: s.num_new_tokens != 1)
            res = self.runner.execute(SchedulerOutput(tuple(batch),
                                                      self.max_batched_tokens - budget))
            for s in batch:
                s.request.num_computed_tokens = s.start + s.num_new_tokens
            done = {s.request.request_id for s in batch if s.samples}
            firsts += [(sh, res.sampled[sh.seq.request_id][0]) for sh in pending
                       if sh.seq.request_id in done]
            pending = [sh for sh in pending if sh.seq.request_id not in done]
        return firsts

    def _decode(self, shadows: list[_Shadow]) -> list[int]:
        """One greedy token for each shadow, after its newest proposal."""
        batch = []
        for sh in shadows:
            seq = sh.seq
            batch.append(ScheduledRequest(seq, seq.num_tokens - 1, 1, tuple(seq.block_ids), True))
        res = self.runner.execute(SchedulerOutput(tuple(batch), len(batch)))
        for s in batch:
            s.request.num_computed_tokens = s.start + 1
        return [res.sampled[sh.seq.request_id][0] for sh in shadows]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
