"""Prompt logprobs, computed from a step's hidden states in bounded slices.

A prefill chunk of a request that asked for ``prompt_logprobs`` covers positions
``[start, end)``; the hidden state at position ``p`` predicts prompt token ``p + 1``, so the
chunk yields the logprobs of prompt tokens ``start + 1 .. min(end, prefill_len - 1)`` (the
target ids are read from the state table on the device). The hidden rows of all such requests
are projected to logits ``slice_tokens`` at a time, so an 8K-token prompt holds at most a
``[slice_tokens, vocab]`` logits tensor, never ``[8K, vocab]``. Values are raw-model logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mrv2.contract.staging import to_device
from mrv2.contract.state_table import RequestStateTable
from mrv2.sample.logprobs import token_logprobs

#: Hidden rows turned into logits at a time (bounds the peak ``[slice, vocab]`` tensor).
DEFAULT_SLICE_TOKENS = 1024


@dataclass
class PromptLogprobs:
    """Prompt logprobs of one request's prefill chunk, on the device until copied."""

    req_id: str
    first_position: int
    """Prompt position of the first row (its token is ``prompt[first_position]``)."""
    ids: torch.Tensor
    """``[n, 1 + k]`` int64: the actual prompt token, then the top-k ids."""
    logprobs: torch.Tensor
    """``[n, 1 + k]`` float32."""
    ranks: torch.Tensor
    """``[n]`` int64 rank of the actual prompt token."""


@dataclass
class PromptChunk:
    """CPU description of one request's part of the step: where its hidden rows lie."""

    req_id: str
    row: int
    """State-table row."""
    hidden_start: int
    """Index of the chunk's first token in the step's hidden states."""
    position: int
    """Prompt position of that token."""
    count: int
    """Hidden rows whose next token is a prompt token (may be 0)."""
    k: int


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    table: RequestStateTable,
    chunks: list[PromptChunk],
    slice_tokens: int | None = None,
) -> list[PromptLogprobs]:
    """Prompt logprobs of ``chunks``, projecting at most ``slice_tokens`` hidden rows at once
    (default :data:`DEFAULT_SLICE_TOKENS`, read at call time)."""
    slice_tokens = slice_tokens or DEFAULT_SLICE_TOKENS
    chunks = [c for c in chunks if c.count > 0]
    if not chunks:
        return []
    device = hidden.device
    k = max(c.k for c in chunks)
    hidden_idx = to_device(torch.cat([torch.arange(c.hidden_start, c.hidden_start + c.count)
                                      for c in chunks]), torch.int64, device)
    rows = torch.cat([torch.full((c.count,), c.row, dtype=torch.int64) for c in chunks])
    targets_pos = torch.cat([torch.arange(c.position + 1, c.position + 1 + c.count)
                             for c in chunks])
    targets = table.token_ids[to_device(rows, torch.int64, device),
                              to_device(targets_pos, torch.int64, device)].long()
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for s in range(0, hidden_idx.numel(), slice_tokens):
        logits = compute_logits(hidden[hidden_idx[s : s + slice_tokens]])
        parts.append(token_logprobs(logits, targets[s : s + slice_tokens], k))
        del logits
    ids = torch.cat([p[0] for p in parts])
    values = torch.cat([p[1] for p in parts])
    ranks = torch.cat([p[2] for p in parts])
    out, offset = [], 0
    for c in chunks:
        sl = slice(offset, offset + c.count)
        out.append(PromptLogprobs(c.req_id, c.position + 1, ids[sl, : 1 + c.k],
                                  values[sl, : 1 + c.k], ranks[sl]))
        offset += c.count
    return out
