"""The scoped per-step context through which attention layers reach metadata and the KV cache."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from tierserve.kernels.base import AttentionBackend


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: Any
    slot_mapping: torch.Tensor
    kv_caches: list[torch.Tensor]
    """One [2, Hkv, slots, D] tensor per layer."""
    sparse: Any = None
    """The step's sparse decode plan (kernels.sparse_plan.SparseStep), None when every layer of
    the step attends densely."""


_local = threading.local()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention called outside forward_context()")
    return ctx
