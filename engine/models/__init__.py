"""Model architectures by family name, imported lazily."""

from __future__ import annotations

import importlib

MODELS: dict[str, str] = {
    "llama": "tierserve.engine.models.llama:LlamaForCausalLM",
    "mistral": "tierserve.engine.models.llama:LlamaForCausalLM",
    "qwen2": "tierserve.engine.models.llama:LlamaForCausalLM",
    "qwen3": "tierserve.engine.models.llama:LlamaForCausalLM",
}


def model_class(architecture: str):
    if architecture not in MODELS:
        raise ValueError(f"unknown architecture {architecture!r} (valid: {', '.join(MODELS)})")
    module, cls = MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
