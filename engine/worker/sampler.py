"""Turn the logits of the sampled rows into token ids (and logprobs), batched over rows.

Order, as in vLLM: logprobs are taken from the raw logits; then logit_bias, min_tokens (EOS and
stop ids masked), repetition/frequency/presence penalties; greedy rows take the argmax; the rest
apply temperature, top_k, top_p, min_p and draw by inverse transform (one uniform number per row
against the row's cumulative distribution). A row with a seed draws its number from a generator
keyed by (seed, output index), so its tokens do not depend on which other requests share the
batch, nor on preemption.

Device: the sampler runs wherever the logits live. Every tensor it makes is put on the logits'
device; per-row parameters go over as one small tensor each, never per vocabulary entry. The
uniform numbers are drawn on the host (engine or per-row seeded generator) and copied over in one
tensor, so a seeded row picks the same token on any device. What comes back: the chosen ids in one
`.tolist()`, and logprobs only for the rows that asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.engine.outputs import TopLogprobs
from tierserve.engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]
    """Token ids min_tokens holds back: EOS (unless ignore_eos) and stop_token_ids."""
    request_id: str = ""
    """Whose row it is (a verified row has one per position)."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TopLogprobs | None]


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: list[int]) -> list[TopLogprobs]:
    """logprobs [R, V], chosen [R]: the chosen token's logprob and rank, plus max(n) top ones.

    Reads back whole tensors (one copy each from a device), not one element per row."""
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
    ranks = (logprobs > chosen_lp[:, None]).sum(1) + 1
    k = max(n) if n else 0
    top_v, top_i = (logprobs.topk(k, dim=-1) if k else (None, None))
    tv, ti = (top_v.tolist(), top_i.tolist()) if k else ([], [])
    out = []
    for r, (tok, lp, rank) in enumerate(zip(chosen.tolist(), chosen_lp.tolist(), ranks.tolist())):
        top = list(zip(ti[r][:n[r]], tv[r][:n[r]])) if n[r] else []
        out.append(TopLogprobs(tok, lp, rank, top))
    return out


class Sampler:
    def __init__(self, seed: int = 0, argmax=None):
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._argmax = argmax
        """A native row argmax for contiguous fp32 logits (a single pass, no thread wake-up)."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if (self._argmax is not None and logits.device.type == "cpu"
                and logits.dtype == torch.float32 and logits.is_contiguous()):
            return self._argmax(logits)
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        dev = logits.device
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lp_idx = torch.tensor(lp_rows, dtype=torch.long, device=dev) if lp_rows else None
        raw_lp = torch.log_softmax(logits.index_select(0, lp_idx), dim=-1) if lp_rows else None
        logits = self._process(logits, rows)
        tokens = self.argmax(logits)
        if not all(r.params.greedy for r in rows):
            greedy = torch.tensor([r.params.greedy for r in rows], device=dev)
            tokens = torch.where(greedy, tokens, self._draw(logits, rows))
        logprobs: list[TopLogprobs | None] = [None] * len(rows)
        if lp_rows:
            got = gather_logprobs(raw_lp, tokens.index_select(0, lp_idx),
                                  [rows[i].params.logprobs for i in lp_rows])
            for i, g in zip(lp_rows, got):
                logprobs[i] = g
        return SampleResult(tokens.tolist(), logprobs)

    # ---- logits processors -------------------------------------------------------------------

    def _process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        touched = False
        for i, r in enumerate(rows):
            p = r.params
            if not (p.logit_bias or len(r.output_token_ids) < p.min_tokens or p.needs_penalties):
                continue
            if not touched:
                logits, touched = logits.clone(), True
            row = logits[i]
            if p.logit_bias:
                ids = [t for t in p.logit_bias if 0 <= t < row.numel()]
                vals = [p.logit_bias[t] for t in ids]
                row.index_add_(0, torch.tensor(ids, dtype=torch.long, device=row.device),
                               torch.tensor(vals, dtype=row.dtype, device=row.device))
            if len(r.output_token_ids) < p.min_tokens and r.stop_ids:
                stop = torch.tensor(r.stop_ids, dtype=torch.long, device=row.device)
                row.index_fill_(0, stop, float("-inf"))
            if p.needs_penalties:
                self._penalize(row, r)
        return logits

    @staticmethod
    def _penalize(row: torch.Tensor, r: SampleRow) -> None:
        p = r.params
        if p.repetition_penalty != 1.0:
            # A token seen twice is gathered and written twice, with the same value both times
            # (computed from the unpenalized logit), so duplicates need no dedup on the host.
            seen = torch.tensor(r.prompt_token_ids + r.output_token_ids, dtype=torch.long,
                                device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            # scatter_add_, not bincount: bincount sizes its output from the max id, a device sync
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
            ones = torch.ones_like(out, dtype=row.dtype)
            counts = torch.zeros_like(row).scatter_add_(0, out, ones)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    # ---- random draw -------------------------------------------------------------------------

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([max(r.params.temperature, 1e-5) for r in rows], dtype=logits.dtype,
                            device=dev)
        logits = logits / temp[:, None]
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            logits = self._top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype,
                                 device=dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0)
        # One uniform number per row, against the row's cumulative distribution (in fp64: 49K
        # fp32 partial sums would drift). The exponential race (argmax of p / E) took one
        # exponential draw per vocabulary entry: ~75 ms a step at batch 64 on 2 cores.
        # Drawn on the host, then copied in one tensor (a no-op when the logits are on the CPU):
        # the same numbers, so the same tokens, on any device.
        u = torch.rand(len(rows), generator=self.generator, dtype=torch.float64, device="cpu")
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device="cpu")
                g.manual_seed(_row_seed(r.params.seed, len(r.output_token_ids)))
                u[i] = torch.rand(1, generator=g, dtype=torch.float64, device="cpu")
        u = u.to(dev)
        cdf = probs.to(torch.float64).cumsum(dim=-1)
        # u < 1 - 1e-12, so the target lies strictly below the total: the first entry whose
        # cumulative sum exceeds it exists and has a probability above zero.
        target = (u * (1 - 1e-12))[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        vocab, dev = logits.shape[-1], logits.device
        k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows],
                         device=dev)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop |= before >= top_p[:, None]
        drop[:, 0] = False
        return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _row_seed(seed: int, index: int) -> int:
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & _MASK64
