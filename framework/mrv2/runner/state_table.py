"""The persistent request-state table: one stable row per live request, on the device.

A request takes a row from the free list when it arrives and keeps it until it finishes
(preemption is a finish, resumption a new request). Each step's tensors are gathered through
``idx_mapping`` (batch position -> row); nothing is expanded per request on the CPU.

The CPU keeps only counts (``num_computed``, prefill length) as a mirror; token values live on
the device and are written there by the post-update kernel.

Penalties read two ``[rows, vocab]`` tensors: ``output_counts`` (int32, times each token was
generated) and ``prompt_mask`` (bool, tokens of the prompt). They are allocated on the first
request that asks for a penalty (never, for workloads without penalties), refused with a clear
error when ``rows * vocab`` exceeds :data:`PENALTY_STATE_MAX_ELEMENTS`, reset per row when a
request takes the row, and incremented on the device after each sample (:meth:`record_sampled`),
so sampled tokens never pass through the CPU. The alternative, rebuilding counts from
``token_ids`` every step, costs O(batch * seq_len) scatter work per step instead of
O(batch); the persistent tensors cost 5 bytes per (row, token): 190 MB for 256 rows of a
152K vocabulary, acceptable on the GPUs we target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.sample.params import SamplingParams

#: Largest ``rows * vocab`` for which the penalty state (5 bytes per element) is allocated.
PENALTY_STATE_MAX_ELEMENTS = 2**29


@dataclass
class RowInfo:
    """CPU-side counts of one live row (no token values)."""

    req_id: str
    prefill_len: int
    num_computed: int
    greedy: bool
    top_k: bool
    top_p: bool
    min_p: bool
    params: SamplingParams | None = None
    """The request's params (for the rarely-used stages that build small index tensors)."""

    @property
    def special(self) -> bool:
        """True when a rarely-used sampler stage (penalty, bias, masks, logprobs) is needed."""
        p = self.params
        return p is not None and bool(
            p.uses_penalties or p.logit_bias or p.allowed_token_ids or p._bad_words_token_ids
            or (p.min_tokens > 0 and (p._eos_token_ids or p.stop_token_ids))
            or p.logprobs is not None or p.prompt_logprobs is not None
        )


class RequestStateTable:
    """Device tensors of ``max_num_reqs`` rows plus the CPU mirror of their counts."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.token_ids = zeros(max_num_reqs, max_model_len, dtype=torch.int32)
        self.num_computed = zeros(max_num_reqs, dtype=torch.int32)
        self.num_tokens = zeros(max_num_reqs, dtype=torch.int32)
        self.block_table = zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.temperature = zeros(max_num_reqs, dtype=torch.float32)
        self.top_k = zeros(max_num_reqs, dtype=torch.int32)
        self.top_p = zeros(max_num_reqs, dtype=torch.float32)
        self.min_p = zeros(max_num_reqs, dtype=torch.float32)
        self.seed = zeros(max_num_reqs, dtype=torch.int64)
        self.repetition_penalty = torch.ones(max_num_reqs, dtype=torch.float32, device=device)
        self.frequency_penalty = zeros(max_num_reqs, dtype=torch.float32)
        self.presence_penalty = zeros(max_num_reqs, dtype=torch.float32)
        self.min_tokens = zeros(max_num_reqs, dtype=torch.int32)
        # The original prompt's length (a resumed request's earlier outputs excluded): the
        # boundary min_tokens and bad words measure the output from.
        self.prefill_len = zeros(max_num_reqs, dtype=torch.int32)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        #: Live rows using a rarely-used sampler stage; 0 lets the sampler skip them all.
        self.num_special = 0
        self.num_penalty_rows = 0

        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.rows: dict[str, int] = {}
        self.info: dict[int, RowInfo] = {}
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.rows)

    def allocate(self, info: RowInfo) -> int:
        """Take a free row for ``info.req_id``."""
        if info.req_id in self.rows:
            raise ValueError(f"request {info.req_id!r} is already in the state table")
        if not self._free_rows:
            raise RuntimeError(
                f"state table full: {self.max_num_reqs} rows (raise max_num_seqs)"
            )
        row = self._free_rows.pop()
        self.rows[info.req_id] = row
        self.info[row] = info
        self.num_blocks[row] = 0
        self.num_special += info.special
        self.num_penalty_rows += bool(info.params and info.params.uses_penalties)
        return row

    def release(self, req_id: str) -> int:
        """Return ``req_id``'s row to the free list; the row's device data is left stale."""
        row = self.rows.pop(req_id)
        info = self.info.pop(row)
        self.num_special -= info.special
        self.num_penalty_rows -= bool(info.params and info.params.uses_penalties)
        self._free_rows.append(row)
        return row

    def row_of(self, req_id: str) -> int:
        """The row of a live request; a clear error for an unknown id."""
        try:
            return self.rows[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is not in the state table") from None

    def ensure_penalty_state(self, vocab_size: int) -> None:
        """Allocate ``output_counts`` / ``prompt_mask`` (once); a clear error when too large."""
        if self.output_counts is not None:
            return
        elements = self.max_num_reqs * vocab_size
        if elements > PENALTY_STATE_MAX_ELEMENTS:
            raise ValueError(
                f"penalties need {elements} per-token counters (max_num_seqs="
                f"{self.max_num_reqs} x vocab {vocab_size}), more than "
                f"{PENALTY_STATE_MAX_ELEMENTS}: lower max_num_seqs to use penalties"
            )
        shape = (self.max_num_reqs, vocab_size)
        self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def record_sampled(
        self, idx_mapping: torch.Tensor, sampled: torch.Tensor, do_sample: torch.Tensor
    ) -> None:
        """Count each sampled token in its row's ``output_counts`` (device only, no sync)."""
        if self.output_counts is None or self.num_penalty_rows == 0:
            return
        self.output_counts.index_put_(
            (idx_mapping.long(), sampled.long()), do_sample.to(torch.int32), accumulate=True
        )
