"""What model-based drafters share: one-token drafting steps over the state table, on the device.

A drafter with a KV cache of its own (a draft model, MTP layers, Eagle heads) runs, after each
target step, steps of one token per request at positions past what the target has verified.
:class:`DraftSteps` builds their attention metadata from the state table (positions, slots and
sequence lengths on the device; the host only bounds the longest sequence), draws drafts the way
the target draws its tokens, and writes them where the next step reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch
from mrv2.contract.state_table import RequestStateTable
from mrv2_kernels.gumbel import gumbel_sample
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
        temperature = sampling.temperature[self.rows]
        gumbel_sample(logits, sampling.seed[self.rows], pos, temperature < _GREEDY_EPS, drafts,
                      temperature)
        return drafts

    def write(self, pos: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor) -> None:
        """Store ``drafts`` at ``pos`` in the token rows of the ``valid`` requests (masked
        stores: a CUDA graph's padding requests may name live rows)."""
        write_drafts(self.table.token_ids, self.rows, pos.contiguous(), drafts, valid)
