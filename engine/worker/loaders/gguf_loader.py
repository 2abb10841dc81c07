"""Llama-family and Gemma 3 GGUF files: metadata to ModelConfig, tensors dequantized to fp32 HF
names."""

from __future__ import annotations

import dataclasses
import logging
import os
from functools import partial

import numpy as np
import torch

from tierserve.engine.config import ModelConfig
from tierserve.engine.worker.loaders.source import (ModelLoadError, ModelSource, QuantBlocks, file_digest,
                                             one_line)
from tierserve.engine.worker.loaders.gguf_blocks import HEAD_BYTES, dequantize
from tierserve.engine.worker.loaders.gguf_file import read_gguf
from tierserve.engine.worker.loaders.gguf_kquants import (KQUANT_TYPES,
                                                    dequantize as kquant_dequantize)
from tierserve.engine.worker.loaders.lazy import Entry, LazyWeights, cut_tensor
from tierserve.engine.worker.loaders.validate import check_weights
from tierserve.engine.chat_templates import BUILTIN_TEMPLATES
from tierserve.engine.tokenizer import TokenizerInfo, from_gguf_fields

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
QUANT_BLOCK_TYPES = tuple(HEAD_BYTES)
"""Block types whose weights --quantization gguf keeps as they are (engine/worker/quant.py), the
ones gguf_blocks.py decodes."""

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_LAYER_NAMES = {"gemma3": {
    **_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}}
"""Families whose layer tensors map otherwise (Gemma 3 norms both sides of attention and MLP)."""
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head", "rope_freqs": "rope_freqs"}
NORM_SHIFTED = ("gemma3",)
"""Families whose norm weights llama.cpp's converter stores as 1 + w (HF's w plus Gemma's
offset): the loader subtracts 1, as transformers' GGUF loader does (Gemma2TensorProcessor)."""
GEMMA3_SLIDING_PATTERN = 6
"""llama.cpp's Gemma 3 (set_swa_pattern(6)): layer i is windowed unless i % 6 == 5, HF's
default layer_types; the file stores only the window."""
GEMMA3_LOCAL_ROPE_BASE = 10000.0
"""The windowed layers' RoPE base where the file has no rope.freq_base_swa (llama.cpp's)."""


def _hf_name(name: str, arch: str = "llama") -> str | None:
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES).get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    hf = _TOP_NAMES.get(base)
    return f"{hf}.{kind}" if hf else None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved RoPE pairs back to halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAZY_TYPES = ("F32", "F16", "BF16", *QUANT_BLOCK_TYPES, *KQUANT_TYPES)
"""Types read (and decoded) only when the model copies the tensor in; any other type is decoded
at load, so a type nothing here can decode is refused before the model is built."""


def load_gguf(path: str, lazy: bool = True) -> ModelSource:
    """The file's config, tokenizer and weights. `lazy`: each tensor is decoded from the memory
    map when the model reads it and kept by nobody (the host then holds one fp32 tensor beside
    the model, not a second fp32 copy of every weight); else all are decoded now into a dict
    (loaders.KEEP_LAST_GGUF's cache shares that between the test suite's engines)."""
    try:
        reader = read_gguf(path)
    except Exception as e:  # ValueError/struct errors on truncated files
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({one_line(e)})") from None
    _check_size(path, reader)
    fields = reader.fields
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    config = _config(path, fields, arch)
    weights, blocks = {}, {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        if not lazy:
            weights[name] = _tensor(path, t, name, config)
        elif t.tensor_type.name in LAZY_TYPES:
            weights[name] = Entry(shape, partial(_read_tensor, path, t, name, config))
        else:  # decoded now: a type nothing here decodes is refused before the model is built
            weights[name] = _held(_tensor(path, t, name, config))
        if t.tensor_type.name in (*QUANT_BLOCK_TYPES, *KQUANT_TYPES) and name.endswith(".weight"):
            blocks[name] = QuantBlocks(t.data, t.tensor_type.name, shape,
                                       _rope_heads(name, config))
    if lazy:
        weights = LazyWeights(weights)
    config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in weights)
    check_weights(path, config, weights)
    return ModelSource(config, weights, _tokenizer(path, fields), file_digest([path]), path,
                       blocks)


def _rope_heads(name: str, config: ModelConfig) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor (q and k of Llama and Mistral)."""
    if config.architecture not in ("llama", "mistral"):
        return None
    if name.endswith("q_proj.weight"):
        return config.num_heads
    return config.num_kv_heads if name.endswith("k_proj.weight") else None


def _check_size(path: str, reader) -> None:
    """The reader memory-maps the file and does not notice tensor data cut short."""
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    size = os.path.getsize(path)
    if end > size:
        raise ModelLoadError(f"{path}: truncated GGUF file ({size} bytes, its tensors need {end})")


def _held(t: torch.Tensor) -> Entry:
    """A tensor decoded at load, behind a LazyWeights entry."""
    return Entry(tuple(t.shape), partial(cut_tensor, t))


def _read_tensor(path: str, t, name: str, config: ModelConfig, index) -> torch.Tensor:
    """A LazyWeights entry's read: the tensor decoded now (a tensor parallel rank's part cut
    from it)."""
    return cut_tensor(_tensor(path, t, name, config), index)


def _tensor(path: str, t, name: str, config: ModelConfig) -> torch.Tensor:
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))
    try:
        if t.tensor_type.name in QUANT_BLOCK_TYPES:  # torch over the whole tensor, gguf's values
            arr = dequantize(t.data, t.tensor_type.name, shape).numpy()
        elif t.tensor_type.name in KQUANT_TYPES:  # the same, but not kept as blocks
            arr = kquant_dequantize(t.data, t.tensor_type.name, shape).numpy()
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise ModelLoadError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, "
                             f"which the gguf package cannot dequantize") from None
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name} ({t.tensor_type.name}) is unreadable "
                             f"({one_line(e)})") from None
    if config.architecture in NORM_SHIFTED and name.endswith("norm.weight"):
        arr = arr - np.float32(1)  # stored as 1 + w; the model adds the 1 back in fp32
    if config.architecture in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_heads if "q_proj" in name else config.num_kv_heads
        if arr.ndim != 2 or arr.shape[0] % (2 * heads):
            raise ModelLoadError(f"{path}: tensor {t.name} has shape {arr.shape}, "
                                 f"not {heads} heads of an even width")
        arr = unpermute_rope(arr, heads)
    if not arr.flags.writeable:  # an F32 tensor is a view of the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr))


def _tokenizer(path: str, fields: dict) -> TokenizerInfo:
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    try:  # the whole metadata: the vocabulary, its scores and flags, the architecture
        info = from_gguf_fields(fields)
    except Exception as e:
        raise ModelLoadError(f"{path}: unusable tokenizer metadata ({one_line(e)})") from None
    arch = fields.get("general.architecture")
    if info.chat_template is None and arch in BUILTIN_TEMPLATES:
        log.info("%s has no chat template: %s's own (engine/chat_templates.py; --chat-template "
                 "replaces it)", os.path.basename(path), arch)
        info = dataclasses.replace(info, chat_template=BUILTIN_TEMPLATES[arch])
    return info


def _rope_scaling(path: str, g) -> dict | None:
    """llama.cpp's rope.scaling.* keys as an HF rope_scaling dict (Llama 3's scaling comes as the
    rope_freqs tensor instead, see LlamaForCausalLM.load_weights)."""
    kind = g("rope.scaling.type")
    factor = g("rope.scaling.factor") or g("rope.scale_linear")
    if kind is None and factor and float(factor) != 1.0:
        kind = "linear"  # old files: rope.scale_linear alone
    if kind in (None, "none"):
        return None
    if kind in ("linear", "yarn") and not factor:
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} without rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        s = {"rope_type": "yarn", "factor": float(factor)}
        orig = g("rope.scaling.original_context_length")
        if orig:
            s["original_max_position_embeddings"] = int(orig)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if g(f"rope.scaling.{key}"):
                s[name] = float(g(f"rope.scaling.{key}"))
        return s
    raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported "
                         f"(supported: linear, yarn)")


def _config(path: str, fields: dict, arch: str) -> ModelConfig:
    need = [f"{arch}.{k}" for k in ("attention.head_count", "embedding_length",
                                     "feed_forward_length", "block_count")]
    missing = [k for k in need if not isinstance(fields.get(k), (int, np.integer))]
    if missing:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", 0) or hidden // heads)
    tokens = fields.get("tokenizer.ggml.tokens") or []
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eot = fields.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(x) for x in (eos, eot, *_end_of_turn(arch, tokens))
                            if x is not None}))
    family = _gemma3(path, g, hidden // heads, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(g("vocab_size", 0) or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(path, g),
        max_position_embeddings=int(g("context_length", 4096)),
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        **family,
    )


def _gemma3(path: str, g, head_width: int, head_dim: int) -> dict:
    """Gemma 3's fields beyond the Llama family's, as llama.cpp reads the file (llama-model.cpp):
    the window on five of every six layers, their RoPE base, and the attention scale: 27B (62
    blocks) scales by (hidden / heads)**-0.5 (HF's query_pre_attn_scalar 168 there), every other
    size by head_dim**-0.5 (256: HF's value on those)."""
    window, layers = g("attention.sliding_window"), int(g("block_count"))
    if not isinstance(window, (int, np.integer)) or window < 1:
        raise ModelLoadError(f"{path}: GGUF metadata lacks gemma3.attention.sliding_window")
    return dict(
        hidden_act="gelu_pytorch_tanh", sliding_window=int(window),
        sliding_layers=tuple(i for i in range(layers)
                             if i % GEMMA3_SLIDING_PATTERN != GEMMA3_SLIDING_PATTERN - 1),
        rope_local_base_freq=float(g("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        query_pre_attn_scalar=float(head_width if layers == 62 else head_dim))


def _end_of_turn(arch: str, tokens: list[str]) -> tuple[int, ...]:
    """Gemma 3's <end_of_turn>, which ends a chat turn (HF's generation_config lists it beside
    <eos>; llama.cpp finds it by its text, as here) where the file names no eot token."""
    if arch != "gemma3" or "<end_of_turn>" not in tokens:
        return ()
    return (tokens.index("<end_of_turn>"),)
