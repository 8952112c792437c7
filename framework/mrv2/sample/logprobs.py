"""Logprobs of chosen tokens: log-softmax at a few ids per row, never the whole vocabulary."""

from __future__ import annotations

import torch

from mrv2_kernels.logprobs import logprob_stats


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, raw_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [N, 1+k], logprobs [N, 1+k], rank [N])`` of ``tokens`` and the top-k ids.

    Only ``1 + k`` log-softmax values per row are formed: the row's logsumexp and the chosen
    token's rank come from one pass of :func:`mrv2_kernels.logprobs.logprob_stats`.
    ``raw_logits`` (``logprobs_mode="raw_logits"``): the logits themselves instead (the same
    ids and ranks: log-softmax keeps a row's order).
    """
    lse, rank = logprob_stats(logits, tokens)
    ids = tokens.long()[:, None]
    if k > 0:
        ids = torch.cat([ids, logits.topk(min(k, logits.shape[1]), dim=-1).indices], dim=1)
    values = logits.gather(1, ids).float()
    if not raw_logits:
        values = values - lse[:, None]
    return ids, values, rank
