"""tierserve: an OpenAI-compatible LLM serving daemon with per-request KV-cache tier control.

One import package. The repository keeps its folders at the top (server/, engine/, kernels/,
configs/); pyproject.toml installs them as tierserve.server, tierserve.engine, tierserve.kernels
and tierserve.configs. The offline API is re-exported here lazily, so `import tierserve` (and the
torch-free scheduler and block pool under it) does not import torch:

    from tierserve import LLM, SamplingParams
"""

from __future__ import annotations

from tierserve._lazy import lazy_getattr
import os

__version__ = "0.1.0"

# In a source checkout this file sits beside server/, engine/ and kernels/: searching the
# checkout too resolves tierserve.server there, so a checkout on sys.path (the current directory
# of `python -m pytest`, say) imports the same files an editable install maps.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "engine", "__init__.py")):
    __path__.append(_checkout)  # type: ignore[name-defined]  # noqa: F821

_LAZY = {
    "LLM": "tierserve.engine.llm",
    "LLMEngine": "tierserve.engine.llm_engine",
    "SamplingParams": "tierserve.engine.sampling_params",
    "ParamError": "tierserve.engine.sampling_params",
    "RequestOutput": "tierserve.engine.outputs",
    "CompletionOutput": "tierserve.engine.outputs",
    "KVHints": "tierserve.engine.core.kv_hints",
    "SloClass": "tierserve.engine.core.kv_hints",
    "TierConfig": "tierserve.engine.kv_tiers.config",
}

__all__ = ["__version__", *_LAZY]

__getattr__ = lazy_getattr(__name__, _LAZY)
