"""Verification of drafts: a step's sampled tokens become each request's output tokens.

*Strict* rejection (the default, DESIGN.md section 6): the sampler has drawn the target's own
token at every logits row with the noise of that row's position, exactly as it would without
speculation; a request keeps its drafts while each equals the target's token at its position
and adds the target's token at the first mismatch (or after the last draft). Greedy and seeded
requests therefore produce the same tokens with speculation on or off. (The probabilistic
``min(1, p/q)`` test belongs with drafters that sample from a distribution ``q``: the
model-based speculators.)
"""

from __future__ import annotations

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.samples import StepSamples
from mrv2_kernels.spec_decode import strict_rejection


def step_samples(batch: InputBatch, sampled: torch.Tensor, do_sample: torch.Tensor) -> StepSamples:
    """The step's tokens per request from ``sampled`` (one per logits row).

    ``do_sample`` (``[num_reqs]`` int32, device) zeroes requests that produce nothing this step
    (a prompt chunk that does not reach the end of the prompt).
    """
    num_reqs = batch.num_reqs
    if batch.max_draft_tokens == 0:
        return StepSamples(sampled[:num_reqs, None], do_sample)
    width = 1 + batch.max_draft_tokens
    assert batch.cu_num_logits_dev is not None
    tokens = torch.empty(num_reqs, width, dtype=torch.int64, device=sampled.device)
    num_out = torch.empty(num_reqs, dtype=torch.int32, device=sampled.device)
    strict_rejection(sampled, batch.cu_num_logits_dev, batch.input_ids, batch.logits_indices,
                     num_reqs, tokens, num_out)
    return StepSamples(tokens, num_out * do_sample)
