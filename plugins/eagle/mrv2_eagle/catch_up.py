"""The catch-up pass of a drafter that reads the target's hidden states (EAGLE heads, MTP
layers): which token goes beside each hidden state, and which row gives the first draft.

Row ``j`` of the step pairs the target's hidden state at position ``p`` with the token that
follows it in the request's state-table row (the next prompt token, an accepted draft, or the
token just sampled), at position ``p``. After the post-update a request holds ``n`` tokens, so
its row at position ``n - 2`` (whose following token is the last one, at ``n - 1``) predicts
the first draft, at ``n``. Device work only; shapes from ``num_tokens_padded`` and
``num_reqs``.
"""

from __future__ import annotations

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.state_table import RequestStateTable


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
