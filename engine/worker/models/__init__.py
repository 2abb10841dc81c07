"""Model architectures by family name, imported lazily."""

from __future__ import annotations

from tierserve._lazy import lazy_class

MODELS: dict[str, str] = {
    "llama": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "mistral": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "qwen2": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "qwen3": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
}


def model_class(architecture: str):
    return lazy_class(MODELS, architecture, "architecture")
