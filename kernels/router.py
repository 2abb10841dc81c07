"""Pick the attention backend for a device and a model shape, and say why.

Each backend declares Capabilities; the router rejects those that cannot run with a reason, and
takes the first valid one in the device's priority list (or the one the user named, if valid)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from kernels.base import Capabilities
from kernels.registry import BACKENDS, backend_class

PRIORITY = {
    "cpu": ["cpu_native", "torch_sdpa", "torch_ref"],
    "cuda": ["torch_sdpa", "torch_ref"],
}


@dataclass(frozen=True)
class RouteQuery:
    device_type: str
    dtype: torch.dtype
    kv_dtype: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    page_size: int
    phase: str = "decode"
    capability: tuple[int, int] | None = None
    sparse: bool = False


@dataclass
class Route:
    backend: str
    rejected: dict[str, str] = field(default_factory=dict)
    """Every backend not chosen, with the reason."""


def reject_reason(caps: Capabilities, q: RouteQuery) -> str | None:
    group = q.num_heads // q.num_kv_heads
    checks = [
        (q.device_type in caps.device_types, f"device {q.device_type} not in {caps.device_types}"),
        (q.dtype in caps.dtypes, f"dtype {q.dtype} not supported"),
        (q.kv_dtype in caps.kv_dtypes, f"KV dtype {q.kv_dtype} not in {caps.kv_dtypes}"),
        (caps.head_dims is None or q.head_dim in caps.head_dims, f"head dim {q.head_dim} not in {caps.head_dims}"),
        (caps.gqa_groups is None or group in caps.gqa_groups, f"GQA group {group} not in {caps.gqa_groups}"),
        (caps.page_sizes is None or q.page_size in caps.page_sizes, f"page size {q.page_size} not in {caps.page_sizes}"),
        (q.phase in caps.phases, f"phase {q.phase} not supported"),
        (not q.sparse or caps.sparse, "no sparse top-k support"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    missing = [p for p in caps.requires if importlib.util.find_spec(p) is None]
    return f"not installed ({', '.join(missing)})" if missing else None


def route(q: RouteQuery, override: str | None = None) -> Route:
    order = PRIORITY.get(q.device_type, ["torch_sdpa", "torch_ref"])
    rejected: dict[str, str] = {}
    names = [override] if override else order + [n for n in BACKENDS if n not in order]
    chosen = None
    for name in names:
        why = reject_reason(backend_class(name).capabilities, q)
        if why is None and chosen is None:
            chosen = name
        elif why is not None:
            rejected[name] = why
        else:
            rejected[name] = f"lower priority than {chosen}"
    if chosen is None:
        raise ValueError(f"no attention backend can run this model here: " +
                         "; ".join(f"{n}: {r}" for n, r in rejected.items()))
    return Route(chosen, rejected)
