"""The forward context: how attention layers find this step's metadata and KV cache.

The runner sets it around each forward; model code never passes metadata through its layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mrv2.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """What one forward pass of the model sees: metadata, per-layer KV caches, the backend."""

    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend


_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """Make ``context`` visible to attention layers for the duration of the block."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, context
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress; raises outside one."""
    if _CONTEXT is None:
        raise RuntimeError(
            "attention layer called outside a forward pass: wrap the call in "
            "mrv2.attention.set_forward_context(...)"
        )
    return _CONTEXT
