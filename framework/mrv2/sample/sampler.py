"""The sampler stage: logits -> structured outputs' masks -> fp32 -> processors -> bias / masks
-> penalties -> temperature -> min-p -> top-k/top-p -> Gumbel-max with stateless (seed,
position, token) noise, then (when asked) logprobs of the raw (masked) logits (or, with
``logprobs_mode="raw_logits"``, the raw logits themselves).

Per-request parameters are read from the state table through ``idx_mapping``; which stages run
is decided from CPU-side flags of the batch's rows, never by reading the device. The rarely used
stages cost nothing (one integer test) while no live request uses them.

Logprobs are those of the raw model distribution, before processors, penalties, bias and
temperature (vLLM's default ``logprobs_mode="raw_logprobs"``), but after a structured output's
mask, as vLLM's (a token the grammar forbids has logprob -inf, and the others share all the
probability): log-softmax is evaluated only at the top-k ids and the sampled id (``logits -
logsumexp``), never for the whole vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import NewRequest
from mrv2.contract.samples import StepSamples
from mrv2.contract.staged_edits import StagedEdits
from mrv2.contract.state_table import RequestStateTable
from mrv2.sample.draft_penalties import penalize_drafts
from mrv2.sample.logits_processor import LogitsProcessor
from mrv2.sample.logprobs import token_logprobs
from mrv2.sample.masks import apply_masks, apply_token_bitmask
from mrv2.sample.prompt_logprobs import PromptChunk, PromptLogprobs, compute_prompt_logprobs
from mrv2.sample.state import SamplingState
from mrv2_kernels.gumbel import divide_rows, gumbel_sample, gumbel_sample_rows
from mrv2_kernels.penalties import apply_penalties
from mrv2_kernels.top_k_top_p import top_k_top_p, top_k_top_p_keys

_GREEDY_EPS = 1e-5
#: ``0``: decode graphs get no second sampling tail for batches with top-k / top-p rows
#: (:meth:`Sampler.graph_plans`): those batches sample eagerly. Unset or anything else: they
#: sample in the graph (the default; H200, Qwen3-0.6B, top-k 20 / top-p 0.95: batch-1 time per
#: output token 1.07 -> 0.74 ms).
TOP_K_TAILS_ENV_VAR = "MRV2_TOP_K_TAIL_GRAPHS"
#: ``0``: top-k / top-p batches sample from a filtered fp32 copy of the logits (the path of
#: drafts to verify and min-p) instead of the filter's threshold keys applied inside the
#: sampling kernel (the default; the same tokens): for A/B runs.
TOP_K_KEYS_ENV_VAR = "MRV2_TOP_K_KEYS"


@dataclass
class SamplerOutput:
    """One step's samples, plus logprobs when a request of the batch asked for them."""

    tokens: torch.Tensor
    """``[num_logits]`` int64 sampled token ids, one per logits row."""
    logprob_ids: torch.Tensor | None = None
    """``[num_logits, 1 + k]`` int64: the sampled id, then the top-k ids (k: the batch's max)."""
    logprobs: torch.Tensor | None = None
    """``[num_logits, 1 + k]`` float32 raw-distribution logprobs of ``logprob_ids``."""
    sampled_rank: torch.Tensor | None = None
    """``[num_logits]`` int64 rank of the sampled token (1 = most likely)."""
    verify: VerifyInputs | None = None
    """What probabilistic rejection needs (kept only when it is on and drafts are verified)."""


@dataclass
class VerifyInputs:
    """The target distribution at each logits row, as the Gumbel sample saw it:
    ``softmax(logits / temperature)`` (``temperature`` 0: a greedy row), and the row's noise
    keys."""

    logits: torch.Tensor
    """``[num_logits, V]`` processed logits (penalties, masks, top-k/top-p applied)."""
    temperature: torch.Tensor
    """``[num_logits]`` fp32: what ``logits`` is still to be divided by; 0 for greedy rows."""
    seeds: torch.Tensor
    """``[num_logits]`` int64 request seeds."""
    positions: torch.Tensor
    """``[num_logits]`` int64 positions of the sampled tokens (the noise keys)."""
    synthetic_rate: float | None = None
    """Synthetic acceptance (benchmarks): keep each draft with this probability instead."""


@dataclass
class SamplePlan:
    """What a batch needs from the sampler, decided on the CPU before the forward."""

    rare: list[tuple[int, SamplingParams]] = field(default_factory=list)
    """``(logits row, params)`` of rows whose request uses a rarely-used stage."""
    all_greedy: bool = True
    any_min_p: bool = False
    any_top_k_top_p: bool = False
    max_logprobs: int = -1
    """The most top logprobs a request of the batch asked for (-1: none)."""
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    """Where this step's prompt tokens of ``prompt_logprobs`` requests lie."""
    bitmasks: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """``(logits row, allowed-token bitmask)`` of structured-output rows that sample (not rare
    rows by themselves: :meth:`Sampler.apply_bitmasks` masks the logits in place first, so a
    decode graph's sampling tail may still sample them)."""


class Sampler:
    """The built-in sampler: ``sampler(logits, batch, table, plan) -> SamplerOutput``.

    Owns the per-request sampling columns (:class:`~mrv2.sample.state.SamplingState`); the
    runner tells it when a request takes or leaves a row and after each step's post-update.
    """

    #: What logprobs report (``EngineConfig.model.logprobs_mode``): "raw_logprobs" or
    #: "raw_logits" (the model's logits at the same ids). A class default too, so a subclass
    #: that builds itself without ``Sampler.__init__`` reports logprobs.
    logprobs_mode: str = "raw_logprobs"

    def __init__(
        self, max_num_reqs: int, vocab_size: int, device: torch.device,
        processors: list[LogitsProcessor] | None = None, verify_method: str | None = None,
        synthetic_rate: float | None = None, logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.processors = list(processors or [])
        self.logprobs_mode = logprobs_mode
        self.state = SamplingState(max_num_reqs, vocab_size, device)
        #: The non-strict rejection method in use ("probabilistic", "synthetic") or None: steps
        #: with drafts then keep :class:`VerifyInputs` (probabilistic: unless all greedy, which
        #: is verified strictly; synthetic: always, for the noise keys).
        self.verify_method = verify_method
        self.synthetic_rate = synthetic_rate if verify_method == "synthetic" else None

    @property
    def raw_logits(self) -> bool:
        """True when logprobs report the raw logits (``logprobs_mode="raw_logits"``)."""
        return self.logprobs_mode == "raw_logits"

    # -- requests ----------------------------------------------------------------------------

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field when this sampler cannot take ``params`` (a
        penalty past the counters' size limit: :meth:`SamplingState.check_params`). The engine
        calls it before it queues a request and the runner before a step's new requests take
        rows, so a refused request runs nothing. Changes nothing."""
        self.state.check_params(params)

    def add_request(self, request: NewRequest, row: int, staged: StagedEdits) -> None:
        """Stage ``request``'s sampling columns into ``row``."""
        self.state.add(row, request.sampling_params, request.seed, request.token_ids, staged)

    def add_requests(self, requests: list[NewRequest], rows: list[int],
                     staged: StagedEdits) -> None:
        """Stage the columns of a step's new ``requests`` into their ``rows`` (the runner's
        call): all at once here; a subclass that overrides :meth:`add_request` alone gets one
        call of it per request."""
        if type(self).add_request is not Sampler.add_request:
            for request, row in zip(requests, rows, strict=True):
                self.add_request(request, row, staged)
            return
        self.state.add_many(rows, [r.sampling_params for r in requests],
                            [r.seed for r in requests], [r.token_ids for r in requests], staged)

    def remove_request(self, row: int) -> None:
        """The request of ``row`` left."""
        self.state.remove(row)

    # -- per step ----------------------------------------------------------------------------

    #: The plan a decode CUDA graph's sampling tail is captured with: per-row temperature or
    #: greedy through the Gumbel kernel (greedy rows take the argmax whatever the plan, so one
    #: capture serves all-greedy batches too).
    graph_plan = SamplePlan(all_greedy=False)
    #: The plan of a second tail per graph (off with ``MRV2_TOP_K_TAIL_GRAPHS=0``): the same
    #: with top-k / top-p (rows without them keep every token).
    top_k_graph_plan = SamplePlan(all_greedy=False, any_top_k_top_p=True)

    def capturable(self, plan: SamplePlan) -> bool:
        """True when a batch with ``plan`` samples exactly as under :attr:`graph_plan`, so a
        captured tail may replace this call: no logits processors, rare stages (penalties,
        masks, logprobs), min-p or top-k/top-p; structured outputs' ``bitmasks`` do not count,
        as the runner applies them before a tail (:meth:`apply_bitmasks`). A subclass that
        overrides ``__call__`` is not assumed capturable (it overrides this too when it is)."""
        return (self._builtin() and not plan.rare and not plan.any_min_p
                and not plan.any_top_k_top_p)

    def graph_plans(self) -> list[SamplePlan]:
        """The plans the runner captures decode sampling tails with, one tail graph per plan
        and graph (a plan's index is its *variant*): :attr:`graph_plan` when
        :meth:`capturable` accepts it, then, unless ``MRV2_TOP_K_TAIL_GRAPHS=0``,
        :attr:`top_k_graph_plan` (its scratch, an fp32 copy of the logits and the filter's
        buffers, lives in the graphs' memory pool: :meth:`profile_scratch` measures it)."""
        if not self.capturable(self.graph_plan):
            return []
        if self._builtin() and os.environ.get(TOP_K_TAILS_ENV_VAR, "1") != "0":
            return [self.graph_plan, self.top_k_graph_plan]
        return [self.graph_plan]

    def _builtin(self) -> bool:
        """This class's own sampling, no logits processors: the only sampling whose plans
        :meth:`capturable` and :meth:`graph_variant` know."""
        return type(self).__call__ is Sampler.__call__ and not self.processors

    def graph_variant(self, plan: SamplePlan) -> int | None:
        """The index in :meth:`graph_plans` of the tail that samples a batch with ``plan``
        exactly as this sampler would, or None (sample eagerly). All-greedy batches take
        variant 0 whatever their top-k / top-p: their rows take the argmax, which those keep
        (``top_p > 0``)."""
        plans = self.graph_plans()
        if not plans:
            return None
        if self.capturable(plan):
            return 0
        if not self._builtin() or plan.rare or plan.any_min_p:
            return None
        if plan.all_greedy:
            return 0
        return 1 if plan.any_top_k_top_p and len(plans) > 1 else None

    def profile_scratch(self, rows: int, dtype: torch.dtype) -> None:
        """Run the widest sampling stages this sampler's own ``__call__`` has (top-k / top-p
        writing a divided, filtered copy, as with drafts to verify; then the Gumbel kernel)
        once over ``rows`` dummy logits, so a caller measuring peak memory (the runner,
        before it sizes the KV cache) counts their scratch: the top-k / top-p tail graphs
        and eager steps of as many rows need it."""
        device = self.state.temperature.device
        logits = torch.randn(rows, self.state.vocab_size, device=device).to(dtype)
        ones = torch.ones(rows, device=device)
        scaled = top_k_top_p(logits, torch.full((rows,), 20, dtype=torch.int32, device=device),
                             ones * 0.9, temperature=ones)
        out = torch.empty(rows, dtype=torch.int64, device=device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        gumbel_sample(scaled, zeros, zeros, ones < 0, out, None)

    def plan(self, batch: InputBatch) -> SamplePlan:
        """The stages ``batch`` needs, from CPU flags only (no device reads)."""
        state = self.state
        rows = batch.idx_mapping_cpu[: batch.num_reqs]
        plan = SamplePlan(
            all_greedy=bool(state.greedy[rows].all()),
            any_min_p=bool(state.min_p_on[rows].any()),
            any_top_k_top_p=bool(state.top_k_top_p[rows].any()),
        )
        if batch.token_bitmasks:  # (a row a logits row: the token's, then each draft's)
            for b, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
                masks = batch.token_bitmasks.get(req_id)
                if masks is not None:
                    first = int(batch.cu_num_logits[b])
                    assert len(masks) == int(batch.cu_num_logits[b + 1]) - first, req_id
                    plan.bitmasks.extend((first + j, mask) for j, mask in enumerate(masks))
        if state.num_rare == 0:
            return plan
        for b in np.flatnonzero(state.rare[rows]).tolist():
            row = int(rows[b])
            params = state.params[row]
            for r in range(int(batch.cu_num_logits[b]), int(batch.cu_num_logits[b + 1])):
                plan.rare.append((r, params))
            if params.logprobs is not None:
                plan.max_logprobs = max(plan.max_logprobs, params.logprobs)
            k = params.prompt_logprobs
            if k is not None:
                position = int(batch.num_computed_cpu[b])
                start = int(batch.query_start_loc_cpu[b])
                n = int(batch.query_start_loc_cpu[b + 1]) - start
                count = max(0, min(position + n, int(state.prompt_len_cpu[row]) - 1) - position)
                if count:
                    plan.prompt_chunks.append(
                        PromptChunk(batch.req_ids[b], row, start, position, count, k)
                    )
        return plan

    def __call__(
        self, logits: torch.Tensor, batch: InputBatch, table: RequestStateTable,
        plan: SamplePlan | None = None,
    ) -> SamplerOutput:
        """Sample one token per logits row of ``batch`` (``logits``: ``[num_logits, V]``)."""
        plan = plan if plan is not None else self.plan(batch)
        state = self.state
        # structured outputs' masks first, in place on the model's logits (as on a decode
        # graph's): a constrained request's logprobs are those of its masked logits, as vLLM's
        # (its runner masks the logits before its sampler reads the raw logprobs)
        self.apply_bitmasks(logits, plan)
        raw = logits
        if self.processors or plan.rare:  # in-place stages work on an fp32 copy
            logits = logits.float()
            if plan.max_logprobs >= 0 and logits.data_ptr() == raw.data_ptr():
                logits = logits.clone()  # the in-place stages must not touch the raw logits
        for processor in self.processors:
            processor.apply(logits, batch, table)
        idx = batch.logits_idx_mapping
        if plan.rare:
            # bias and masks before the penalties, as vLLM: a repetition penalty scales a
            # biased logit
            apply_masks(logits, idx, table, state, plan.rare, batch.logits_positions)
            if state.output_counts is not None and any(p.uses_penalties for _, p in plan.rare):
                assert state.prompt_mask is not None
                apply_penalties(logits, idx, state.output_counts, state.prompt_mask,
                                state.repetition_penalty, state.frequency_penalty,
                                state.presence_penalty)
                if batch.max_draft_tokens:  # a draft row counts the drafts before it too
                    penalize_drafts(logits, batch, state.output_counts, state.prompt_mask,
                                    state.repetition_penalty, state.frequency_penalty,
                                    state.presence_penalty)
        verifies = bool(batch.max_draft_tokens) and (self.verify_method == "synthetic" or (
            self.verify_method == "probabilistic" and not plan.all_greedy))
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if not verifies and (plan.all_greedy or not (plan.any_min_p or plan.any_top_k_top_p)):
            # the common plan: the kernel reads each row's seed and temperature itself (no
            # gathers, comparison or their launches: a decode step's sampling tail)
            gumbel_sample_rows(logits, idx, state.seed, state.temperature,
                               batch.logits_positions, out, _GREEDY_EPS)
            return self._with_logprobs(raw, out, plan)
        rows = idx.long()
        temperature = state.temperature[rows]
        greedy = temperature < _GREEDY_EPS
        scale: torch.Tensor | None = None  # the temperature, when the sampling kernel applies it
        cut: torch.Tensor | None = None  # top-k / top-p thresholds the sampling kernel applies
        if not plan.all_greedy:
            divisor = torch.where(greedy, 1.0, temperature)
            if (plan.any_top_k_top_p and not plan.any_min_p and not verifies
                    and os.environ.get(TOP_K_KEYS_ENV_VAR, "1") != "0"):
                # the filter's thresholds only, over the divided logits: the sampling kernel
                # divides and cuts as it reads (no filtered copy written, nor read back)
                cut = top_k_top_p_keys(logits, state.top_k[rows], state.top_p[rows], divisor)
                scale = temperature
            elif plan.any_min_p or plan.any_top_k_top_p:
                undivided = True
                if plan.any_min_p:  # one pass (the same IEEE quotient as ``x.float() / t``)
                    logits = apply_min_p(divide_rows(logits, divisor), state.min_p[rows])
                    undivided = False
                if plan.any_top_k_top_p:  # dividing first unless min-p did (then in place)
                    logits = top_k_top_p(logits, state.top_k[rows], state.top_p[rows],
                                         out=None if undivided else logits,
                                         temperature=divisor if undivided else None)
            else:  # (drafts to verify, temperature alone) the sampling kernel divides
                scale = temperature
        seeds = state.seed[rows]
        gumbel_sample(logits, seeds, batch.logits_positions, greedy, out, scale, cut)
        verify = None
        if verifies:
            # ``scale``: the kernel divided by the temperature; else ``logits`` already was
            verify_t = scale if scale is not None else torch.ones_like(temperature)
            verify = VerifyInputs(logits, torch.where(greedy, 0.0, verify_t), seeds,
                                  batch.logits_positions, self.synthetic_rate)
        return self._with_logprobs(raw, out, plan, verify)

    def _with_logprobs(self, raw: torch.Tensor, out: torch.Tensor, plan: SamplePlan,
                       verify: VerifyInputs | None = None) -> SamplerOutput:
        """The sampled ``out`` with their log-probabilities from the ``raw`` logits where the
        plan asks for them."""
        if plan.max_logprobs < 0:
            return SamplerOutput(out, verify=verify)
        ids, values, rank = token_logprobs(raw, out, plan.max_logprobs, self.raw_logits)
        return SamplerOutput(out, ids, values, rank, verify)

    @staticmethod
    def apply_bitmasks(logits: torch.Tensor, plan: SamplePlan) -> None:
        """Structured outputs' masks of ``plan`` on ``logits`` (in place): every token a row's
        mask disallows to -inf. ``__call__`` does it; the runner does it to a decode graph's
        logits before replaying a sampling tail (whose plan has no masks)."""
        if plan.bitmasks:
            apply_token_bitmask(logits, [b for b, _ in plan.bitmasks],
                                np.stack([m for _, m in plan.bitmasks]))

    def prompt_logprobs(
        self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
        table: RequestStateTable, plan: SamplePlan,
    ) -> list[PromptLogprobs]:
        """Prompt logprobs of the plan's prompt chunks, from the step's hidden states."""
        if not plan.prompt_chunks:
            return []
        return compute_prompt_logprobs(hidden, compute_logits, table, plan.prompt_chunks)

    def record_sampled(self, batch: InputBatch, samples: StepSamples) -> None:
        """After the post-update: count the sampled tokens for penalties (device only)."""
        self.state.record_sampled(batch.idx_mapping, samples.tokens, samples.num_sampled)


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
