"""Penalties at draft rows: the drafts before a row count as outputs there.

A request that verifies drafts has a logits row per scheduled token: row ``j`` predicts the
token after its ``j``-th draft, so its penalties must count the drafts ``d_1 .. d_j`` as
outputs too, as a run without speculation counts the tokens it kept. The penalty kernel
(:func:`mrv2_kernels.penalties.apply_penalties`) applies the counts of the request's kept
tokens to every row; :func:`penalize_drafts` then adds what each row's preceding drafts
change: the repetition penalty of a token neither in the prompt nor generated before, the
frequency penalty of every occurrence, the presence penalty of a token not generated before.
Device ops over ``[rows, max drafts]`` pairs only (no vocabulary-wide copy, no host sync); the
drafts are read from the step's own input tokens.
"""

from __future__ import annotations

import torch

from mrv2.contract.batch import InputBatch


def penalize_drafts(logits: torch.Tensor, batch: InputBatch, output_counts: torch.Tensor,
                    prompt_mask: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """After the kept tokens' penalties: each logits row's preceding drafts' (in place).

    ``logits`` is ``[num_logits, V]`` float32 (the batch's rows); the penalty parameters are
    indexed by state-table row, as the kernel's; rows of requests without drafts, or whose
    penalties are off, are left as they are.
    """
    k = batch.max_draft_tokens
    n = logits.shape[0]
    if not k or n == 0:
        return
    device = logits.device
    rows = torch.arange(n, device=device)
    offset = batch.logits_row_offsets(n)[1]  # each row's drafts before it
    m = torch.arange(k, device=device)
    valid = m[None, :] < offset[:, None]  # [n, k]: draft j - m precedes row j
    where = (batch.logits_indices[:n, None] - m[None, :]).clamp(min=0)
    tokens = batch.input_ids[where].long()
    tokens = torch.where(valid, tokens, tokens[:, :1])  # (invalid pairs alias pair 0)
    table_rows = batch.logits_idx_mapping[:n].long()
    r = table_rows[:, None].expand(n, k)
    counted = output_counts[r, tokens]
    unseen = valid & (counted == 0)  # not generated before this step
    # a draft token seen earlier among the drafts: its presence counted once
    earlier = (tokens[:, :, None] == tokens[:, None, :]) & valid[:, None, :] & (
        m[None, None, :] > m[None, :, None])  # (pair m' > m: draft j - m' comes first)
    first = unseen & ~earlier.any(-1)
    cols = rows[:, None].expand(n, k)
    # repetition: a token neither in the prompt nor generated before (the kernel left it)
    rep = repetition[table_rows].float()[:, None]
    cur = logits[cols, tokens]
    scaled = torch.where(cur > 0, cur / rep, cur * rep)
    fresh = unseen & ~prompt_mask[r, tokens].bool()
    # every pair of a (row, token) writes the same value (aliases of pair 0 included)
    fresh = torch.where(valid, fresh, fresh[:, :1])
    logits.index_put_((cols, tokens), torch.where(fresh, scaled, cur))
    # frequency: every occurrence; presence: once, for a token not generated before
    freq = frequency[table_rows].float()[:, None]
    pres = presence[table_rows].float()[:, None]
    delta = torch.where(valid, -freq, 0.0) + torch.where(first, -pres, 0.0)
    logits.index_put_((cols, tokens), delta, accumulate=True)
