"""Attention backends over the paged KV cache, their capability descriptors, and the router."""

from tierserve.kernels.base import AttentionBackend, BatchLayout, Capabilities
from tierserve.kernels.context import ForwardContext, forward_context, get_forward_context
from tierserve.kernels.registry import BACKENDS, create_backend

__all__ = ["AttentionBackend", "BatchLayout", "Capabilities", "ForwardContext", "forward_context",
           "get_forward_context", "BACKENDS", "create_backend"]
