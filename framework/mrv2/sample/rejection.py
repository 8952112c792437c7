"""Verification of drafts: a step's sampled tokens become each request's output tokens.

*Strict* rejection (the default, DESIGN.md section 6): the sampler has drawn the target's own
token at every logits row with the noise of that row's position, exactly as it would without
speculation; a request keeps its drafts while each equals the target's token at its position
and adds the target's token at the first mismatch (or after the last draft). Greedy and seeded
requests therefore produce the same tokens with speculation on or off.

*Probabilistic* rejection (``speculative_config["rejection_sample_method"] =
"probabilistic"``): draft ``d`` drawn from the drafter's ``q`` is kept with probability
``min(1, p(d) / q(d))`` under the target's ``p`` (the distribution the sampler draws from:
after penalties, masks, temperature, top-k/top-p), and the first rejected position takes a
sample of ``max(p - q, 0)`` normalized (Leviathan et al., 2023): the output has the target's
distribution, and at temperature > 0 more drafts survive than under the strict test, which
needs the target's own sample to equal the draft. Deterministic drafters (n-gram) have a
one-hot ``q``. Greedy rows are verified strictly either way. See
:mod:`mrv2_kernels.prob_rejection`.

*Synthetic* acceptance (``"synthetic"``, benchmarks only: the output is not the model's) keeps
each draft with probability ``synthetic_acceptance_rate``, from the same acceptance uniform as
the probabilistic test, and ends at the first draft it drops with the target's token there
(another token if that equals the draft): the cost of any acceptance rate, measured without a
drafter that reaches it.
"""

from __future__ import annotations

import dataclasses

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.samples import StepSamples
from mrv2.sample.logprobs import token_logprobs
from mrv2.sample.sampler import SamplerOutput, VerifyInputs
from mrv2_kernels.prob_rejection import acceptance_uniform_ref, probabilistic_rejection
from mrv2_kernels.spec_decode import strict_rejection


def synthetic_targets(batch: InputBatch, sampled: torch.Tensor, verify: VerifyInputs,
                      rate: float) -> torch.Tensor:
    """``sampled`` with each draft row's token replaced by its draft where the row's acceptance
    uniform is below ``rate``, and by a token other than the draft where not; strict rejection
    of the result keeps each draft with probability ``rate`` (device ops of static shape)."""
    assert batch.cu_num_logits_dev is not None
    num_logits = sampled.shape[0]
    ends = batch.cu_num_logits_dev[1 : batch.num_reqs + 1].long() - 1  # each bonus row
    bonus = torch.zeros(num_logits + 1, dtype=torch.bool, device=sampled.device)
    bonus.scatter_(0, ends.clamp(min=-1) + 1, True)  # (a request without rows: index 0)
    is_bonus = bonus[1:]
    next_idx = (batch.logits_indices[:num_logits].long() + 1).clamp(
        max=batch.input_ids.shape[0] - 1)
    draft = batch.input_ids[next_idx].long()
    keep = acceptance_uniform_ref(verify.seeds, verify.positions) < rate
    other = torch.where(sampled == draft, (draft + 1) % verify.logits.shape[1], sampled)
    return torch.where(is_bonus, sampled, torch.where(keep, draft, other))


def step_samples(
    batch: InputBatch, sampled: torch.Tensor, do_sample: torch.Tensor,
    verify: VerifyInputs | None = None, draft_probs: torch.Tensor | None = None,
) -> StepSamples:
    """The step's tokens per request from ``sampled`` (one per logits row).

    ``do_sample`` (``[num_reqs]`` int32, device) zeroes requests that produce nothing this step
    (a prompt chunk that does not reach the end of the prompt). With ``verify`` (the sampler
    keeps it when probabilistic rejection is on and the step has drafts) the drafts are
    verified probabilistically, against ``draft_probs`` (``[num_logits, V]``, the drafter's
    distributions at the draft rows; None: one-hot, a deterministic drafter). With
    ``verify.synthetic_rate`` the drafts are kept at that rate instead
    (:func:`synthetic_targets`).
    """
    num_reqs = batch.num_reqs
    if batch.max_draft_tokens == 0:
        return StepSamples(sampled[:num_reqs, None], do_sample)
    width = 1 + batch.max_draft_tokens
    assert batch.cu_num_logits_dev is not None
    tokens = torch.empty(num_reqs, width, dtype=torch.int64, device=sampled.device)
    num_out = torch.empty(num_reqs, dtype=torch.int32, device=sampled.device)
    if verify is not None and verify.synthetic_rate is not None:
        sampled = synthetic_targets(batch, sampled, verify, verify.synthetic_rate)
    if verify is None or verify.synthetic_rate is not None:
        strict_rejection(sampled, batch.cu_num_logits_dev, batch.input_ids,
                         batch.logits_indices, num_reqs, tokens, num_out)
    else:
        probabilistic_rejection(
            verify.logits, verify.temperature, verify.seeds, verify.positions, sampled,
            batch.cu_num_logits_dev, batch.input_ids, batch.logits_indices, num_reqs, tokens,
            num_out, draft_probs=draft_probs,
        )
    return StepSamples(tokens, num_out * do_sample)


def kept_token_logprobs(batch: InputBatch, logits: torch.Tensor, out: SamplerOutput,
                        samples: StepSamples, raw_logits: bool = False) -> SamplerOutput:
    """``out`` with each logits row's logprobs those of the token the step kept at its
    position, after drafts verified other than strictly (``out.verify``): a rejected
    position's token is a resample of ``max(p - q, 0)`` (or, synthetic, another token), not
    the row's own sample, whose logprobs the sampler gave. ``logits`` are the step's raw
    logits (what logprobs are of); rows past a request's kept tokens keep their sample's.
    Device ops only."""
    if out.logprob_ids is None or out.verify is None or not batch.max_draft_tokens:
        return out
    n, k = out.logprob_ids.shape[0], out.logprob_ids.shape[1] - 1
    request, offset = batch.logits_row_offsets(n)
    kept = samples.tokens[request, offset.clamp(max=samples.tokens.shape[1] - 1)]
    tokens = torch.where(kept >= 0, kept, out.tokens[:n])
    ids, values, rank = token_logprobs(logits[:n], tokens, k, raw_logits)
    return dataclasses.replace(out, logprob_ids=ids, logprobs=values, sampled_rank=rank)

