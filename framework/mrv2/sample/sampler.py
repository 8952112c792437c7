"""The sampler stage: logits -> fp32 -> processors -> penalties -> bias / masks ->
temperature -> min-p -> top-k/top-p -> Gumbel-max with stateless (seed, position, token) noise,
then (when asked) logprobs of the raw logits.

Per-request parameters are read from the state table through ``idx_mapping``; which stages run
is decided from CPU-side flags of the batch's rows, never by reading the device. The rarely used
stages cost nothing (one integer test) while no live request uses them.

Logprobs are those of the raw model distribution, before processors, penalties, bias and
temperature (vLLM's default ``logprobs_mode="raw_logprobs"``): log-softmax is evaluated only at
the top-k ids and the sampled id (``logits - logsumexp``), never for the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.runner.input_batch import InputBatch
from mrv2.runner.state_table import RequestStateTable
from mrv2.sample.logits_processor import LogitsProcessor
from mrv2.sample.masks import apply_masks
from mrv2.sample.params import SamplingParams
from mrv2_kernels.gumbel import gumbel_sample
from mrv2_kernels.logprobs import logprob_stats
from mrv2_kernels.penalties import apply_penalties
from mrv2_kernels.top_k_top_p import top_k_top_p

_GREEDY_EPS = 1e-5


@dataclass
class SamplerOutput:
    """One step's samples, plus logprobs when a request of the batch asked for them."""

    tokens: torch.Tensor
    """``[num_reqs]`` int64 sampled token ids."""
    logprob_ids: torch.Tensor | None = None
    """``[num_reqs, 1 + k]`` int64: the sampled id, then the top-k ids (k: the batch's max)."""
    logprobs: torch.Tensor | None = None
    """``[num_reqs, 1 + k]`` float32 raw-distribution logprobs of ``logprob_ids``."""
    sampled_rank: torch.Tensor | None = None
    """``[num_reqs]`` int64 rank of the sampled token (1 = most likely)."""


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [N, 1+k], logprobs [N, 1+k], rank [N])`` of ``tokens`` and the top-k ids.

    Only ``1 + k`` log-softmax values per row are formed: the row's logsumexp and the chosen
    token's rank come from one pass of :func:`mrv2_kernels.logprobs.logprob_stats`.
    """
    lse, rank = logprob_stats(logits, tokens)
    ids = tokens.long()[:, None]
    if k > 0:
        ids = torch.cat([ids, logits.topk(min(k, logits.shape[1]), dim=-1).indices], dim=1)
    values = logits.gather(1, ids).float() - lse[:, None]
    return ids, values, rank


class Sampler:
    """The built-in sampler. ``sampler(logits, batch, table) -> SamplerOutput``."""

    def __init__(self, processors: list[LogitsProcessor] | None = None) -> None:
        self.processors = list(processors or [])

    def __call__(
        self, logits: torch.Tensor, batch: InputBatch, table: RequestStateTable
    ) -> SamplerOutput:
        """Sample one token per request of ``batch`` from its row of ``logits``."""
        raw = logits
        special = _special_rows(batch, table)
        max_logprobs = max((p.logprobs for _, p in special if p.logprobs is not None),
                           default=-1)
        if self.processors or special:  # in-place stages work on an fp32 copy
            logits = logits.float()
            if max_logprobs >= 0 and logits.data_ptr() == raw.data_ptr():
                logits = logits.clone()  # the in-place stages must not touch the raw logits
        for processor in self.processors:
            processor.apply(logits, batch, table)
        idx = batch.idx_mapping[: batch.num_reqs]
        if special:
            if table.output_counts is not None and any(p.uses_penalties for _, p in special):
                assert table.prompt_mask is not None
                apply_penalties(logits, idx, table.output_counts, table.prompt_mask,
                                table.repetition_penalty, table.frequency_penalty,
                                table.presence_penalty)
            apply_masks(logits, idx, table, special)
        rows = idx.long()
        temperature = table.temperature[rows]
        greedy = temperature < _GREEDY_EPS
        scale: torch.Tensor | None = None  # the temperature, when the sampling kernel applies it
        if not batch.all_greedy:
            if batch.any_min_p or batch.any_top_k_top_p:
                logits = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
                if batch.any_min_p:
                    logits = apply_min_p(logits, table.min_p[rows])
                if batch.any_top_k_top_p:  # in place: ``logits`` is this step's own copy
                    logits = top_k_top_p(logits, table.top_k[rows], table.top_p[rows],
                                         out=logits)
            else:
                scale = temperature  # same IEEE division, inside the kernel: no extra pass
        out = torch.empty(batch.num_reqs, dtype=torch.int64, device=logits.device)
        positions = batch.seq_lens[: batch.num_reqs].long()
        gumbel_sample(logits, table.seed[rows], positions, greedy, out, scale)
        if max_logprobs < 0:
            return SamplerOutput(out)
        ids, values, rank = token_logprobs(raw, out, max_logprobs)
        return SamplerOutput(out, ids, values, rank)


def _special_rows(batch: InputBatch, table: RequestStateTable) -> list[tuple[int, SamplingParams]]:
    """``(batch index, params)`` of the batch's requests that use a rarely-used stage."""
    if table.num_special == 0:
        return []
    rows = batch.idx_mapping_cpu
    if rows is None:
        rows = np.asarray([table.row_of(r) for r in batch.req_ids[: batch.num_reqs]])
    out = []
    for b, row in enumerate(rows[: batch.num_reqs].tolist()):
        info = table.info[row]
        if info.special and info.params is not None:
            out.append((b, info.params))
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

    Ties at the k-th value are kept; the token that crosses ``top_p`` is kept, and so is the
    rest of its tie group. Returns a new float32 tensor (see :mod:`mrv2_kernels.top_k_top_p`:
    a sort-free kernel on the GPU).
    """
    return top_k_top_p(logits, top_k, top_p)
