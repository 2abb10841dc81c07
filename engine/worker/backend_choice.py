"""The runner's attention backends: prefill and decode routed separately (kernels/router.py), each
built once, and a backend that fails to build replaced by torch_sdpa unless the user named it."""

from __future__ import annotations

import logging

import torch

from tierserve.engine.config import EngineConfig, ModelConfig
from tierserve.kernels import AttentionBackend, create_backend
from tierserve.kernels.composite import PhaseSplit
from tierserve.kernels.profile import load_profile
from tierserve.kernels.router import Route, RouteQuery, describe, route_phases

log = logging.getLogger(__name__)

FALLBACK = "torch_sdpa"
"""Runs wherever torch does."""


def choose_backend(config: EngineConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> tuple[dict[str, Route], AttentionBackend]:
    """(routes by phase, the backend): one backend when both phases agree, else a PhaseSplit.
    A route whose backend fell back names the one that runs and why."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    q = RouteQuery(device.type, dtype, config.kv_cache_dtype, mc.head_dim, mc.num_heads,
                   mc.num_kv_heads, config.cache.block_size, capability=cap,
                   sliding_window=mc.windowed)
    routes = route_phases(q, config.attention_backend, load_profile(config.backend_profile),
                          sparse_decode=config.sparse.enabled)
    built: dict[str, AttentionBackend] = {}  # routed name -> instance (maybe a fallback)
    for r in routes.values():
        if r.backend not in built:
            built[r.backend] = _create(config, mc, r, device, dtype, kv_dtype)
    pre, dec = (built[routes[p].backend] for p in ("prefill", "decode"))
    for r, be in ((routes["prefill"], pre), (routes["decode"], dec)):
        if be.name != r.backend:  # the routed backend failed to build
            r.rejected.pop(be.name, None)
            r.rejected[r.backend] = getattr(be, "fallback_reason", "failed to build")
            r.backend = be.name
    log.info("attention backends:\n%s", describe(routes))
    return routes, dec if pre is dec else PhaseSplit(prefill=pre, decode=dec)


def _create(config: EngineConfig, mc: ModelConfig, r: Route, device: torch.device,
            dtype: torch.dtype, kv_dtype: torch.dtype) -> AttentionBackend:
    args = (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.attn_scale)
    kw = dict(kv_scale=config.kv_cache_scale, device=device, dtype=dtype, kv_dtype=kv_dtype)
    try:
        return create_backend(r.backend, *args, **kw)
    except RuntimeError as e:  # e.g. a native kernel that failed to build
        if config.attention_backend:
            raise
        log.warning("attention backend %s unavailable (%s); using %s", r.backend, e, FALLBACK)
        be = create_backend(FALLBACK, *args, **kw)
        be.fallback_reason = str(e)
        return be
