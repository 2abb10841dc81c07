"""Greedy token ids equal Hugging Face transformers' generate on the same GGUF, in fp32."""

from __future__ import annotations

import pytest
import torch

from tierserve.engine import LLM, SamplingParams

NEW_TOKENS = 32
"""Enough to see a divergence start (a wrong kernel breaks ties within a few tokens) at half the
cost of 64 on a 2-core box."""
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_outputs(hf_model, varied_prompts) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, generated in left-padded batches of similar
    lengths (1-333, 512-900, 1,100-1,500 tokens) with an attention mask: the same tokens as one
    prompt at a time (checked for these prompts), in less than half the time."""
    hf_model.generation_config.eos_token_id = None  # as ignore_eos: never stop early
    outs = []
    for group in (varied_prompts[:10], varied_prompts[10:13], varied_prompts[13:]):
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        seq = hf_model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
        outs += [row[width:].tolist() for row in seq]
    return outs


@pytest.mark.slow
def test_each_prompt_alone_matches_transformers(llm, varied_prompts, hf_outputs):
    """Five of the prompts one at a time (1 to 1,500 tokens; the batched test takes all 16)."""
    assert max(map(len, varied_prompts)) == 1500 and min(map(len, varied_prompts)) == 1
    alone = [0, 4, 8, 12, 15]
    for i in alone:
        got = llm.generate([varied_prompts[i]], GREEDY)[0].outputs[0].token_ids
        assert got == hf_outputs[i], f"prompt of {len(varied_prompts[i])} tokens diverges"


@pytest.mark.slow
def test_one_continuous_batch_with_chunked_prefill_matches_transformers(varied_prompts, hf_outputs):
    # A 256-token step budget is far below the 1,500-token prompt: prefills are chunked and
    # share steps with the decodes of the shorter prompts.
    llm = LLM(kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=256, max_num_seqs=16,
              quantization="gguf-exact")  # the GGUF's blocks, the fp32 path's bits
    outs = llm.generate(varied_prompts, GREEDY)
    for prompt, out, expected in zip(varied_prompts, outs, hf_outputs):
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverges"
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
