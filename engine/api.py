"""The engine's one face for the server: the request and response value types, what the engine
reports (EngineInfo, the published snapshot, counters), the errors a caller meets, and the few
operations the server calls (open_engine; the AsyncEngine's request API, chat-template override
included). server/ imports the engine only from here (tests/test_layering.py).

The names load lazily, as the package's do: the server's settings and the CLI's early checks
name these types without importing torch (a bad flag is refused in well under a second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierserve._lazy import lazy_getattr

if TYPE_CHECKING:
    from tierserve.engine.async_engine import AsyncEngine

_LAZY = {
    # the engine and what it publishes
    "AsyncEngine": "tierserve.engine.async_engine",
    "ChildRequest": "tierserve.engine.async_engine",
    "GroupStream": "tierserve.engine.async_engine",
    "EngineSnapshot": "tierserve.engine.stats",
    "HistogramSnapshot": "tierserve.engine.stats",
    "EngineInfo": "tierserve.engine.info",
    "SpecStats": "tierserve.engine.spec.speculator",
    "GrammarStats": "tierserve.engine.worker.grammar",
    "COMPILE_BUCKETS": "tierserve.engine.worker.grammar",
    "CompileTicket": "tierserve.engine.worker.grammar",
    "CompileProgress": "tierserve.engine.worker.grammar_pool",
    "JobState": "tierserve.engine.worker.grammar_pool",
    "EventLog": "tierserve.engine.kv_tiers.events",
    "LATENCY_BUCKETS": "tierserve.engine.kv_tiers.stats",
    # requests and responses
    "SamplingParams": "tierserve.engine.sampling_params",
    "StructuredOutput": "tierserve.engine.sampling_params",
    "RequestOutput": "tierserve.engine.outputs",
    "CompletionOutput": "tierserve.engine.outputs",
    "TopLogprobs": "tierserve.engine.outputs",
    "KVHints": "tierserve.engine.core.kv_hints",
    "SloClass": "tierserve.engine.core.kv_hints",
    "TierDecision": "tierserve.engine.core.tier_policy",
    "TierDescriptor": "tierserve.engine.core.tier_descriptor",
    "TEMPLATE_VARIABLES": "tierserve.engine.tokenizer",
    "compile_chat_template": "tierserve.engine.tokenizer",
    # settings (the server's config builds and documents the engine's)
    "QUANTIZATIONS": "tierserve.engine.config",
    "parse_bytes": "tierserve.engine.config",
    "SparseConfig": "tierserve.engine.config",
    "SpeculativeConfig": "tierserve.engine.spec.config",
    "TierConfig": "tierserve.engine.kv_tiers.config",
    "TIER_ARGS": "tierserve.engine.llm",
    "SPARSE_ARGS": "tierserve.engine.llm",
    # errors
    "ParamError": "tierserve.engine.sampling_params",
    "QueueFull": "tierserve.engine.async_engine",
    "EngineStopped": "tierserve.engine.async_engine",
    "EngineError": "tierserve.engine.async_engine",
    "NeverAdmissible": "tierserve.engine.async_engine",
    "GrammarBusy": "tierserve.engine.worker.grammar",
    "ModelLoadError": "tierserve.engine.model_names",
    "resolve_path": "tierserve.engine.model_names",
    "DeviceError": "tierserve.engine.worker.device",
    "WorkerDied": "tierserve.engine.worker.tp.protocol",
}

__all__ = [*_LAZY, "open_engine"]

__getattr__ = lazy_getattr(__name__, _LAZY)


def open_engine(engine_kwargs: dict[str, Any], max_queue: int) -> AsyncEngine:
    """The engine the server runs: settings as flat keywords (LLM's and the server's), the model
    loaded, the cache sized, the loop not started yet (AsyncEngine.start). Raises ValueError for
    a setting the model cannot take, ModelLoadError, DeviceError or WorkerDied."""
    from tierserve.engine.async_engine import AsyncEngine
    from tierserve.engine.llm import build_config
    from tierserve.engine.llm_engine import LLMEngine

    config = build_config(**engine_kwargs)
    return AsyncEngine(LLMEngine(config), max_queue)
