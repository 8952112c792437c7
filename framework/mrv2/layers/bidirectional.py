"""Attention rows of :class:`~mrv2.contract.forward_context.BidirectionalSpan` s: the query rows
of a span (an image's tokens in Gemma 3) see every key a causal query sees plus the span's later
keys, within the layer's sliding window (its lower bound still holds: HF's ``AND(window,
OR(causal, same image))``).

The paged kernels are causal; :func:`attend_spans` recomputes the span rows after them, in
torch (fp32), over keys gathered from the paged cache. A step's spans are packed once per block
table and window (:func:`_plan`, kept in the metadata's ``derived`` scratch, so every layer of
the step reuses it) into groups of at most :data:`MAX_GROUP_ELEMENTS` score elements: each
group is a padded ``[G, Q]`` batch of query rows against ``[G, M]`` key positions, so a layer
runs a dozen launches a group whatever the number of images. Every index comes from host
integers (the spans') and is staged to the device without a synchronization; the rows are
written back with ``index_copy_``. Only steps that compute image tokens get here, and they run
eager (their model state keeps them out of the CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mrv2.contract.forward_context import BidirectionalSpan
from mrv2.contract.staging import to_device

__all__ = ["MAX_GROUP_ELEMENTS", "attend_spans"]

#: Score elements (heads x query rows x keys, fp32) a group of spans computes at once.
MAX_GROUP_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class _Group:
    """Spans packed for one batched computation."""

    query_rows: torch.Tensor  # [G, Q] step rows (padding: the group's first row)
    key_positions: torch.Tensor  # [G, M] positions (padding: the span's first key)
    requests: torch.Tensor  # [G] the spans' batch rows
    seen: torch.Tensor  # [G, 1, 1, Q, M] bool: query sees key
    dest_rows: torch.Tensor  # [R] the step rows written back
    src_index: torch.Tensor  # [R] their index in the flat [G * Q] result


def _plan(spans: Sequence[BidirectionalSpan], window: int | None, heads: int,
          device: torch.device) -> list[_Group]:
    """The groups of a step's spans for a layer of ``window`` (None: full attention)."""
    groups: list[_Group] = []
    order = list(spans)
    while order:
        first = order[0]
        span_len = [s.end - s.first_position for s in order]
        lows = [0 if window is None else max(0, s.first_position - window + 1) for s in order]
        take, q_max, m_max = 0, 0, 0
        for i, s in enumerate(order):
            q, m = max(q_max, span_len[i]), max(m_max, s.end - lows[i])
            if take and (take + 1) * heads * q * m > MAX_GROUP_ELEMENTS:
                break
            take, q_max, m_max = take + 1, q, m
        chosen, order = order[:take], order[take:]
        rows = np.full((take, q_max), first.first_row, dtype=np.int64)
        qpos = np.zeros((take, q_max), dtype=np.int64)
        kpos = np.zeros((take, m_max), dtype=np.int64)
        kvalid = np.zeros((take, m_max), dtype=bool)
        qvalid = np.zeros((take, q_max), dtype=bool)
        for g, s in enumerate(chosen):
            n, lo = span_len[g], lows[g]
            rows[g, :n] = np.arange(s.first_row, s.first_row + n)
            qpos[g, :n] = np.arange(s.first_position, s.end)
            qvalid[g, :n] = True
            kpos[g] = lo
            kpos[g, : s.end - lo] = np.arange(lo, s.end)
            kvalid[g, : s.end - lo] = True
        seen = kvalid[:, None, :] & qvalid[:, :, None]
        if window is not None:
            seen &= kpos[:, None, :] > qpos[:, :, None] - window
        flat = np.flatnonzero(qvalid)
        groups.append(_Group(
            to_device(rows, torch.int64, device), to_device(kpos, torch.int64, device),
            to_device(np.array([s.request for s in chosen]), torch.int64, device),
            to_device(seen, torch.bool, device)[:, None, None],
            to_device(rows.reshape(-1)[flat], torch.int64, device),
            to_device(flat, torch.int64, device)))
    return groups


def attend_spans(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                 spans: Sequence[BidirectionalSpan], *, scale: float, window: int | None,
                 logit_softcap: float | None, sinks: torch.Tensor | None) -> None:
    """Overwrite the causal output ``out`` ``[T, H, D]`` of the spans' query rows (``query``
    ``[T, H, D]``, already rotated) with attention that also sees each span's later keys, read
    from ``kv_cache`` (every paged backend's layout, ``[2, num_blocks, block_size, Hk, D]``; an
    fp8 cache read as floats, as the kernels read it) through ``metadata``'s block table."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    key = ("bidirectional_spans", window)
    cached = metadata.derived.get(key)
    if cached is None or cached[0] is not spans:
        cached = (spans, _plan(spans, window, heads, query.device))
        metadata.derived[key] = cached
    size = metadata.block_size
    for g in cached[1]:
        blocks = metadata.block_table[g.requests[:, None], g.key_positions // size]
        offsets = g.key_positions % size
        k = kv_cache[0][blocks.to(torch.int64), offsets].to(torch.float32)  # [G, M, Hk, D]
        v = kv_cache[1][blocks.to(torch.int64), offsets].to(torch.float32)
        q = query[g.query_rows].to(torch.float32)  # [G, Q, H, D]
        q = q.reshape(*q.shape[:2], kv_heads, group, dim)
        scores = torch.einsum("bqkgd,bmkd->bkgqm", q, k) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        scores = scores.masked_fill(~g.seen, float("-inf"))
        if sinks is not None:  # a sink column per head (in the denominator only)
            sink = sinks.to(torch.float32).reshape(1, kv_heads, group, 1, 1)
            sink = sink.expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        rows = torch.einsum("bkgqm,bmkd->bqkgd", probs, v).reshape(-1, heads, dim)
        out.index_copy_(0, g.dest_rows, rows.index_select(0, g.src_index).to(out.dtype))
