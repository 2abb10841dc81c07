"""tierserve's engine: everything between a request and a token.

The names below load lazily: the scheduler and block pool are torch-free modules, and importing
them (or this package) must not pull torch in."""

from __future__ import annotations

from tierserve._lazy import lazy_getattr

from tierserve.engine.env import set_omp_env

set_omp_env()  # before torch starts its thread pool

_LAZY = {
    "LLM": "tierserve.engine.llm",
    "LLMEngine": "tierserve.engine.llm_engine",
    "SamplingParams": "tierserve.engine.sampling_params",
    "ParamError": "tierserve.engine.sampling_params",
    "EngineConfig": "tierserve.engine.config",
    "CacheConfig": "tierserve.engine.config",
    "SchedulerConfig": "tierserve.engine.config",
    "ModelConfig": "tierserve.engine.config",
    "RequestOutput": "tierserve.engine.outputs",
    "CompletionOutput": "tierserve.engine.outputs",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
