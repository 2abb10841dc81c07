"""A small synthetic Gemma 3 GGUF (random weights, llama.cpp's layout and tensor types) and the
transformers model that reads the same file, for tests/test_gemma3.py.

The file mixes the types a real Q4_K_M Gemma 3 carries (F32 norms, Q8_0, Q5_0, Q4_K, Q6_K) with
Q4_0 and F16. The gguf package quantizes only the simpler block types, so the K-quant tensors are
random blocks with small fp16 scales: whatever they decode to is the weight both models read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 256, 6, 4, 2, 256
"""Six layers: five windowed, the sixth attends to the whole context (llama.cpp's pattern).
head_dim 256 as Gemma 3's: transformers' GGUF config leaves query_pre_attn_scalar at 256."""
WINDOW = 8
VOCAB = 96
BOS, EOS = 2, 1

TYPES = {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "F16", "attn_v": "Q8_0",
         "attn_output": "Q4_K", "ffn_gate": "Q4_0", "ffn_up": "F32", "ffn_down": "Q6_K"}
"""GGUF type per tensor kind (Q4_K and Q6_K need inputs of whole 256-wide super-blocks:
attn_output takes HEADS * HEAD_DIM, ffn_down INTER)."""

_K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}
"""Bytes per super-block and the offsets of its fp16 super-scales (d, and Q4_K's dmin)."""


@dataclass(frozen=True)
class GemmaFile:
    dir: Path
    name: str

    @property
    def path(self) -> str:
        return str(self.dir / self.name)


def tokens() -> list[str]:
    """A byte-level vocabulary ('gpt2' tokenizer model, no merges): ids name single characters."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return ["<pad>", "<eos>", "<bos>"] + alphabet[:VOCAB - 3]


def _k_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """Random K-quant super-blocks whose fp16 scales are small (weights of a few tenths)."""
    size, scales = _K_BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scales:
        d = (rng.uniform(1e-4, 3e-4, raw.shape[:2])).astype(np.float16)
        raw[:, :, at:at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _add(writer, rng: np.random.Generator, name: str, kind: str, shape: tuple[int, int],
         std: float) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in _K_BLOCKS:
        writer.add_tensor(name, _k_blocks(rng, *shape, kind), raw_dtype=qtype)
        return
    w = (rng.standard_normal(shape) * std).astype(np.float32)
    if kind == "F32":
        writer.add_tensor(name, w)
    elif kind == "F16":
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def _metadata(writer) -> None:
    toks = tokens()
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(WINDOW)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(toks)
    writer.add_token_types([3, 3, 3] + [1] * (len(toks) - 3))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)


def write_gemma3_gguf(directory: Path, seed: int = 0, types: dict[str, str] = TYPES) -> GemmaFile:
    """The file, written as llama.cpp's converter writes Gemma 3: norms stored as 1 + w."""
    import gguf

    rng = np.random.default_rng(seed)
    name = "gemma3-tiny.gguf"
    writer = gguf.GGUFWriter(str(directory / name), "gemma3")
    _metadata(writer)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    _add(writer, rng, "token_embd.weight", types["token_embd"], (VOCAB, HIDDEN), 0.15)
    shapes = {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, q), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for kind, shape in shapes.items():
            _add(writer, rng, f"blk.{i}.{kind}.weight", types[kind], shape, 0.1)
        for norm, width in (("attn_norm", HIDDEN), ("post_attention_norm", HIDDEN),
                            ("ffn_norm", HIDDEN), ("post_ffw_norm", HIDDEN),
                            ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              (1 + 0.5 * rng.standard_normal(width)).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GemmaFile(directory, name)


def transformers_model(f: GemmaFile):
    """transformers' own GGUF loader over the same file (its config mapping, its name table, its
    1 + w undone): Gemma3ForCausalLM in fp32 with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(f.dir), gguf_file=f.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy continuation, recomputed over the whole sequence each token:
    (tokens, each token's logprob, the prompt tokens' logprobs from position 1)."""
    import torch

    ids = list(prompt)
    out, lps = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            if not out:
                prompt_lps = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
            tok = int(logp[-1].argmax())
            out.append(tok)
            lps.append(float(logp[-1, tok]))
            ids.append(tok)
    return out, lps, prompt_lps


def write_hf_dir(directory: Path, seed: int = 0):
    """A Hugging Face directory (config.json, model.safetensors, tokenizer.json) of a random
    Gemma3ForCausalLM whose config takes the paths a GGUF does not: its own layer_types,
    query_pre_attn_scalar apart from head_dim, linear RoPE scaling on the whole-context layers.
    Returns transformers' model (fp32, eager attention)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=48,
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if "norm" in name else 0.15 if "embed" in name else 0.1)
    model.save_pretrained(str(directory))
    vocab = {t: i for i, t in enumerate(tokens())}
    Tokenizer(models.BPE(vocab=vocab, merges=[])).save(str(directory / "tokenizer.json"))
    return model
