"""What a loader hands the engine: the model's config, weights, tokenizer and identity, and the
one error every loader raises. The loaders (gguf_loader, hf) build on this module; the package
(loaders/__init__.py) picks one by path."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tierserve.engine.config import ModelConfig
from tierserve.engine.tokenizer import TokenizerInfo
from tierserve.engine.model_names import ModelLoadError


def one_line(e: BaseException) -> str:
    """An underlying library's exception as a short single line, for a ModelLoadError message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


@dataclass
class ModelSource:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    """Tensors under Hugging Face Llama names (model.layers.0.self_attn.q_proj.weight ...): a
    GGUF's dequantized dict, or a safetensors folder's LazyWeights (loaders/lazy.py), which reads
    each tensor from the file when it is asked for, in the checkpoint's dtype."""
    tokenizer: TokenizerInfo
    digest: str
    """Identity of the weights, part of every KV block's hash."""
    path: str
    blocks: dict[str, QuantBlocks] = dataclasses.field(default_factory=dict)
    """A GGUF's Q4_0 / Q4_1 / Q8_0 weights as the file stores them (views of its memory map),
    under the same names: --quantization gguf packs these, not the dequantized copies."""


@dataclass(frozen=True)
class QuantBlocks:
    """One tensor's quantized blocks, undecoded: the bytes, the block type, the [out, in] shape,
    and the head count whose RoPE row order llama.cpp permuted (None: not permuted)."""

    raw: object
    kind: str
    shape: tuple[int, int]
    rope_heads: int | None = None


def file_digest(paths: list[str]) -> str:
    """Cheap, stable identity: size plus the first and last MiB of each file."""
    h = hashlib.sha256()
    for p in sorted(paths):
        size = os.path.getsize(p)
        h.update(f"{os.path.basename(p)}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:32]
