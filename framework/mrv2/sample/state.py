"""The sampler's own per-request columns, indexed by the state table's rows.

Device: float parameters ``[6, R]`` (temperature, top-p, min-p and the three penalties), int
parameters ``[4, R]`` (top-k, seed, min_tokens, prompt length), one contiguous row per
parameter (kernels read a parameter's column as a plain ``[R]`` tensor); written by one staged
``index_put`` each when requests take rows. Penalties read two ``[R, vocab]`` tensors:
``output_counts`` (int32, times each token was generated) and ``prompt_mask`` (bool, tokens of
the prompt), allocated on the first request that asks for a penalty (never, for workloads
without penalties), refused with a clear error when ``R * vocab`` exceeds
:data:`PENALTY_STATE_MAX_ELEMENTS`, reset per row when a request takes the row, and incremented
on the device after each sample, so sampled tokens never pass through the CPU. (Rebuilding
counts from the token table every step would cost O(batch x seq_len) per step instead of
O(batch); the persistent tensors cost 5 bytes per (row, token): 190 MB for 256 rows of a 152K
vocabulary.)

CPU: per-row flags (greedy, top-k/top-p, min-p, rare stages) as numpy arrays, so a batch's
sampler plan is a few vectorized lookups, and the params of rows that use a rarely-used stage.
A new sampling parameter adds a column here and its stage in the sampler: nothing outside
``sample/`` changes.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.contract.params import SamplingParams
from mrv2.contract.staged_edits import StagedEdits

#: Largest ``rows * vocab`` for which the penalty state (5 bytes per element) is allocated.
PENALTY_STATE_MAX_ELEMENTS = 2**29

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty")
_INTS = ("top_k", "seed", "min_tokens", "prompt_len")
#: The int columns' largest value: a ``top_k`` or ``min_tokens`` past it (validation bounds
#: neither) is stored as it, which means the same (top-k off, min_tokens never reached).
_INT64_MAX = 2**63 - 1


def uses_rare_stage(p: SamplingParams) -> bool:
    """True when a request needs a rarely-used stage (penalty, bias, masks, logprobs); a
    structured output's mask is not one (the step's bitmasks say which rows it masks)."""
    return bool(
        p.uses_penalties or p.logit_bias or p.allowed_token_ids or p._bad_words_token_ids
        or (p.min_tokens > 0 and (p._eos_token_ids or p.stop_token_ids))
        or p.logprobs is not None or p.prompt_logprobs is not None
    )


class SamplingState:
    """Sampling parameters of ``max_num_reqs`` rows, on the device and as CPU flags."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.floats = torch.zeros(len(_FLOATS), max_num_reqs, dtype=torch.float32, device=device)
        self.ints = torch.zeros(len(_INTS), max_num_reqs, dtype=torch.int64, device=device)
        self.greedy = np.ones(max_num_reqs, dtype=bool)
        self.top_k_top_p = np.zeros(max_num_reqs, dtype=bool)
        self.min_p_on = np.zeros(max_num_reqs, dtype=bool)
        self.rare = np.zeros(max_num_reqs, dtype=bool)
        self.prompt_len_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: dict[int, SamplingParams] = {}
        #: Live rows using a rarely-used stage; 0 lets the sampler skip them all.
        self.num_rare = 0
        self.num_penalty_rows = 0
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    # Column views (device, [R]).
    @property
    def temperature(self) -> torch.Tensor:
        return self.floats[0]

    @property
    def top_p(self) -> torch.Tensor:
        return self.floats[1]

    @property
    def min_p(self) -> torch.Tensor:
        return self.floats[2]

    @property
    def repetition_penalty(self) -> torch.Tensor:
        return self.floats[3]

    @property
    def frequency_penalty(self) -> torch.Tensor:
        return self.floats[4]

    @property
    def presence_penalty(self) -> torch.Tensor:
        return self.floats[5]

    @property
    def top_k(self) -> torch.Tensor:
        return self.ints[0]

    @property
    def seed(self) -> torch.Tensor:
        return self.ints[1]

    @property
    def min_tokens(self) -> torch.Tensor:
        return self.ints[2]

    @property
    def prompt_len(self) -> torch.Tensor:
        """The original prompt's length (a resumed request's earlier outputs excluded): the
        boundary penalties, min_tokens and bad words measure the output from."""
        return self.ints[3]

    def add(self, row: int, params: SamplingParams, seed: int, token_ids: list[int],
            staged: StagedEdits) -> None:
        """A request with ``params`` took ``row``; its ``token_ids`` entered with it."""
        self.add_many([row], [params], [seed], [token_ids], staged)

    def add_many(self, rows: list[int], params: list[SamplingParams], seeds: list[int],
                 token_ids: list[list[int]], staged: StagedEdits) -> None:
        """Requests took ``rows`` (one ``params``, seed and entering ``token_ids`` each): two
        staged puts for all of them, whatever their number (a burst of prompts is admitted in
        one step; per request the puts cost ~10 µs of host time)."""
        n = len(rows)
        if not n:
            return
        for p in params:  # (the penalty state's error before any row changes)
            self.check_params(p)
        at = np.asarray(rows, dtype=np.int64)
        prompt_lens = [p.prompt_len(len(t)) for p, t in zip(params, token_ids, strict=True)]
        floats = np.array([[p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                            p.frequency_penalty, p.presence_penalty] for p in params],
                          dtype=np.float32)
        ints = np.array([[min(p.top_k, _INT64_MAX), seed, min(p.min_tokens, _INT64_MAX), plen]
                         for p, seed, plen in zip(params, seeds, prompt_lens, strict=True)],
                        dtype=np.int64)
        # column-major index: parameter j of every row, then parameter j + 1 (the values
        # transposed to match)
        staged.put(self.floats, (np.repeat(np.arange(len(_FLOATS)), n), np.tile(at, len(_FLOATS))),
                   floats.T.reshape(-1))
        staged.put(self.ints, (np.repeat(np.arange(len(_INTS)), n), np.tile(at, len(_INTS))),
                   ints.T.reshape(-1))
        self.greedy[at] = [p.greedy for p in params]
        self.top_k_top_p[at] = [p.top_k > 0 or p.top_p < 1.0 for p in params]
        self.min_p_on[at] = [p.min_p > 0.0 for p in params]
        rare = [uses_rare_stage(p) for p in params]
        self.rare[at] = rare
        self.prompt_len_cpu[at] = prompt_lens
        self.num_rare += sum(rare)
        for row, p, tokens, prompt_len in zip(rows, params, token_ids, prompt_lens, strict=True):
            self.params[row] = p
            if p.uses_penalties:
                self._add_penalty_row(row, tokens, prompt_len, staged)

    def _add_penalty_row(self, row: int, token_ids: list[int], prompt_len: int,
                         staged: StagedEdits) -> None:
        """Reset ``row``'s penalty counts: its prompt's tokens marked, a resumed request's
        earlier outputs counted."""
        self.num_penalty_rows += 1
        if self.output_counts is None:  # (its size checked by add_many)
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.output_counts is not None and self.prompt_mask is not None
        rows = np.array([row])
        staged.fill(self.output_counts, rows, 0)
        staged.fill(self.prompt_mask, rows, False)
        prompt = np.asarray(token_ids[:prompt_len], dtype=np.int64)
        staged.put(self.prompt_mask, (np.full(len(prompt), row), prompt),
                   np.ones(len(prompt), dtype=bool))
        if prompt_len < len(token_ids):  # a resumed request: its earlier outputs count
            outs = np.asarray(token_ids[prompt_len:], dtype=np.int64)
            staged.put(self.output_counts, (np.full(len(outs), row), outs),
                       np.ones(len(outs), dtype=np.int32), accumulate=True)

    @property
    def penalty_state_elements(self) -> int:
        """Elements of each penalty counter (``max_num_seqs x vocab``)."""
        return self.max_num_reqs * self.vocab_size

    def penalty_state_bytes(self) -> int:
        """Device bytes of the penalty counters (``output_counts`` and ``prompt_mask``)."""
        return self.penalty_state_elements * 5

    def release_penalty_state(self) -> bool:
        """Free the penalty counters while no row uses a penalty (the next penalty request
        allocates them again, as the first one did). Returns whether there were any. The
        start-up warm-up runs penalty requests, so their kernels compile before the first
        real one, then gives their memory back."""
        if self.num_penalty_rows:
            raise RuntimeError(f"{self.num_penalty_rows} rows still use penalties")
        held = self.output_counts is not None
        self.output_counts = self.prompt_mask = None
        return held

    def remove(self, row: int) -> None:
        """The request of ``row`` left."""
        params = self.params.pop(row)
        self.num_rare -= bool(self.rare[row])
        self.num_penalty_rows -= params.uses_penalties
        self.rare[row] = False

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field when ``params`` cannot take a row here: a
        penalty whose per-token counters (``max_num_seqs x vocab``) would pass
        :data:`PENALTY_STATE_MAX_ELEMENTS`. Changes nothing; the engine calls it (through
        :meth:`~mrv2.sample.sampler.Sampler.check_params`) before it queues a request."""
        if not params.uses_penalties or self.output_counts is not None:
            return
        elements = self.penalty_state_elements
        if elements > PENALTY_STATE_MAX_ELEMENTS:
            field, value = next((f, getattr(params, f)) for f, off in (
                ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                ("presence_penalty", 0.0)) if getattr(params, f) != off)
            raise ValueError(
                f"{field}={value}: penalties need {elements} per-token counters (max_num_seqs="
                f"{self.max_num_reqs} x vocab {self.vocab_size}), more than "
                f"{PENALTY_STATE_MAX_ELEMENTS}: lower max_num_seqs to at most "
                f"{PENALTY_STATE_MAX_ELEMENTS // self.vocab_size}, or send the request without "
                "repetition_penalty, frequency_penalty and presence_penalty"
            )

    def record_sampled(
        self, idx_mapping: torch.Tensor, tokens: torch.Tensor, num_sampled: torch.Tensor
    ) -> None:
        """Count each request's kept tokens in ``output_counts`` (device only, no sync):
        ``tokens`` ``[num_reqs, 1 + drafts]``, the first ``num_sampled`` of a row kept (its
        accepted drafts and the token after them)."""
        if self.output_counts is None or self.num_penalty_rows == 0:
            return
        n, width = tokens.shape
        rows = idx_mapping[:n].long()
        if width == 1:
            self.output_counts.index_put_(
                (rows, tokens[:, 0].clamp(min=0)), (num_sampled[:n] > 0).to(torch.int32),
                accumulate=True)
            return
        kept = torch.arange(width, device=tokens.device)[None, :] < num_sampled[:n, None]
        self.output_counts.index_put_(
            (rows[:, None].expand(n, width), tokens.clamp(min=0)), kept.to(torch.int32),
            accumulate=True)
