"""Attention: backend interface, per-step metadata, forward context, backends."""

from mrv2.attention.backend import AttentionBackend, AttentionMetadata
from mrv2.attention.context import ForwardContext, get_forward_context, set_forward_context

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
]
