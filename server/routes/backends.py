"""GET /v1/backends: the attention backend chosen per phase at start-up, and why."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tierserve.server.serving import context

router = APIRouter()


@router.get("/v1/backends")
async def backends(request: Request) -> dict:
    runner = context(request).engine.engine.runner
    return {"object": "backends", "backend": runner.backend.name,
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
            **{phase: r.to_json() for phase, r in runner.routes.items()}}
