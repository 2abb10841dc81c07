"""Model architectures by family name, imported lazily."""

from __future__ import annotations

from tierserve._lazy import lazy_class

MODELS: dict[str, str] = {
    "llama": "tierserve.engine.models.llama:LlamaForCausalLM",
    "mistral": "tierserve.engine.models.llama:LlamaForCausalLM",
    "qwen2": "tierserve.engine.models.llama:LlamaForCausalLM",
    "qwen3": "tierserve.engine.models.llama:LlamaForCausalLM",
}


def model_class(architecture: str):
    return lazy_class(MODELS, architecture, "architecture")
