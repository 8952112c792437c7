"""The forward context: how cache layers find this step's metadata, KV caches and backends.

The runner sets it around each forward; model code never passes metadata through its layers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mrv2.contract.attention import AttentionMetadata


@dataclass
class ForwardContext:
    """What one forward pass sees: metadata, and per cache layer its tensor and backend."""

    metadata: AttentionMetadata
    kv_caches: Sequence[torch.Tensor]
    """One tensor per cache layer, indexed by ``layer_idx`` (layout: the layer's spec)."""
    backends: Sequence[Any]
    """The attention backend of each cache layer (its KV cache group's), by ``layer_idx``."""
    lora_slots: torch.Tensor | None = None
    """``[>= num_tokens]`` int32: each token's LoRA adapter slot (-1: the base model alone);
    None when the engine serves no adapters (:mod:`mrv2.lora`)."""
    table_metadata: Sequence[AttentionMetadata] = ()
    """With more than one block table (sliding-window layers of their own,
    :mod:`mrv2.runner.kv_tables`): the metadata of each table, ``metadata`` first; the same
    but for ``block_table`` and ``slot_mapping``. Empty: ``metadata`` serves every layer."""
    layer_tables: Sequence[int] = ()
    """The block table of each cache layer, by ``layer_idx`` (empty: table 0 for all)."""
    state_rows: torch.Tensor | None = None
    """``[metadata.num_reqs]`` int32: each request's state-table row, where its per-request
    state lives (:mod:`mrv2.contract.request_state`); entries of padding requests (zero
    queries) are stale. None where the runner does not set it."""
    state_table: torch.Tensor | None = None
    """``[max_num_seqs, 6]`` int32 by state row: where a chunk resumes from and which snapshots
    it stores (prefix caching of per-request state; the kernels' ``state_table``:
    :mod:`mrv2_kernels.linear_attention`). Layers with per-request state pass it to their
    kernels as it is. None without prefix caching."""
    state_row_slots: int = 1
    """The state rows each request owns: 1, or ``1 + k`` with speculative decoding (the
    kernels' ``row_slots``: :mod:`mrv2.contract.request_state`). Layers with per-request state
    pass it to their kernels as it is."""
    bidirectional: Sequence[BidirectionalSpan] = ()
    """Query rows that also see the later keys of their span (an image's tokens in Gemma 3):
    set by the model's forward around its layers with :func:`bidirectional_spans`; empty (the
    runner's default): every query causal."""

    def metadata_of(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer ``layer_idx`` reads: its block table's."""
        if not self.layer_tables:
            return self.metadata
        return self.table_metadata[self.layer_tables[layer_idx]]

    def metadata_with_slots(self, slot_mapping: torch.Tensor) -> AttentionMetadata | None:
        """The table metadata whose ``slot_mapping`` is ``slot_mapping`` (None: none)."""
        for metadata in self.table_metadata or (self.metadata,):
            if metadata.slot_mapping is slot_mapping:
                return metadata
        return None

    def kv_cache(self, layer_idx: int) -> torch.Tensor:
        """The cache tensor of layer ``layer_idx``."""
        return self.kv_caches[layer_idx]

    def backend(self, layer_idx: int) -> Any:
        """The backend serving layer ``layer_idx``."""
        return self.backends[layer_idx]


@dataclass(frozen=True)
class BidirectionalSpan:
    """A run of one request's query rows that attend to each other both ways, as prefix-LM
    models attend among an image's tokens (Gemma 3, PaliGemma): each query of the span sees
    what a causal query sees plus every later key of the span (within its layer's sliding
    window, whose lower bound still holds). The span's keys up to ``end`` are all in the
    step (the scheduler never ends a step inside such a span:
    :attr:`mrv2.contract.requests.MultiModalItem.bidirectional`)."""

    request: int
    """The request's index in the step's batch (its metadata row)."""
    first_row: int
    """The step row (flat token index) of the span's first query this step."""
    first_position: int
    """That query's position in its sequence."""
    end: int
    """The position after the span's last token: the span's queries are rows ``first_row``
    .. ``first_row + end - first_position - 1``, and each sees keys up to ``end - 1``."""

    def __post_init__(self) -> None:
        if min(self.request, self.first_row, self.first_position) < 0 or (
                self.end <= self.first_position):
            raise ValueError(f"BidirectionalSpan: request, first_row, first_position must be "
                             f">= 0 and end > first_position, got {self}")


class _Local(threading.local):
    context: ForwardContext | None = None


#: The forward pass in progress, per thread: engines stepping in threads of one process (two
#: ``LLM`` s, a server's engine beside a test's) each see their own.
_LOCAL = _Local()


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """Make ``context`` visible to cache layers for the duration of the block (in this
    thread)."""
    local = _LOCAL
    previous, local.context = local.context, context
    try:
        yield
    finally:
        local.context = previous


@contextmanager
def bidirectional_spans(spans: Sequence[BidirectionalSpan] | None) -> Iterator[None]:
    """Within the block, the forward in progress attends both ways within ``spans``
    (:class:`BidirectionalSpan`; None or empty: nothing changes). A model's forward wraps its
    layers in it for a step whose model state found such spans."""
    if not spans:
        yield
        return
    ctx = get_forward_context()
    previous, ctx.bidirectional = ctx.bidirectional, tuple(spans)
    try:
        yield
    finally:
        ctx.bidirectional = previous


def current_forward_context() -> ForwardContext | None:
    """The context of the forward pass in progress, or None outside one."""
    return _LOCAL.context


def real_token_count(num_rows: int) -> torch.Tensor | None:
    """The step's real token count as an int32 device tensor ``[1]`` (a view of
    ``query_start_loc[num_reqs]``, no launch), when ``num_rows`` rows are the step's tokens
    (``metadata.num_tokens``); ``None`` outside a forward pass or for another row count.

    Rows from it on are padding (a CUDA graph's: the requests past the real ones have empty
    queries): layers whose cost depends on the rows' values, like the routed experts, skip
    them on the device."""
    ctx = _LOCAL.context
    if ctx is None or ctx.metadata.num_tokens != num_rows:
        return None
    md = ctx.metadata
    return md.query_start_loc[md.num_reqs:md.num_reqs + 1].to(torch.int32)  # int32: no copy


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress; raises outside one."""
    ctx = _LOCAL.context
    if ctx is None:
        raise RuntimeError(
            "attention layer called outside a forward pass: wrap the call in "
            "mrv2.attention.set_forward_context(...)"
        )
    return ctx
