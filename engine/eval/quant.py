"""Teacher-forced quality of a quantization against another path: llama.cpp's perplexity method
(tests/test_quant.py, bench/quant.py).

The text's token ids are cut into windows; each window runs as one prompt with prompt logprobs,
and every position past the window's first `warmup` tokens is scored: the top-1 prediction and
-log p(true next token). Two engines that score the same ids compare by top-1 agreement and by
perplexity (sparse_eval's ModeResult and agreement).
"""

from __future__ import annotations

from tierserve.engine.llm import LLM
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.eval.sparse import ModeResult, agreement

__all__ = ["agreement", "perplexity_change", "score"]


def score(llm: LLM, ids: list[int], window: int = 512, warmup: int = 64) -> ModeResult:
    """Scores of every position past each window's warm-up (windows side by side in a batch)."""
    windows = [ids[i:i + window] for i in range(0, len(ids) - warmup - 1, window)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    s = ModeResult()
    for out in outs:
        lps = out.prompt_logprobs  # position p: logprob of token p given those before it
        for p in range(warmup + 1, len(lps)):
            lp = lps[p]
            s.top1.append(lp.top[0][0])
            s.nll.append(-lp.logprob)
    return s


def perplexity_change(test: ModeResult, reference: ModeResult) -> float:
    """Relative change of perplexity, e.g. 0.004 for +0.4%."""
    return test.perplexity / reference.perplexity - 1
