"""Model architectures by family name, imported lazily."""

from __future__ import annotations

import importlib

MODELS: dict[str, str] = {
    "llama": "engine.models.llama:LlamaForCausalLM",
    "mistral": "engine.models.llama:LlamaForCausalLM",
    "qwen2": "engine.models.llama:LlamaForCausalLM",
    "qwen3": "engine.models.llama:LlamaForCausalLM",
}


def model_class(architecture: str):
    if architecture not in MODELS:
        raise ValueError(f"unknown architecture {architecture!r} (valid: {', '.join(MODELS)})")
    module, cls = MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
