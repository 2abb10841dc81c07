"""tierserve's engine: everything between a request and a token."""

from engine.env import set_omp_env

set_omp_env()  # before torch starts its thread pool

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engine.sampling_params import ParamError, SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "ParamError", "EngineConfig", "CacheConfig",
           "SchedulerConfig", "ModelConfig", "RequestOutput", "CompletionOutput"]
