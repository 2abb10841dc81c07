"""GET /v1/backends: the device, dtype and attention backend per phase chosen at start-up, and
why."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tierserve.server.body import CheckedRoute
from tierserve.server.serving import context

router = APIRouter(route_class=CheckedRoute)


@router.get("/v1/backends")
async def backends(request: Request) -> dict:
    engine = context(request).engine.engine
    runner = engine.runner
    return {"object": "backends", "backend": runner.backend.name,
            "device": engine.device_choice.device, "device_reason": engine.device_choice.reason,
            "dtype": engine.dtype_choice.dtype, "dtype_reason": engine.dtype_choice.reason,
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "sparse_decode": _sparse(engine),
            **{phase: r.to_json() for phase, r in runner.routes.items()}}


def _sparse(engine) -> dict:
    """Whether sparse top-k decode is configured, and whether the decode backend runs it."""
    cfg, caps = engine.config.sparse, engine.runner.backend.capabilities
    return {"enabled": cfg.enabled, "backend_supports": caps.sparse,
            "active": cfg.enabled and caps.sparse, "topk_blocks": cfg.topk_blocks,
            "topk_ratio": cfg.topk_ratio, "min_context": cfg.min_context,
            "dense_layers": cfg.dense_layers}
