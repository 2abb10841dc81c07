"""Attention backends over the paged KV cache, their capability descriptors, and the router."""

from kernels.base import AttentionBackend, BatchLayout, Capabilities
from kernels.context import ForwardContext, forward_context, get_forward_context
from kernels.registry import BACKENDS, create_backend

__all__ = ["AttentionBackend", "BatchLayout", "Capabilities", "ForwardContext", "forward_context",
           "get_forward_context", "BACKENDS", "create_backend"]
