"""Attention backends (Triton paged attention, the plain-torch reference); their interfaces,
metadata and the forward context live in :mod:`mrv2.contract`."""

from mrv2.contract.attention import AttentionBackend, AttentionMetadata, PagedAttentionBackend
from mrv2.contract.forward_context import ForwardContext, get_forward_context, set_forward_context

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "PagedAttentionBackend",
    "get_forward_context",
    "set_forward_context",
]
