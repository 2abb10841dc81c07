"""GET /v1/backends: the device, dtype and attention backend per phase chosen at start-up, and
why."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request

from tierserve.server.body import CheckedRoute
from tierserve.server.serving import context

router = APIRouter(route_class=CheckedRoute)


@router.get("/v1/backends")
async def backends(request: Request) -> dict:
    info = context(request).engine.info
    sparse = info.sparse
    return {"object": "backends", "backend": info.backend,
            "device": info.device.device, "device_reason": info.device.reason,
            "dtype": info.dtype.dtype, "dtype_reason": info.dtype.reason,
            "kv_cache_dtype": info.kv_cache_dtype,
            "quantization": {"mode": info.quantization, "kernels": dict(info.quant_kernels),
                             "weight_bytes": info.weight_bytes},
            "sparse_decode": {**dataclasses.asdict(sparse), "active": sparse.active},
            "speculative": info.speculative,
            "tensor_parallel_size": info.tensor_parallel_size,
            **{phase: r.to_json() for phase, r in info.routes.items()}}
