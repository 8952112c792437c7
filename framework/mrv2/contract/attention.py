"""The attention backend interfaces and the metadata every backend reads.

A token at absolute position ``p`` of request ``r`` lives in block ``block_table[r, p //
block_size]`` at offset ``p % block_size``, in every layer's cache whatever its layout;
``slot_mapping`` holds the flat slot ``block * block_size + offset`` of every token of the step.
Where sliding-window layers have block tables of their own (:mod:`mrv2.runner.kv_tables`), each
table has its metadata (``ForwardContext.metadata_of(layer_idx)``), the same but for these two.
Each cache kind (:mod:`mrv2.contract.kv_cache`) has backends that know its layout:
:class:`PagedAttentionBackend` serves ``"paged_kv"`` caches
(``[2, num_blocks, block_size, num_kv_heads, head_dim]``, index 0 keys, 1 values); a latent (MLA)
backend defines the calls its attention layer makes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, all device tensors plus CPU-known bounds.

    Tokens of the step are laid out request after request: request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; its queries sit at the last positions of its
    sequence, whose total length after this step is ``seq_lens[i]``.
    """

    num_reqs: int
    """Requests in the batch (B). Rows past the real ones may be padding with zero queries."""
    num_tokens: int
    """Query tokens in the step (T), padding included."""
    max_query_len: int
    """Upper bound of any request's query length this step (known on the CPU)."""
    max_seq_len: int
    """Upper bound of any ``seq_lens`` entry this step (known on the CPU, never read back)."""
    query_start_loc: torch.Tensor
    """``[B + 1]`` int32, exclusive prefix sum of query lengths."""
    seq_lens: torch.Tensor
    """``[B]`` int32, tokens in each sequence after this step (context + new queries)."""
    block_table: torch.Tensor
    """``[B, max_blocks_per_req]`` int32, KV block ids of each request."""
    slot_mapping: torch.Tensor
    """``[T]`` int64, flat KV slot of each query token; negative for padding (not written)."""
    block_size: int
    """Tokens per KV block."""
    uniform_decode: bool = False
    """Every real request has a query of length 1 (lets a backend pick its decode path)."""
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Scratch for values a backend derives from this metadata once and reuses in every layer
    of the step (the CPU path's gather indices and masks, say). A new metadata object starts
    empty; whoever changes the tensors of one in place must clear it."""


class AttentionBackend:
    """Base of every attention backend: built once per KV cache group with no arguments.

    Subclasses add the calls their cache kind's attention layer makes; see
    :class:`PagedAttentionBackend` for the paged K/V one.
    """

    name: str = "abstract"

    fp8_kv_cache: bool = False
    """Whether this backend writes and reads a float8 (e4m3) cache, what ``kv_cache_dtype="fp8"``
    allocates: values saturated to +-448 and rounded to nearest even as
    :func:`mrv2_kernels.kv_cache.to_cache_dtype` does, read back as the query's dtype. The
    runner refuses ``"fp8"`` for a model with a cache group whose backend says ``False``."""

    mixed_step_graphs: bool = True
    """Whether steps with prompt tokens may run this backend inside the runner's mixed CUDA
    graphs. Their metadata bakes ``max_query_len`` = the padded token count and
    ``max_seq_len`` = ``max_model_len`` (upper bounds, as the metadata allows): a backend whose
    launches grow with those bounds (programs that exit at once) says ``False`` and such steps
    run eager."""


class PagedAttentionBackend(AttentionBackend, ABC):
    """Attention over a ``"paged_kv"`` cache: writes new K/V into it, attends over it."""

    kv_write_in_rope: bool = False
    """Whether the KV write may run inside the RoPE kernel instead of :meth:`write_kv`
    (:class:`mrv2.layers.Attention` given the rotary embedding): one launch less per layer.
    Only for backends whose cache write is exactly
    :func:`mrv2_kernels.kv_cache.write_kv_triton`'s."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` slots."""

    sliding_window: bool = False
    """Whether :meth:`forward` and :meth:`forward_rope` take ``sliding_window``: a query at
    position ``p`` then sees only keys at positions ``p - sliding_window + 1 .. p`` (Gemma,
    Mistral's local layers; HF's ``sliding_window`` counts the query's own key)."""

    logit_softcap: bool = False
    """Whether :meth:`forward` and :meth:`forward_rope` take ``logit_softcap``: the scaled
    scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2's
    ``attn_logit_softcapping``)."""

    attention_chunk: bool = False
    """Whether :meth:`forward` and :meth:`forward_rope` take ``attention_chunk``: a query at
    position ``p`` then sees only keys at positions ``(p // C) * C .. p`` (chunked local
    attention, Llama 4's ``attention_chunk_size``); never with ``sliding_window``."""

    attention_sinks: bool = False
    """Whether :meth:`forward` and :meth:`forward_rope` take ``sinks`` (``[num_heads]``, this
    rank's query heads): each head's learned sink score joins every query's softmax as one
    more key whose value is zero (gpt-oss)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over the paged cache.

        Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads //
        num_kv_heads)``. Returns ``[T, num_heads, head_dim]`` in the query's dtype.
        ``sliding_window`` (where :attr:`sliding_window` says so): the last that many keys
        up to each query's position only; None: every key up to it. ``logit_softcap`` (where
        :attr:`logit_softcap` says so): soft-capped scores; ``sinks`` (where
        :attr:`attention_sinks` says so): the heads' sink scores; ``attention_chunk`` (where
        :attr:`attention_chunk` says so): each query's chunk of that many positions only.
        """

    rope_in_attention: bool = False
    """Whether :meth:`forward_rope` is implemented: attention that takes the raw query, key
    and value and rotates them (and stores key and value) itself."""

    def forward_rope(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        rope: RopeInputs,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        """:meth:`write_kv` and :meth:`forward` of the rotated query and key, from the raw
        ``query`` ``[T, num_heads, head_dim]``, ``key``/``value`` ``[T, num_kv_heads *
        head_dim]`` (or ``[T, num_kv_heads, head_dim]``): the same result as normalizing
        (``rope.qk_norm``) and rotating query and key with
        :func:`mrv2_kernels.rotary.rotary_embedding`, writing, then attending. Only where
        :attr:`rope_in_attention`; :class:`mrv2.layers.Attention` calls it for RoPE models
        whose rotation covers the whole head."""
        raise NotImplementedError(f"{type(self).__name__} does not rotate inside attention")


@dataclass(frozen=True)
class RopeInputs:
    """The rotation :meth:`PagedAttentionBackend.forward_rope` applies (neox style, whole head).
    """

    positions: torch.Tensor
    """``[T]`` each token's position: its row of ``cos_sin``."""
    cos_sin: torch.Tensor
    """``[max_position, head_dim]`` fp32, the cos half first (:class:`mrv2.layers.rotary.
    RotaryEmbedding`'s table)."""
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
    """``(q weight, k weight, eps)``: per-head RMSNorm of query and key first (Qwen3)."""
