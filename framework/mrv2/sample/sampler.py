"""The sampler stage: logits -> fp32 -> processors -> temperature -> min-p -> top-k/top-p ->
Gumbel-max with stateless (seed, position, token) noise.

Per-request parameters are read from the state table through ``idx_mapping``; which stages run
is decided from CPU-side flags of the batch's rows, never by reading the device.
"""

from __future__ import annotations

import torch

from mrv2.runner.input_batch import InputBatch
from mrv2.runner.state_table import RequestStateTable
from mrv2.sample.logits_processor import LogitsProcessor
from mrv2_kernels.gumbel import gumbel_sample

_GREEDY_EPS = 1e-5


class Sampler:
    """The built-in sampler. ``sampler(logits, batch, table) -> [num_reqs] int64 tokens``."""

    def __init__(self, processors: list[LogitsProcessor] | None = None) -> None:
        self.processors = list(processors or [])

    def __call__(
        self, logits: torch.Tensor, batch: InputBatch, table: RequestStateTable
    ) -> torch.Tensor:
        """Sample one token per request of ``batch`` from its row of ``logits``."""
        logits = logits.float()
        for processor in self.processors:
            processor.apply(logits, batch, table)
        rows = batch.idx_mapping[: batch.num_reqs].long()
        greedy = table.temperature[rows] < _GREEDY_EPS
        if not batch.all_greedy:
            temperature = torch.where(greedy, 1.0, table.temperature[rows])
            logits = logits / temperature[:, None]
            if batch.any_min_p:
                logits = apply_min_p(logits, table.min_p[rows])
            if batch.any_top_k_top_p:
                logits = apply_top_k_top_p(logits, table.top_k[rows], table.top_p[rows])
        out = torch.empty(batch.num_reqs, dtype=torch.int64, device=logits.device)
        positions = batch.seq_lens[: batch.num_reqs].long()
        gumbel_sample(logits, table.seed[rows], positions, greedy, out)
        return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the top token's (0 disables)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (k <= 0: all) within nucleus ``top_p``.

    Ties at the k-th value are kept; the token that crosses ``top_p`` is kept.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
