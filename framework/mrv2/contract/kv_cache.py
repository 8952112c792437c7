"""What a model declares about its KV cache: one spec per cache-owning layer.

Every layer that keeps per-token state across steps subclasses :class:`KVCacheLayer` and says
what it stores per token through :meth:`KVCacheLayer.kv_cache_spec`. The runner groups layers
whose specs are equal, allocates one tensor per layer with the group's layout, sizes the block
count for all groups together from ``gpu_memory_utilization``, and gives each group the
attention backend registered for its spec's :attr:`~KVCacheSpec.kind`.

Two kinds ship with the core:

* :class:`PagedKVSpec` (``"paged_kv"``): keys and values per kv-head,
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (dense decoders).
* :class:`LatentKVSpec` (``"latent"``): one latent vector per token,
  ``[num_blocks, block_size, latent_dim]`` (MLA: ``kv_lora_rank + qk_rope_head_dim``).

A new kind (sliding window, recurrent state) subclasses :class:`KVCacheSpec` with its own
``kind``, layout and bytes per block, and a plugin registers a backend for it.

Block ids come from one pool (one block manager, one prefix cache). Where every layer keeps
all of its tokens, block ``b`` of a request addresses the same tokens in each layer's tensor:
one block table serves every group. A model with sliding-window or chunked-attention layers
(a :class:`PagedKVSpec` with ``sliding_window`` or ``attention_chunk``) may get block tables
of their own for them (:mod:`mrv2.runner.kv_tables`): their blocks before what the next
queries see go back to the pool while the request runs, and layers of different tables
share tensors, so a block id costs one table's layers only.
"""

from __future__ import annotations

import math
import mmap
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
    """A zero-filled cache tensor, what :meth:`KVCacheSpec.allocate` returns.

    On the CPU its memory is an anonymous mapping: the operating system gives each page as
    zeros when it is first touched, so a cache costs memory and time only for the blocks that
    get used. ``torch.zeros`` wrote every byte of the whole budget at start-up (the default 2
    GiB: 1.5 s per engine on a 2-core machine, most of a tiny test engine's start). Elsewhere,
    ``torch.zeros``."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, numel * _itemsize(dtype))
    with warnings.catch_warnings():  # (a warning about non-writable buffers: this one is)
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(pages, dtype=torch.uint8)  # keeps the mapping alive
    return flat.view(dtype).view(shape)


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """Per-token cache layout of one layer. Equal specs form a group."""

    kind: ClassVar[str] = "abstract"

    @abstractmethod
    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Device bytes one block of ``block_size`` tokens takes in one layer."""

    @abstractmethod
    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """One layer's cache tensor of ``num_blocks`` blocks, zeroed (:func:`zeroed_cache`
        does it cheaply on the CPU)."""


@dataclass(frozen=True)
class PagedKVSpec(KVCacheSpec):
    """Keys and values per kv-head: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

    ``sliding_window``: the layer attends over its last that many keys only (None: all);
    ``attention_chunk`` ``C``: a query at position ``p`` attends over the keys of its own
    chunk only, ``(p // C) * C .. p`` (chunked local attention, Llama 4). Either way its
    blocks before what its next queries see may be freed while the request runs; they change
    the grouping, not the layout.
    """

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    attention_chunk: int | None = None
    kind: ClassVar[str] = "paged_kv"

    def __post_init__(self) -> None:
        # (a plugin may build the spec itself: refused here, before a table is planned)
        for name in ("sliding_window", "attention_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"PagedKVSpec.{name} must be at least 1 or None, got {value}")
        if self.sliding_window is not None and self.attention_chunk is not None:
            raise ValueError("PagedKVSpec takes sliding_window or attention_chunk, not both "
                             f"(got {self.sliding_window} and {self.attention_chunk})")

    @property
    def window(self) -> int | None:
        """The keys its queries see, as a block table's window: ``sliding_window``, an
        :class:`AttentionChunk` of ``attention_chunk``, or None (every key)."""
        if self.attention_chunk is not None:
            return AttentionChunk(self.attention_chunk)
        return self.sliding_window

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * _itemsize(dtype)

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return zeroed_cache((2, num_blocks, block_size, self.num_kv_heads, self.head_dim),
                            dtype, device)


class AttentionChunk(int):
    """A block table's window for chunked local attention of chunk ``C`` (``int(self)``).

    A window is an int, the most keys a query sees (its own included): every bound a window
    of ``C`` keys sets (the blocks a request holds at most) holds for chunks of ``C``. What
    differs is where the keys start, :func:`first_visible`: a sliding window's move with
    each query, a chunk's start at the query's chunk, so a chunked table frees a whole
    chunk's blocks at once when its queries cross into the next. Equal only to an equal
    chunk (never to the sliding window of the same size: their tables stay apart)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is AttentionChunk and int(self) == int(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("chunk", int(self)))

    def __repr__(self) -> str:
        return f"AttentionChunk({int(self)})"


def first_visible(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees over ``window`` (a sliding window
    of keys, an :class:`AttentionChunk`, or None: every key, 0); never below 0."""
    if window is None or position <= 0:
        return 0
    if isinstance(window, AttentionChunk):
        return position // window * window
    return max(0, position - window + 1)


def first_query_past(key: int, window: int) -> int:
    """The first query position whose :func:`first_visible` key over ``window`` is at least
    ``key`` (from there on, no query sees a key before ``key``)."""
    if isinstance(window, AttentionChunk):
        return -(-key // window) * window
    return key + window - 1


def most_blocks_held(windows: Sequence[int | None], block_size: int, num_tokens: int,
                     max_step_tokens: int, margin: int = 0) -> int:
    """The most KV blocks, over block tables of ``windows`` (None: full attention), a request
    of ``num_tokens`` tokens ever holds at once when a step computes at most
    ``max_step_tokens`` of its tokens: every block of a full table; in a sliding or chunked
    table the window before a step's first query, the step's tokens and ``margin`` (tokens a
    step's result may take back: its drafts). The scheduler's count
    (:meth:`~mrv2.engine.block_tables.BlockTables.most_held`) and :func:`longest_fitting`'s."""
    per_table = -(-num_tokens // block_size)
    span = margin + max_step_tokens + 2 * block_size
    return sum(per_table if w is None else min(per_table, (span + w) // block_size)
               for w in windows)


def longest_fitting(num_blocks: int, windows: Sequence[int | None], block_size: int,
                    max_step_tokens: int, margin: int, longest: int) -> int:
    """The longest ``max_model_len``, at most ``longest``, one request of which a pool of
    ``num_blocks`` holds, counted by :func:`most_blocks_held` (the other arguments its);
    0 where not even one token fits. ``max_model_len="auto"``'s length, and the one the
    scheduler's refusal of a pool too small names
    (:meth:`~mrv2.engine.scheduler.Scheduler.check_capacity`)."""
    low, high = 0, longest + 1  # a request of low tokens fits (0: none); of high, not
    while high - low > 1:
        mid = (low + high) // 2
        fits = most_blocks_held(windows, block_size, mid, max_step_tokens, margin) <= num_blocks
        low, high = (mid, high) if fits else (low, mid)
    return low


def shared_pages(specs: list[PagedKVSpec], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Cache tensors of ``specs`` (keys and values of different head counts or sizes) over one
    zeroed buffer: block ``b`` of each is page ``b`` of the buffer, pages as large as the
    largest spec's block. Each is ``[2, num_blocks, block_size, heads, head_dim]`` with its
    own strides (a block's stride is the page, not the block: kernels take strides); layers
    of block tables whose layouts differ share a tensor this way (:mod:`mrv2.runner.kv_tables`,
    Gemma 4's wide global layers beside its sliding ones)."""
    page = max(block_size * s.num_kv_heads * s.head_dim for s in specs)
    buffer = zeroed_cache((2, num_blocks, page), dtype, device)
    return [buffer.as_strided((2, num_blocks, block_size, s.num_kv_heads, s.head_dim),
                              (num_blocks * page, page, s.num_kv_heads * s.head_dim,
                               s.head_dim, 1), buffer.storage_offset())
            for s in specs]


@dataclass(frozen=True)
class LatentKVSpec(KVCacheSpec):
    """One latent vector per token: ``[num_blocks, block_size, latent_dim]`` (MLA)."""

    latent_dim: int
    kind: ClassVar[str] = "latent"

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.latent_dim * _itemsize(dtype)

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return zeroed_cache((num_blocks, block_size, self.latent_dim), dtype, device)


class KVCacheLayer(nn.Module):
    """Base of every module that owns a KV cache: a ``layer_idx`` and a spec.

    ``layer_idx`` numbers the model's cache layers 0..N-1 (each once); during a forward the
    layer finds its tensor and backend with
    ``get_forward_context().kv_cache(layer_idx)`` / ``.backend(layer_idx)``.
    """

    layer_idx: int

    def kv_cache_spec(self) -> KVCacheSpec:
        """What this layer stores per token."""
        raise NotImplementedError(f"{type(self).__name__} must implement kv_cache_spec()")


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one spec: their indices, the spec, and the backend name chosen for them."""

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]
    backend: str


def layer_specs(model: nn.Module) -> dict[int, KVCacheSpec]:
    """``{layer_idx: spec}`` of every :class:`KVCacheLayer` in ``model`` (checked 0..N-1)."""
    specs: dict[int, KVCacheSpec] = {}
    for module in model.modules():
        if isinstance(module, KVCacheLayer):
            if module.layer_idx in specs:
                raise ValueError(f"two KV cache layers have layer_idx {module.layer_idx}")
            specs[module.layer_idx] = module.kv_cache_spec()
    if sorted(specs) != list(range(len(specs))):
        raise ValueError(
            f"KV cache layers must have layer_idx 0..N-1, each once; got {sorted(specs)}"
        )
    return specs


def group_specs(specs: dict[int, KVCacheSpec]) -> list[tuple[KVCacheSpec, tuple[int, ...]]]:
    """Layers of equal spec together, groups in order of their first layer."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for layer_idx in sorted(specs):
        groups.setdefault(specs[layer_idx], []).append(layer_idx)
    return [(spec, tuple(layers)) for spec, layers in groups.items()]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
