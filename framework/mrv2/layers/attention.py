"""The attention layer models use: paged KV write + attention through the step's backend."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from mrv2.contract.attention import RopeInputs
from mrv2.contract.forward_context import get_forward_context
from mrv2.contract.kv_cache import KVCacheLayer, PagedKVSpec
from mrv2.layers.bidirectional import attend_spans
from mrv2.layers.rotary import RotaryEmbedding
from mrv2_kernels.rotary import QKNorm

_NO_OPTIONS: dict[str, Any] = {}


class Attention(KVCacheLayer):
    """Causal paged attention over layer ``layer_idx``'s KV cache (no parameters); query rows
    in the forward context's :class:`~mrv2.contract.forward_context.BidirectionalSpan` s also
    see their span's later keys (an image's tokens in Gemma 3). ``sliding_window``: a query
    sees its last that many keys; ``attention_chunk`` ``C`` (chunked local attention, Llama
    4): the keys of its own chunk of ``C`` positions, ``(p // C) * C .. p``; not both.

    Declares a :class:`PagedKVSpec` cache; the metadata, this layer's cache tensor and its
    backend come from the forward context the runner sets around each forward
    (:func:`mrv2.attention.set_forward_context`).
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
        sliding_window: int | None = None, logit_softcap: float | None = None,
        bidirectional_spans: bool = True, attention_chunk: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        if attention_chunk is not None and attention_chunk < 1:
            raise ValueError(f"attention_chunk must be None or >= 1, got {attention_chunk}")
        if sliding_window is not None and attention_chunk is not None:
            raise ValueError(f"sliding_window ({sliding_window}) and attention_chunk "
                             f"({attention_chunk}) cannot be combined: give one or neither")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
        #: Keys a query sees, its own included (None: all before it); HF's ``sliding_window``.
        self.sliding_window = sliding_window
        #: Positions per chunk of chunked local attention (a query sees its chunk's keys up to
        #: itself; HF's ``attention_chunk_size``); None: not chunked. Blocks of earlier chunks
        #: may be freed (:mod:`mrv2.runner.kv_tables`).
        self.attention_chunk = attention_chunk
        #: Scores soft-capped to ``cap * tanh(score / cap)`` (Gemma 2); None: not capped.
        self.logit_softcap = logit_softcap
        #: Whether the forward context's bidirectional spans apply to this layer (Gemma 3: every
        #: layer; Gemma 4: its sliding layers only, its global layers stay causal).
        self.bidirectional_spans = bidirectional_spans
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def kv_cache_spec(self) -> PagedKVSpec:
        """Keys and values of ``num_kv_heads`` heads of ``head_dim`` per token (and the
        window or chunk, whose blocks before what its queries see the runner may free)."""
        return PagedKVSpec(self.num_kv_heads, self.head_dim, self.sliding_window,
                           self.attention_chunk)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
        qk_norm: QKNorm | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [T, H*D]``, ``k``/``v`` ``[T, Hk*D]`` -> ``[T, H*D]``.

        With ``rotary`` (and ``positions``, optionally ``qk_norm``), ``q`` and ``k`` are
        rotated here (see :meth:`RotaryEmbedding.forward`). Where the backend can
        (``rope_in_attention``) and the rotation is plain (:meth:`RotaryEmbedding.
        whole_head_table`), the backend rotates inside attention; else, where it allows it
        (``kv_write_in_rope``), the KV-cache write happens in the RoPE kernel. ``sinks``
        ``[num_heads]``: the heads' attention-sink scores (gpt-oss), where the backend takes
        them (``attention_sinks``).
        """
        ctx = get_forward_context()
        kv_cache = ctx.kv_cache(self.layer_idx)
        backend = ctx.backend(self.layer_idx)
        metadata = ctx.metadata_of(self.layer_idx)
        num_tokens = q.shape[0]
        extra = _NO_OPTIONS  # (the usual layer: no per-call work for the options)
        if sinks is not None or self.sliding_window is not None or (
                self.logit_softcap is not None or self.attention_chunk is not None):
            extra = self._options(backend, sinks)
            if self.attention_chunk is not None and ctx.bidirectional and self.bidirectional_spans:
                raise ValueError(f"layer {self.layer_idx} attends with attention_chunk, which "
                                 f"bidirectional spans do not support")
        kv_write = None
        if rotary is not None:
            if positions is None:
                raise ValueError("Attention.forward: rotary needs positions")
            spans = ctx.bidirectional and self.bidirectional_spans
            table = (rotary.whole_head_table(positions)
                     if backend.rope_in_attention and not spans else None)
            if table is not None:
                query = q.reshape(num_tokens, self.num_heads, self.head_dim)
                out = backend.forward_rope(query, k, v, kv_cache, metadata, self.scale,
                                           RopeInputs(positions, table, qk_norm), **extra)
                return out.reshape(num_tokens, self.num_heads * self.head_dim)
            if backend.kv_write_in_rope:
                kv_write = (v, kv_cache, metadata.slot_mapping)
            q, k = rotary(positions, q, k, qk_norm, kv_write=kv_write)
        if kv_write is None:  # not written inside the RoPE kernel
            key = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            value = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            backend.write_kv(key, value, kv_cache, metadata.slot_mapping)
        query = q.reshape(num_tokens, self.num_heads, self.head_dim)
        out = backend.forward(query, kv_cache, metadata, self.scale, **extra)
        if ctx.bidirectional and self.bidirectional_spans:  # rows that see their span's later keys
            out = out.reshape(num_tokens, self.num_heads, self.head_dim)
            attend_spans(out, query, kv_cache, metadata, ctx.bidirectional, scale=self.scale,
                         window=self.sliding_window, logit_softcap=self.logit_softcap,
                         sinks=sinks)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _options(self, backend: Any, sinks: torch.Tensor | None) -> dict[str, Any]:
        """This layer's attention options for ``backend``'s call; a ValueError where the
        backend does not take one."""
        extra: dict[str, Any] = {}
        for option, value, able in (("sliding_window", self.sliding_window, "sliding_window"),
                                    ("logit_softcap", self.logit_softcap, "logit_softcap"),
                                    ("sinks", sinks, "attention_sinks"),
                                    ("attention_chunk", self.attention_chunk,
                                     "attention_chunk")):
            if value is None:
                continue
            if not getattr(backend, able, False):
                raise ValueError(f"layer {self.layer_idx} attends with {option}; the "
                                 f"{backend.name!r} attention backend does not take it")
            extra[option] = value
        return extra

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale}, layer_idx={self.layer_idx}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", logit_softcap={self.logit_softcap}" if self.logit_softcap else "")
            + (f", attention_chunk={self.attention_chunk}" if self.attention_chunk else "")
        )


def config_sliding_window(config: Any) -> int | None:
    """The window an HF text config gives its local layers: ``sliding_window``, None where it
    sets none or ``use_sliding_window`` is false (Qwen2's default). Which layers are local is
    :func:`mrv2.layers.sliding_window_of`'s; ``disable_sliding_window`` caps ``max_model_len``
    to this window, as vLLM does."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def disable_sliding_windows(model: nn.Module) -> int:
    """``disable_sliding_window``: every module of ``model`` whose ``sliding_window`` is a
    window (an int: the core's :class:`Attention`, a family's own layer that keeps its window
    under that name) attends over all keys from now on, its window set to None (before the
    KV cache specs are read: the layers then share the full-attention block tables). The
    model's structure stays as built (Gemma's per-kind RoPE, EXAONE 4's NoPE global layers),
    as vLLM's with its config's window cleared. Returns how many modules changed."""
    changed = 0
    for module in model.modules():
        window = getattr(module, "sliding_window", None)
        if isinstance(window, int) and not isinstance(window, bool):
            cast(Any, module).sliding_window = None
            changed += 1
    return changed
