"""The attention layer models use: paged KV write + attention through the step's backend."""

from __future__ import annotations

from typing import Any

import torch

from mrv2.contract.attention import RopeInputs
from mrv2.contract.forward_context import BidirectionalSpan, get_forward_context
from mrv2.contract.kv_cache import KVCacheLayer, PagedKVSpec
from mrv2.layers.rotary import RotaryEmbedding
from mrv2_kernels.rotary import QKNorm

_NO_OPTIONS: dict[str, Any] = {}


class Attention(KVCacheLayer):
    """Causal paged attention over layer ``layer_idx``'s KV cache (no parameters); query rows
    in the forward context's :class:`~mrv2.contract.forward_context.BidirectionalSpan` s also
    see their span's later keys (an image's tokens in Gemma 3).

    Declares a :class:`PagedKVSpec` cache; the metadata, this layer's cache tensor and its
    backend come from the forward context the runner sets around each forward
    (:func:`mrv2.attention.set_forward_context`).
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
        #: Keys a query sees, its own included (None: all before it); HF's ``sliding_window``.
        self.sliding_window = sliding_window
        #: Scores soft-capped to ``cap * tanh(score / cap)`` (Gemma 2); None: not capped.
        self.logit_softcap = logit_softcap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def kv_cache_spec(self) -> PagedKVSpec:
        """Keys and values of ``num_kv_heads`` heads of ``head_dim`` per token (and the
        window, whose blocks before it the runner may free)."""
        return PagedKVSpec(self.num_kv_heads, self.head_dim, self.sliding_window)

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
                self.logit_softcap is not None):
            extra = self._options(backend, sinks)
        kv_write = None
        if rotary is not None:
            if positions is None:
                raise ValueError("Attention.forward: rotary needs positions")
            table = (rotary.whole_head_table(positions)
                     if backend.rope_in_attention and not ctx.bidirectional else None)
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
        if ctx.bidirectional:
            out = out.reshape(num_tokens, self.num_heads, self.head_dim)
            for span in ctx.bidirectional:
                self._attend_span(out, query, kv_cache, metadata, span, sinks)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _attend_span(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: Any, span: BidirectionalSpan, sinks: torch.Tensor | None) -> None:
        """Overwrite the causal output of ``span``'s query rows with attention that also sees
        the span's later keys (:class:`~mrv2.contract.forward_context.BidirectionalSpan`): in
        torch, fp32, over keys gathered from the paged cache (every paged backend's layout,
        ``[2, num_blocks, block_size, Hk, D]``; an fp8 cache read as floats, as the kernels
        read it). Runs only in steps that compute an image's tokens (eager steps: the model
        state keeps them out of the CUDA graphs); index tensors come from host integers, so
        nothing synchronizes."""
        n = span.end - span.first_position
        window = self.sliding_window
        lo = 0 if window is None else max(0, span.first_position - window + 1)
        device = query.device
        pos = torch.arange(lo, span.end, device=device)
        blocks = metadata.block_table[span.request].to(torch.int64)[pos // metadata.block_size]
        offsets = pos % metadata.block_size
        key = kv_cache[0][blocks, offsets].to(torch.float32)  # [m, Hk, D]
        value = kv_cache[1][blocks, offsets].to(torch.float32)
        group = self.num_heads // self.num_kv_heads
        q = query[span.first_row: span.first_row + n].to(torch.float32)
        q = q.reshape(n, self.num_kv_heads, group, self.head_dim)
        scores = torch.einsum("nkgd,mkd->kgnm", q, key) * self.scale
        if self.logit_softcap is not None:
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        if window is not None:  # the window's lower bound holds for the span's queries too
            qpos = torch.arange(span.first_position, span.end, device=device)
            seen = pos[None, :] > qpos[:, None] - window  # [n, m]
            scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:  # a sink column per head (in the denominator only)
            sink = sinks.to(torch.float32).reshape(self.num_kv_heads, group, 1, 1)
            scores = torch.cat([scores, sink.expand(-1, -1, n, 1)], dim=-1)
            probs = scores.softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        rows = torch.einsum("kgnm,mkd->nkgd", probs, value)
        out[span.first_row: span.first_row + n] = rows.reshape(
            n, self.num_heads, self.head_dim).to(out.dtype)

    def _options(self, backend: Any, sinks: torch.Tensor | None) -> dict[str, Any]:
        """This layer's attention options for ``backend``'s call; a ValueError where the
        backend does not take one."""
        extra: dict[str, Any] = {}
        for option, value, able in (("sliding_window", self.sliding_window, "sliding_window"),
                                    ("logit_softcap", self.logit_softcap, "logit_softcap"),
                                    ("sinks", sinks, "attention_sinks")):
            if value is None:
                continue
            if not getattr(backend, able):
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
        )
