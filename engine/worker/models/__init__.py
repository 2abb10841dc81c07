"""Model architectures by family name, imported lazily."""

from __future__ import annotations

from tierserve._lazy import lazy_class

MODELS: dict[str, str] = {
    "llama": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "mistral": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "qwen2": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "qwen3": "tierserve.engine.worker.models.llama:LlamaForCausalLM",
    "gemma3": "tierserve.engine.worker.models.gemma3:Gemma3ForCausalLM",
}


def model_class(architecture: str):
    """The model class of a family; an unknown name is a ValueError listing the valid ones."""
    return lazy_class(MODELS, architecture, "architecture")
