"""What model-based drafters share: one-token drafting steps over the state table, on the device.

A drafter with a KV cache of its own (a draft model, MTP layers, Eagle heads) runs, after each
target step, steps of one token per request at positions past what the target has verified.
:class:`DraftSteps` builds their attention metadata from the state table (positions, slots and
sequence lengths on the device; the host only bounds the longest sequence), draws drafts the way
the target draws its tokens, and writes them where the next step reads them.

A drafter that reads the target's hidden states (MTP layers, EAGLE heads) first runs a catch-up
pass over the step's tokens (:func:`catch_up_inputs`, :func:`first_draft_rows`): row ``j``
pairs the target's hidden state at position ``p`` with the token that follows it in the
request's state-table row (the next prompt token, an accepted draft, or the token just
sampled), at position ``p``. After the post-update a request holds ``n`` tokens, so its row at
position ``n - 2`` (whose following token is the last one, at ``n - 1``) predicts the first
draft, at ``n``. Device work only; shapes from ``num_tokens_padded`` and ``num_reqs``.
"""

from __future__ import annotations

from typing import Any

import torch

from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch
from mrv2.contract.state_table import RequestStateTable
from mrv2_kernels.gumbel import gumbel_sample_rows
from mrv2_kernels.spec_decode import write_drafts

_GREEDY_EPS = 1e-5


class DraftSteps:
    """One target step's drafting context for its ``num_reqs`` requests (``batch`` after the
    post-update: ``table.num_tokens`` counts this step's tokens).

    ``active``: the requests that sampled this step (the others only had a prompt chunk). The
    block table is the state table's rows: the step's own stops at its last block, and drafting
    writes into the lookahead blocks past it (which the scheduler reserved).
    """

    def __init__(self, batch: InputBatch, table: RequestStateTable, num_sampled: torch.Tensor,
                 block_size: int, num_drafts: int) -> None:
        self.table = table
        self.num_reqs = num_reqs = batch.num_reqs
        self.rows = batch.idx_mapping[:num_reqs].long()
        self.width = table.token_ids.shape[1]  # max_model_len
        self.block_table = table.block_table[self.rows]
        self.active = num_sampled[:num_reqs] > 0
        self.num_tokens = table.num_tokens[self.rows].long()
        self.block_size = block_size
        self.device = table.token_ids.device
        self.starts = torch.arange(num_reqs + 1, dtype=torch.int32, device=self.device)
        self.max_seq_len = min(batch.max_seq_len + 1 + num_drafts, self.width)

    def positions(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pos, valid)``: position ``num_tokens - 1 + offset`` of each request, and whether
        it is an active request's whose draft slot ``pos + 1`` exists. Clamped into
        ``1 .. width - 2``, so ``pos - 1`` and ``pos + 1`` address the row for every request: an
        active one has ``num_tokens >= 2`` (a prompt token and a sampled one), an inactive one
        (a prompt chunk, a graph's padding on a free row) may have none."""
        pos = self.num_tokens - 1 + offset
        valid = self.active & (pos + 1 < self.width)
        return pos.clamp(min=1, max=self.width - 2), valid

    def metadata(self, pos: torch.Tensor, valid: torch.Tensor) -> AttentionMetadata:
        """Attention metadata of one token per request at ``pos`` (KV written only where
        ``valid``)."""
        size = self.block_size
        block = self.block_table.gather(1, (pos // size)[:, None]).squeeze(1).long()
        return AttentionMetadata(
            num_reqs=self.num_reqs, num_tokens=self.num_reqs, max_query_len=1,
            max_seq_len=self.max_seq_len, query_start_loc=self.starts,
            seq_lens=(pos + 1).to(torch.int32), block_table=self.block_table,
            slot_mapping=torch.where(valid, block * size + pos % size, -1),
            block_size=size, uniform_decode=True,
        )

    def tokens_at(self, pos: torch.Tensor) -> torch.Tensor:
        """``[num_reqs]`` int32: each request's token at ``pos``."""
        return self.table.token_ids[self.rows, pos].to(torch.int32)

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, sampling: Any,
             argmax: bool) -> torch.Tensor:
        """Drafts for position ``pos`` from the drafter's ``logits`` ``[num_reqs, V]``: the
        argmax for greedy requests (or everywhere with ``argmax``, or without ``sampling``),
        else Gumbel-max over ``logits / temperature`` with the request's seed and ``pos``:
        the noise the target draws its own token there with."""
        drafts = torch.empty(self.num_reqs, dtype=torch.int64, device=self.device)
        if sampling is None or argmax:
            return drafts.copy_(logits.argmax(dim=-1))
        gumbel_sample_rows(logits, self.rows, sampling.seed, sampling.temperature, pos, drafts,
                           _GREEDY_EPS)
        return drafts

    def write(self, pos: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor) -> None:
        """Store ``drafts`` at ``pos`` in the token rows of the ``valid`` requests (masked
        stores: a CUDA graph's padding requests may name live rows)."""
        write_drafts(self.table.token_ids, self.rows, pos.contiguous(), drafts, valid)


def catch_up_inputs(batch: InputBatch, table: RequestStateTable
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [T], following [T] int32)`` over the step's ``T = num_tokens_padded``
    tokens: each token's position, and the token at the next position of its request's row
    (clamped into the row; padding tokens read their last request's row)."""
    num_tokens, num_reqs = batch.num_tokens_padded, batch.num_reqs
    positions = batch.positions[:num_tokens]
    ends = batch.query_start_loc[1 : num_reqs + 1].long()
    index = torch.arange(num_tokens, device=positions.device)
    token_req = torch.searchsorted(ends, index, right=True).clamp(max=num_reqs - 1)
    rows = batch.idx_mapping[token_req].long()
    width = table.token_ids.shape[1]
    following = table.token_ids[rows, (positions + 1).clamp(max=width - 1)]
    return positions, following.to(torch.int32)


def first_draft_rows(batch: InputBatch, positions: torch.Tensor, num_tokens: torch.Tensor
                     ) -> torch.Tensor:
    """``[num_reqs]``: each request's row of the step at position ``num_tokens - 2`` (its
    token count after the post-update; clamped into the step for requests that sampled
    nothing)."""
    total = positions.shape[0]
    starts = batch.query_start_loc[: batch.num_reqs].long()
    first = positions[starts.clamp(max=total - 1)]
    return (starts + num_tokens - 2 - first).clamp(min=0, max=total - 1)
